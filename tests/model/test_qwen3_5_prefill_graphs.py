"""Hybrid (Gated DeltaNet) prompts through prefill graph buckets: the padded static batch runs the
DeltaNet layers' steps path over every padded row and advances the slot over the real tokens
only, so its last-token logits, recurrent state and conv window are the eager chunked prefill's.
GraphSettings(capture=False) runs the static batches eagerly (CPU); `gpu` tests capture them."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.graph_settings import GraphSettings
from lucebox.engine.step_plan import StepPlan, recurrent_prefill_graph_max
from lucebox.model.deltanet import GatedDeltaNet
from lucebox.model.loader import load_model
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import BLOCK_SIZE, HYBRID, prompts, runner_for

SETTINGS = GraphSettings(128, max_batch=2, query_lens=(1, 4), prefill_lens=(16, 32, 64), capture=False)


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_5_prefill"), tokenizer_dir, **HYBRID)


def states(layers):
    return [(layer.state.state.clone(), layer.state.conv.clone()) for layer in layers]


@pytest.mark.parametrize("route", ["steps", "chunks"])
@pytest.mark.parametrize("cached", [0, 9], ids=["fresh", "on-a-cached-context"])
@pytest.mark.parametrize("new_tokens", [12, 30, 50])
def test_a_hybrid_prefill_bucket_gives_the_eager_logits_and_state(hybrid_path, cached, new_tokens, route,
                                                                  monkeypatch):
    """Either route of the bucket's DeltaNet rows: token by token (steps), or the chunked rule over the
    padded bucket whose padding g = beta = 0 keeps out of the state (LUCEBOX_BUCKET_CHUNKS=1)."""
    monkeypatch.setenv("LUCEBOX_BUCKET_CHUNKS", "1" if route == "chunks" else "0")
    calls = []
    real = GatedDeltaNet._bucket_chunk
    monkeypatch.setattr(GatedDeltaNet, "_bucket_chunk", lambda self, *a: calls.append(1) or real(self, *a))
    loaded = load_model(str(hybrid_path), dtype="float32", device="cpu")  # states built on the CPU
    runner, blocks = runner_for(loaded)
    layers = [loaded.model.layers[i].linear_attn for i in runner.recurrent_layers]
    runner.install_recurrent([layer.cache_spec().build(4, 4, "cpu") for layer in layers], None)
    runner.attach_graphs(SETTINGS)
    table, slot = [], [1]
    blocks.allocate(table, cached + new_tokens)
    runner.reset_states(slot)
    vocab = loaded.config.vocab_size
    if cached:
        runner.run_eager(StepPlan.forward(prompts(vocab, [cached], seed=5), [0], [table], state_slots=slot))
    before = states(layers)
    plan = StepPlan.forward(prompts(vocab, [new_tokens], seed=6), [cached], [table], state_slots=slot)
    want = runner.run_eager(plan).logits
    eager = states(layers)
    for layer, (state, conv) in zip(layers, before):
        layer.state.state.copy_(state)
        layer.state.conv.copy_(conv)
    got = runner.run(plan).logits
    assert sum(n for (b, q), n in runner.graphs.replays.items() if q >= 16) == 1  # a prefill bucket took it
    assert bool(calls) == (route == "chunks")
    assert got.shape == want.shape == (1, vocab) and (got - want).abs().max().item() <= 1e-4
    for layer, (state, conv), (eager_state, _) in zip(layers, eager, before):
        assert (layer.state.state[1] - state[1]).abs().max() <= 1e-5  # the chunk path's final state
        # the window ends at the last real token (products over a padded batch may round differently)
        assert (layer.state.conv[1] - conv[1]).abs().max() <= 1e-6
        assert not torch.equal(state[1], eager_state[1])


@pytest.mark.parametrize("route", ["steps", "chunks"])
def test_greedy_hybrid_generation_with_prefill_graphs_equals_eager(hybrid_path, route, monkeypatch):
    """Fresh prompts in one bucket each, and prompts repeating a cached prefix (a recurrent-state
    snapshot loaded, the remainder through a bucket); the buckets' DeltaNet rows either route."""
    monkeypatch.setenv("LUCEBOX_BUCKET_CHUNKS", "1" if route == "chunks" else "0")
    assert recurrent_prefill_graph_max() == (2048 if route == "chunks" else 512)  # chunks: every bucket length
    vocab = 96
    base = prompts(vocab, [60], seed=7)[0]
    batch = [base[:40], base, base[:44] + prompts(vocab, [20], seed=8)[0], prompts(vocab, [100], seed=9)[0]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs, replays = {}, None
    for graphs in (False, True):
        llm = LLM(str(hybrid_path), device="cpu", block_size=BLOCK_SIZE, max_num_seqs=2, cuda_graphs=True,
                  speculative_config={}, prefill_graphs=graphs)
        runner = llm.engine.runner
        settings = llm.engine._graph_settings()
        # DeltaNet steps token by token (<= 512), and no bucket outgrows the tiny model's 256 positions
        assert settings.prefill_lens == ((64, 128, 256) if graphs else ())
        runner.attach_graphs(replace(settings, capture=False))
        outputs[graphs] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                           for p in batch]
        replays = runner.graphs.replays
        assert llm.engine.scheduler.cache.snapshots.loaded >= 2  # the repeats started from a cached prefix
        assert len(llm.engine.scheduler.cache.free_slots) == 2
    assert outputs[True] == outputs[False], dict(replays)
    assert replays[(1, 64)] >= 1 and replays[(1, 128)] >= 1, dict(replays)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("route", ["steps", "chunks"])
def test_captured_hybrid_prefill_buckets_generate_what_eager_prefills_do(hybrid_path, route, monkeypatch):
    """chunks: the chunked rule (fla-core's kernel where installed) captured in the buckets."""
    monkeypatch.setenv("LUCEBOX_BUCKET_CHUNKS", "1" if route == "chunks" else "0")
    batch = [prompts(96, [n], seed=10 + n)[0] for n in (40, 300)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for graphs in (False, True):
        llm = LLM(str(hybrid_path), device="cuda", dtype="float32", block_size=BLOCK_SIZE, max_model_len=1024,
                  prefill_graphs=graphs, speculative_config={}, kv_cache_memory=64 << 20)
        outputs[graphs] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                           for p in batch]
        if graphs:
            assert all(llm.engine.runner.graphs.replays[(1, q)] >= 1 for q in (64, 512))
        del llm
    assert outputs[True] == outputs[False]
