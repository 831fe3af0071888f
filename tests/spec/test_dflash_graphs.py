"""The DFlash drafter's CUDA-graph bodies (lucebox/spec/dflash_graphs.py) compute what the eager,
ragged drafter computes: draft logits over a padded, masked context bucket, and context K/V
projected in padded chunks. On the CPU the static bodies run eagerly (capture=False); on a GPU
the captured graphs are also compared, and greedy generation through them equals plain decoding."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.model.feature_ring import FeatureRing, RingRows
from lucebox.spec import dflash_graphs, draft_attention
from lucebox.spec.dflash_graphs import DrafterGraphs, context_bucket
from lucebox.spec.draft_attention import KEY_SPLIT
from tests.spec_fixtures import write_dflash_drafter

BLOCK = 4
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.fixture(params=["full", "sliding"])
def proposer(request, hf_models, tmp_path):
    """A DFlash proposer on the qwen3 test target, its drafter cache filled with random K/V."""
    overrides = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
                 "use_sliding_window": True} if request.param == "sliding" else {}
    drafter = write_dflash_drafter(hf_models["qwen3"], tmp_path / "dflash", **overrides)
    llm = LLM(str(hf_models["qwen3"]), device="cpu", block_size=BLOCK,
              speculative_config={"method": "dflash", "model": str(drafter), "adaptive": False})
    prop = llm.engine.speculator.proposer
    assert (prop.drafter.layers[0].self_attn.sliding_window is not None) == (request.param == "sliding")
    torch.manual_seed(1)
    for k, v in prop.caches:
        k.values.normal_()
        v.values.normal_()
    return prop, llm.engine.runner.num_blocks


def static_graphs(prop, num_blocks: int, max_model_len: int = 200) -> DrafterGraphs:
    return DrafterGraphs(prop.drafter, prop.target.model, prop.caches, BLOCK, num_blocks, max_model_len,
                         prop.mask_token_id, capture=False)


def a_sequence(num_blocks: int, num_tokens: int, seed: int):
    rng = random.Random(seed)
    table = rng.sample(range(num_blocks), -(-num_tokens // BLOCK))
    return SimpleNamespace(block_table=table, num_tokens=num_tokens, last_token=rng.randrange(300),
                           output_token_ids=[], prompt_token_ids=[])


def test_context_buckets_are_powers_of_two_covering_the_anchor_then_whole_key_slices():
    assert [context_bucket(a) for a in (0, 1, 256, 257, 1000, 1024, 1025)] == [256, 256, 256, 512, 1024, 1024, 2048]
    assert KEY_SPLIT == 16384 and context_bucket(16384) == 16384 and context_bucket(16385) == 32768
    assert context_bucket(131_072 + 9) == 9 * KEY_SPLIT  # a power of two would span 262,144 positions


@pytest.mark.parametrize("anchor, queued", [(1, 0), (5, 3), (16, 1), (17, 0), (40, 12), (63, 8)])
def test_padded_draft_logits_equal_the_eager_drafter(proposer, anchor, queued, monkeypatch):
    """`queued` positions before the anchor still wait for projection: the draft graph projects up
    to a block of them itself (more go through the projection graphs first)."""
    monkeypatch.setattr(dflash_graphs, "MIN_CONTEXT", 16)  # several buckets at test sizes
    prop, num_blocks = proposer
    seq = a_sequence(num_blocks, anchor + 1, seed=anchor)
    features = torch.randn(queued, prop.drafter.fc.in_features)
    caches = [(k.values.clone(), v.values.clone()) for k, v in prop.caches]
    k = prop.block_size - 1
    with torch.inference_mode():
        prop.pending[id(seq)] = [(anchor - queued, features)] if queued else []
        want = prop._draft_logits(seq, k)
        for (kc, vc), (k0, v0) in zip(prop.caches, caches):
            kc.values.copy_(k0)
            vc.values.copy_(v0)
        prop.graphs = static_graphs(prop, num_blocks)
        prop.pending[id(seq)] = [(anchor - queued, features)] if queued else []
        got = prop._draft_logits(seq, k)
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-5
    assert id(seq) not in prop.pending


@pytest.mark.parametrize("anchor", [17, 63])
def test_long_context_key_slices_equal_the_eager_drafter(proposer, anchor, monkeypatch):
    """Past SPLIT_KEYS_ABOVE keys a draft attends in key slices (padded graph bodies: masked columns in
    whole slices too); both sides are sliced here, the graph's over its padded bucket."""
    monkeypatch.setattr(dflash_graphs, "MIN_CONTEXT", 16)
    prop, num_blocks = proposer
    seq = a_sequence(num_blocks, anchor + 1, seed=anchor)
    with torch.inference_mode():
        prop.pending[id(seq)] = []
        whole = prop._draft_logits(seq, prop.block_size - 1)
        monkeypatch.setattr(draft_attention, "SPLIT_KEYS_ABOVE", 8)
        monkeypatch.setattr(draft_attention, "KEY_SPLIT", 5)
        prop.pending[id(seq)] = []
        want = prop._draft_logits(seq, prop.block_size - 1)
        prop.graphs = static_graphs(prop, num_blocks)
        prop.pending[id(seq)] = []
        got = prop._draft_logits(seq, prop.block_size - 1)
    assert rel_err(want, whole) <= 1e-5 and rel_err(got, want) <= 1e-5


