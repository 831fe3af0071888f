"""Laguna through CUDA-graph batches: the padded static batches a graph replays (capture=False runs
them eagerly on the CPU) give the eager greedy output, plain and speculative; a padded step through
the Triton kernels (interpreted on the CPU) gives the torch reference's logits. Tests marked `gpu`
capture real graphs and skip without CUDA."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # before any Triton import; see test_triton_kernels.py
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox import LLM  # noqa: E402
from lucebox.engine.graph_settings import GraphSettings  # noqa: E402
from lucebox.engine.step_plan import PlanRow, RowKind, StepPlan  # noqa: E402
from lucebox.model.loader import load_model  # noqa: E402
from tests.model.test_laguna import build_laguna  # noqa: E402
from tests.model.test_qwen3_5 import BLOCK_SIZE, prompts, runner_for  # noqa: E402
from tests.model.test_qwen3_5_spec import NGRAM, greedy, repetitive_prompts  # noqa: E402

gpu = pytest.mark.skipif(not ON_GPU, reason="captures CUDA graphs")


@pytest.fixture(scope="module")
def laguna_path(tmp_path_factory, tokenizer_dir):
    return build_laguna(tmp_path_factory.mktemp("laguna_graphs"), tokenizer_dir)


def padded_step(loaded, device: str, capture: bool):
    """A runner with graph buckets (1 and 4 tokens) after prefilling 3 sequences past the window, and
    a step of one decode row, a verify of 4 and a verify of 3 (padded to 4)."""
    model = loaded.model.to(device)
    model.fuse_projections()
    runner, blocks = runner_for(loaded)
    runner.attach_graphs(GraphSettings(64, max_batch=4, query_lens=(1, 4), capture=capture))
    vocab = loaded.config.vocab_size
    starts = [7, 10, 9]
    tables = []
    for n in starts:
        tables.append([])
        blocks.allocate(tables[-1], n + 4)
    runner.run_eager(StepPlan.forward(prompts(vocab, starts, seed=3), [0] * 3, tables))
    kinds = [RowKind.DECODE, RowKind.VERIFY, RowKind.VERIFY]
    rows, offset = [], 0
    for i, (tokens, start, table, kind) in enumerate(zip(prompts(vocab, [1, 4, 3], seed=4), starts, tables, kinds)):
        rows.append(PlanRow(tokens, start, table, kind, offset=offset, index=i))
        offset += len(tokens)
    return runner, StepPlan(rows, all_logits=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_a_padded_static_step_gives_the_eager_logits(laguna_path, device):
    loaded = load_model(str(laguna_path), dtype="float32", device=device)
    runner, plan = padded_step(loaded, device, capture=device == "cuda")
    want = runner.run_eager(plan).logits
    got = runner.run(plan).logits
    assert runner.graphs.replays[(4, 4)] == 1
    assert (got - want).abs().max().item() <= 1e-4


def test_a_padded_step_through_triton_kernels_matches_the_torch_reference(laguna_path, monkeypatch):
    """Paged attention over per-layer head counts and windows, RoPE + KV write with q/k norms, the
    expert kernels: Triton (interpreted on the CPU) against the torch reference."""
    pytest.importorskip("triton")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    device = "cuda" if ON_GPU else "cpu"
    loaded = load_model(str(laguna_path), dtype="float32", device=device)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    runner, plan = padded_step(loaded, device, capture=False)
    want = runner.run_eager(plan).logits
    calls = count_calls(monkeypatch, ("kernels.triton_paged_attention", "paged_attention"),
                        ("kernels.triton_rope_kv", "rope_and_write_kv"), ("model.moe", "expert_matmul"))
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got = runner.run(plan).logits
    assert runner.graphs.replays[(4, 4)] == 1
    assert (got - want).abs().max().item() <= 1e-4
    assert calls == {"paged_attention": 4, "rope_and_write_kv": 4, "expert_matmul": 3}  # partial rotary too


def count_calls(monkeypatch, *functions) -> dict:
    """Calls of lucebox.<module>.<name> from now on, by name."""
    import importlib
    calls = {name: 0 for _, name in functions}
    for module, name in functions:
        module = importlib.import_module(f"lucebox.{module}")
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_greedy_generation_through_padded_static_batches_equals_eager(laguna_path, config):
    # each engine's KV bounded: on a GPU the default pool takes most of the card, and both engines live at once
    eager = LLM(str(laguna_path), block_size=BLOCK_SIZE, max_num_seqs=4, speculative_config=config,
                kv_cache_memory=64 << 20)
    batch = repetitive_prompts(eager.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(eager, batch, 16)]
    llm = LLM(str(laguna_path), block_size=BLOCK_SIZE, max_num_seqs=4, speculative_config=config, cuda_graphs=True,
              kv_cache_memory=64 << 20)
    runner = llm.engine.runner
    runner.attach_graphs(replace(llm.engine._graph_settings(), capture=False))
    assert [o.outputs[0].token_ids for o in greedy(llm, batch, 16)] == want
    replayed = runner.graphs.replays
    assert sum(n for (_, q), n in replayed.items() if q == 1) > 0
    if config is not None:  # (whether a verify fits a bucket depends on its batch's padding)
        assert llm.engine.step_counts["verify"] > 0


@gpu
@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_greedy_generation_is_identical_with_and_without_graphs(laguna_path, config):
    outputs = []
    for graphs in (False, True):
        llm = LLM(str(laguna_path), device="cuda", dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=4,
                  speculative_config=config, cuda_graphs=graphs, kv_cache_memory=64 << 20)
        batch = repetitive_prompts(llm.engine.loaded.config.vocab_size)
        outputs.append([o.outputs[0].token_ids for o in greedy(llm, batch, 24)])
        assert (llm.engine.runner.graphs is not None) == graphs
        del llm
    assert outputs[0] == outputs[1]


@gpu
def test_bfloat16_prefill_and_decode_stay_close_to_float32(laguna_path):
    """The GPU kernels in bfloat16 track the float32 torch reference on the CPU: a prefill past the
    window, then 3 decodes."""
    vocab = load_model(str(laguna_path), dtype="float32").config.vocab_size
    prompt, after = prompts(vocab, [150, 3], seed=8)
    logits = []
    for dtype, device in (("float32", "cpu"), ("bfloat16", "cuda")):
        runner, blocks = runner_for(load_model(str(laguna_path), dtype=dtype, device=device))
        table = []
        blocks.allocate(table, len(prompt) + len(after))
        rows = [runner.forward([prompt], [0], [table])]
        for i, token in enumerate(after):
            rows.append(runner.forward([[token]], [len(prompt) + i], [table]))
        logits.append(torch.cat(rows).float().cpu())
    err = ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()).item()
    assert err <= 5e-2
