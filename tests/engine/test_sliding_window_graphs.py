"""Mixed sliding-window / full-attention models on the padded static batches CUDA graphs replay (capture off
on the CPU) and through captured graphs on a GPU: every KV cache group's tables and slots are static inputs."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucebox import LLM
from lucebox.engine.graph_settings import GraphSettings
from tests.engine.test_sliding_window_mixed import (  # noqa: F401  (module-scoped fixtures)
    BLOCK,
    GREEDY,
    KV_MEMORY,
    Driver,
    assert_pools_empty,
    ids,
    mixed,
    prompts,
    reference,
    reference_greedy,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")


def test_engine_static_batches_take_every_group_table(mixed, reference):
    """The engine's padded static batches (what CUDA graphs replay; capture off on the CPU), overlapped
    decodes and n-gram verifies included, give transformers' greedy output."""
    repeated = [{"prompt_token_ids": p["prompt_token_ids"] * 2} for p in prompts(4, seed=6)]
    want = [reference_greedy(reference, p["prompt_token_ids"]) for p in repeated]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False}):
        llm = LLM(mixed, device="cpu", block_size=BLOCK, kv_cache_memory=KV_MEMORY, cuda_graphs=True,
                  speculative_config=spec)
        llm.engine.runner.attach_graphs(replace(llm.engine._graph_settings(), capture=False))
        assert ids(llm.generate(repeated, GREEDY, use_tqdm=False)) == want
        assert sum(llm.engine.runner.graphs.replays.values()) > 10  # steps of the four sequences at once
        assert_pools_empty(llm)


def graph_steps(path: str, capture: bool) -> list[torch.Tensor]:
    """Logits of prefill, decodes and verifies of one sequence on the GPU, through captured graphs
    (capture=True; steps that fit a bucket) or eagerly."""
    settings = GraphSettings(max_model_len=96, max_batch=2, query_lens=(1, 5)) if capture else None
    run = Driver(path, graphs=settings, device="cuda")
    if capture:
        run.runner.capture_graphs()
    sequence = torch.randint(0, 380, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    out = []
    for tokens in [sequence[:13]] + [[t] for t in sequence[13:30]] + [sequence[30:35], sequence[35:40]] \
            + [[t] for t in sequence[40:64]]:
        out.append(run.run(tokens))
        run.commit(tokens)
    if capture:
        graphs = run.runner.graphs
        assert sum(graphs.replays.values()) == len(out) - 1 and all(g is not None for g, _ in graphs.graphs.values())
    return out


@gpu
def test_cuda_graph_logits_equal_eager_on_a_mixed_model(mixed):
    """Captured graphs read each group's static tables and slots: decode and verify logits equal the
    eager steps' as the window group releases and reuses blocks (free ones NaN-poisoned)."""
    eager, graphs = graph_steps(mixed, False), graph_steps(mixed, True)
    for a, b in zip(eager, graphs):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


@gpu
def test_engine_with_cuda_graphs_equals_eager_on_a_mixed_model(mixed):
    repeated = [{"prompt_token_ids": p["prompt_token_ids"] * 2} for p in prompts(6, seed=8)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False}
    outputs = []
    for eager in (True, False):
        llm = LLM(mixed, device="cuda", dtype="float32", block_size=BLOCK, kv_cache_memory=64 << 20,
                  cuda_graphs=not eager, speculative_config=spec)
        outputs.append(ids(llm.generate(repeated, GREEDY, use_tqdm=False)))
        if not eager:
            assert sum(llm.engine.runner.graphs.replays.values()) > 10
        assert_pools_empty(llm)
        del llm
    assert outputs[0] == outputs[1]