def test_buckets_of_whole_key_slices_equal_the_eager_drafter(proposer, monkeypatch):
    """Past one key slice a graph spans whole slices (here 3 x 32 positions for an anchor at 70, not 128)."""
    monkeypatch.setattr(dflash_graphs, "MIN_CONTEXT", 16)
    monkeypatch.setattr(dflash_graphs, "KEY_SPLIT", 32)
    monkeypatch.setattr(draft_attention, "KEY_SPLIT", 32)
    monkeypatch.setattr(draft_attention, "SPLIT_KEYS_ABOVE", 8)
    assert dflash_graphs.context_bucket(70) == 96
    prop, num_blocks = proposer
    seq = a_sequence(num_blocks, 71, seed=5)
    with torch.inference_mode():
        prop.pending[id(seq)] = []
        want = prop._draft_logits(seq, prop.block_size - 1)
        prop.graphs = static_graphs(prop, num_blocks)
        prop.pending[id(seq)] = []
        got = prop._draft_logits(seq, prop.block_size - 1)
    assert ("draft", 96) in prop.graphs.graphs and rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("split", [7, 11, 64])
def test_split_key_attention_equals_sdpa(groups, split, monkeypatch):
    monkeypatch.setattr(draft_attention, "KEY_SPLIT", split)
    g = torch.Generator().manual_seed(groups)
    heads, n, m, d = 4 * groups, 6, 50, 8
    q = torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(m, 4, d, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(n, m, generator=g) < 0.6
    mask[:, :11] = False  # a whole slice no query may read
    mask[:, -1] = True
    for attn_mask in (mask, None):
        want = torch.nn.functional.scaled_dot_product_attention(
            q, keys.transpose(0, 1).repeat_interleave(groups, 0), values.transpose(0, 1).repeat_interleave(groups, 0),
            attn_mask=attn_mask, scale=0.3)
        got = draft_attention.split_key_attention(q, draft_attention.key_slices(
            (keys[:-6], values[:-6]), keys[-6:], values[-6:], attn_mask), 0.3)
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def test_chunked_projection_writes_what_the_eager_projection_writes(proposer):
    prop, num_blocks = proposer
    seq = a_sequence(num_blocks, 1100, seed=3)
    taps = prop.drafter.fc.in_features
    torch.manual_seed(2)
    features = torch.randn(1100 - 7, taps)  # positions 7..1099: a chunk of 1024, then 69 padded to 256
    caches_before = [(k.values.clone(), v.values.clone()) for k, v in prop.caches]
    prop.pending[id(seq)] = [(7, features)]
    prop._project(seq)
    want = [(k.values.clone(), v.values.clone()) for k, v in prop.caches]
    for (k, v), (k0, v0) in zip(prop.caches, caches_before):
        k.values.copy_(k0)
        v.values.copy_(v0)
    prop.graphs = static_graphs(prop, num_blocks, max_model_len=1100)
    prop.pending[id(seq)] = [(7, features)]
    prop._project(seq)
    scratch = slice(num_blocks, num_blocks + 1)  # padding rows land in the scratch block only
    for (k, v), (wk, wv) in zip(prop.caches, want):
        for got, expected in ((k.values, wk), (v.values, wv)):
            assert rel_err(got[:num_blocks], expected[:num_blocks]) <= 1e-6
            assert not torch.equal(got[scratch], expected[scratch])
    assert sorted(key for key in prop.graphs.graphs) == [("project", 256), ("project", 1024)]


@pytest.mark.parametrize("graphs", ["static", pytest.param("captured", marks=gpu)])
def test_greedy_generation_with_drafter_graphs_equals_plain_decoding(graphs, hf_models, tmp_path):
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "dflash")
    device = "cuda" if graphs == "captured" else "cpu"
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate((5, 19, 33))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = []
    for config in (None, {"method": "dflash", "model": str(drafter), "adaptive": False}):
        llm = LLM(str(target), device=device, dtype="float32", block_size=BLOCK, speculative_config=config,
                  cuda_graphs=True, kv_cache_memory=16 << 20)
        if config is not None and graphs == "static":
            prop = llm.engine.speculator.proposer
            assert prop.graphs is None  # CPU: no captured graphs by default
            prop.graphs = static_graphs(prop, llm.engine.runner.num_blocks, llm.engine.max_model_len)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if config is not None:
            prop = llm.engine.speculator.proposer
            assert prop.graphs.replays > 0
            assert any(g is not None for g in prop.graphs.graphs.values()) == (graphs == "captured")
    assert outputs[0] == outputs[1]


def test_queued_ring_rows_are_projected_before_the_cursor_comes_round(proposer):
    prop, num_blocks = proposer
    width = prop.drafter.fc.in_features
    seq = a_sequence(num_blocks, 40, seed=5)
    features = torch.randn(20, width)
    caches = [(k.values.clone(), v.values.clone()) for k, v in prop.caches]
    prop.pending[id(seq)] = [(10, features)]
    prop._project(seq)  # eager, from the tensor: what the ring path must write
    want = [(k.values.clone(), v.values.clone()) for k, v in prop.caches]
    for (kc, vc), (k0, v0) in zip(prop.caches, caches):
        kc.values.copy_(k0)
        vc.values.copy_(v0)
    prop.graphs = static_graphs(prop, num_blocks)
    prop.feature_ring = FeatureRing(64, width, torch.float32, "cpu")
    first = prop.feature_rows(20)
    prop.feature_ring.rows[first:first + 20] = features  # what a graph step writes
    prop.observe(seq, 10, RingRows(first, 20))  # positions 10..29 queued, by their rows
    assert prop.feature_rows(32) == 20 and id(seq) in prop.pending  # rows 20..51: still queued
    assert prop.feature_rows(20) == 0 and id(seq) not in prop.pending  # wraps onto them: projected first
    for (k, v), (wk, wv) in zip(prop.caches, want):
        assert rel_err(k.values[:num_blocks], wk[:num_blocks]) <= 1e-6
        assert rel_err(v.values[:num_blocks], wv[:num_blocks]) <= 1e-6


@pytest.mark.parametrize("ring_bytes", [64 << 20, 1], ids=["roomy", "wrapping"])
def test_features_through_the_ring_keep_greedy_output_identical(ring_bytes, hf_models, tmp_path, monkeypatch):
    """Graph steps write captured features into the device ring and hand the drafter row ranges.
    A tiny ring wraps every few steps: rows still queued are projected before they are overwritten."""
    from dataclasses import replace

    from lucebox.engine.cuda_graphs import CudaGraphRunner
    from lucebox.spec import dflash

    monkeypatch.setattr(dflash, "RING_BYTES", ring_bytes)
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "dflash")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate((5, 19, 33))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(str(target), device="cpu", dtype="float32", block_size=BLOCK, kv_cache_memory=16 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=BLOCK, cuda_graphs=True, max_num_seqs=4,
              kv_cache_memory=16 << 20, speculative_config={"method": "dflash", "model": str(drafter),
                                                            "adaptive": False})  # a ring of 4 x 4 x 8 rows
    engine = llm.engine
    # the static batches, run eagerly; prompts eagerly too (a prefill bucket's taps would size the ring up)
    settings = replace(engine._graph_settings(), capture=False, prefill_lens=())
    runner, prop = engine.runner, engine.speculator.proposer
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block, settings)
    prop.allocate(runner.num_blocks, BLOCK, engine.scheduler.blocks, settings)
    runner.set_feature_ring(prop.feature_ring)
    observed, firsts = [], []
    observe, reserve = prop.observe, prop.feature_ring.reserve
    monkeypatch.setattr(prop, "observe", lambda seq, start, f: observed.append(type(f).__name__) or observe(seq, start, f))
    monkeypatch.setattr(prop.feature_ring, "reserve", lambda n: firsts.append(reserve(n)) or firsts[-1])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert "RingRows" in observed and "Tensor" in observed  # graph steps by rows, eager prefill by tensor
    wraps = sum(b < a for a, b in zip(firsts, firsts[1:]))
    assert (wraps > 2) == (ring_bytes == 1)
    assert not prop.pending
