"""The DFlash drafter-side KV pool (spec/draft_pool.py, --draft-kv-pool-tokens): a draft pass attends
to exactly the resident positions (sink, tail, chosen chunks) at their logical positions, in the
eager and the graph-style path alike; a pool as large as the context changes no bit; generation
stays token-identical to plain decoding (lossless) with a small pool."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.config import EngineArgs, SpeculativeConfig
from lucebox.default_model import BUNDLED, BUNDLED_DRAFTER
from lucebox.errors import RequestError
from lucebox.kernels.rope import apply_rope
from lucebox.model.kv_pool.view import KVView
from lucebox.spec import dflash_graphs, draft_pool
from lucebox.spec.dflash_graphs import DrafterGraphs
from lucebox.spec.draft_pool import CHUNK_TOKENS, DraftPool
from lucebox.spec.factory import make_speculator

from tests.spec_fixtures import write_dflash_drafter

BLOCK = 4  # KV block: a 64-token chunk is 16 blocks
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POOL = 320  # the smallest pool: sink chunk, a three-chunk tail, one chosen chunk


@pytest.fixture(params=["full", "sliding"])
def proposer(request, hf_models, tmp_path):
    """A DFlash proposer on the qwen3 test target, its drafter cache filled with random K/V."""
    overrides = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 40,
                 "use_sliding_window": True} if request.param == "sliding" else {}
    drafter = write_dflash_drafter(hf_models["qwen3"], tmp_path / "dflash", **overrides)
    llm = LLM(str(hf_models["qwen3"]), device="cpu", block_size=BLOCK, max_model_len=1024,
              speculative_config={"method": "dflash", "model": str(drafter), "adaptive": False})
    prop = llm.engine.speculator.proposer
    torch.manual_seed(1)
    for k, v in prop.caches:
        k.values.normal_()
        v.values.normal_()
    return prop, llm.engine.runner.num_blocks


def a_sequence(num_blocks: int, num_tokens: int, seed: int, **extra):
    rng = random.Random(seed)
    table = rng.sample(range(num_blocks), -(-num_tokens // BLOCK) + 2)  # room for the verify's positions
    return SimpleNamespace(block_table=table, num_tokens=num_tokens, last_token=rng.randrange(300),
                           output_token_ids=[], prompt_token_ids=[], **extra)


def static_graphs(prop, num_blocks: int) -> DrafterGraphs:
    return DrafterGraphs(prop.drafter, prop.target.model, prop.caches, BLOCK, num_blocks, 1024,
                         prop.mask_token_id, capture=False)


def reference_logits(prop, seq, positions: list[int]) -> torch.Tensor:
    """The drafter's logits over exactly the context `positions` (logical), gathered from its cache."""
    anchor = seq.num_tokens - 1
    pos = torch.tensor(positions)
    slots = torch.tensor(seq.block_table)[pos // BLOCK] * BLOCK + pos % BLOCK
    context = [(k.gather(slots, torch.float32), v.gather(slots, torch.float32)) for k, v in prop.caches]
    target = prop.target.model
    ids = torch.tensor([seq.last_token] + [prop.mask_token_id] * (prop.block_size - 1))
    hidden = prop.drafter.blocks(prop.drafter.block_input(target, ids), torch.arange(anchor, anchor + prop.block_size),
                                 context, pos)
    return prop.drafter.logits(target.head_logits(hidden[1:]))


def resident_positions(view: KVView, anchor: int) -> list[int]:
    blocks = [*view.selected, *range(view.tail_from, -(-anchor // BLOCK))]
    return [p for b in blocks for p in range(b * BLOCK, (b + 1) * BLOCK) if p < anchor]


def test_flag_validation_names_what_is_wrong():
    assert EngineArgs().draft_kv_pool_tokens == 0
    assert EngineArgs(draft_kv_pool_tokens=4096).draft_kv_pool_tokens == 4096
    for value, message in ((100, "not a multiple of the pool's 64-token chunk"), (-64, "integer >= 0"),
                           (256, "below the smallest pool of 320"), (True, "integer >= 0"), ("512", "integer >= 0")):
        with pytest.raises(RequestError, match=message):
            EngineArgs(draft_kv_pool_tokens=value)
    from lucebox.cli import build_parser, engine_args
    args = engine_args(build_parser().parse_args(["generate", "--draft-kv-pool-tokens", "1024"]))
    assert args.draft_kv_pool_tokens == 1024


def test_the_factory_hands_the_pool_to_dflash_and_refuses_it_elsewhere(hf_models, tmp_path):
    llm = LLM(str(hf_models["qwen3"]), device="cpu", block_size=BLOCK)
    drafter = write_dflash_drafter(hf_models["qwen3"], tmp_path / "dflash")
    spec = make_speculator(SpeculativeConfig(method="dflash", model=str(drafter)), llm.engine.loaded, 256,
                           draft_kv_pool_tokens=512)
    assert spec.proposer.pool_tokens == 512 and spec.proposer.query_tap is not None
    with pytest.raises(RequestError, match="draft_kv_pool_tokens bounds a DFlash drafter's context; .*'ngram'"):
        make_speculator(SpeculativeConfig(method="ngram"), llm.engine.loaded, 256, draft_kv_pool_tokens=512)
    with pytest.raises(RequestError, match="block size dividing its 64-token chunk, got block_size 48"):
        DraftPool(spec.proposer.drafter, [], 512, 48, spec.proposer.query_tap)


@pytest.mark.parametrize("path", ["eager", "graphs"])
def test_a_pool_as_large_as_the_context_changes_no_bit(proposer, path):
    prop, num_blocks = proposer
    seq = a_sequence(num_blocks, 700, seed=4)
    k = prop.block_size - 1
    with torch.inference_mode():
        if path == "graphs":
            prop.graphs = static_graphs(prop, num_blocks)
        want = prop._draft_logits(seq, k).clone()
        prop.enable_pool(704)
        got = prop._draft_logits(seq, k)
    assert torch.equal(got, want)
    assert prop.pool.selections == 0


@pytest.mark.parametrize("anchor", [400, 700, 1000])
def test_a_small_pool_attends_to_exactly_the_resident_positions(proposer, anchor, monkeypatch):
    """Eager and graph-style passes equal the drafter over the sink, chosen and tail positions, at
    their logical positions (RoPE, windows); the graph runs in the bucket of the pool, not the context."""
    monkeypatch.setattr(dflash_graphs, "MIN_CONTEXT", 64)
    prop, num_blocks = proposer
    seq = a_sequence(num_blocks, anchor + 1, seed=anchor)
    k = prop.block_size - 1
    with torch.inference_mode():
        full = prop._draft_logits(seq, k).clone()
        prop.enable_pool(POOL)
        eager = prop._draft_logits(seq, k).clone()  # selects the view; the graph-style pass below keeps it
        view = prop.pool.sequences[id(seq)].view
        prop.graphs = static_graphs(prop, num_blocks)
        graphs = prop._draft_logits(seq, k)
        positions = resident_positions(view, anchor)
        want = reference_logits(prop, seq, positions)
    assert prop.pool.selections == 1
    assert len(positions) <= POOL and positions[:CHUNK_TOKENS] == list(range(CHUNK_TOKENS))
    assert positions[-1] == anchor - 1
    assert (eager - want).abs().max() <= 1e-5
    assert (graphs - want).abs().max() <= 1e-5
    assert (full - want).abs().max() > 1e-3  # the pool really drops context
    assert [key for key in prop.graphs.graphs] == [("draft", 512)]  # from the view's length, not 1024


def test_the_drafters_own_queries_pick_the_chunk_that_matches_them(proposer):
    """Chunk keys equal to the (rotated) block queries score highest; with no queries yet, recency."""
    prop, num_blocks = proposer
    prop.enable_pool(POOL)
    anchor = 1000
    seq = a_sequence(num_blocks, anchor + 1, seed=9)
    cache_k = prop.caches
    kv_heads, dim = cache_k[0][0].num_kv_heads, cache_k[0][0].head_dim
    heads = prop.drafter.config.model.num_heads
    matched = 7  # chunk 7 of 16: not a sink or tail chunk, not the most recent candidate
    pool = prop.pool
    with torch.inference_mode():
        recency = pool.reselect(seq, anchor)
        # the sink and the chunk just before the tail
        assert recency.selected == tuple(range(0, 16)) + tuple(range(16 * 12, 16 * 13))
        torch.manual_seed(3)
        direction = torch.randn(len(cache_k), kv_heads, dim)
        pos = torch.arange(matched * CHUNK_TOKENS, (matched + 1) * CHUNK_TOKENS)
        slots = torch.tensor(seq.block_table)[pos // BLOCK] * BLOCK + pos % BLOCK
        for layer, (k, _) in enumerate(cache_k):
            k.write(direction[layer].expand(len(slots), kv_heads, dim), slots)
        queries = direction.repeat_interleave(heads // kv_heads, 1)  # [layers, heads, dim], rotated
        rows = torch.arange(anchor, anchor + prop.block_size)
        cos, sin = prop.drafter.rope.lookup(rows, torch.float32)
        unrotated = torch.stack([apply_rope(q.expand(len(rows), heads, dim), cos, -sin) for q in queries])
        state = pool.sequences[id(seq)]
        state.keys = None  # pooled afresh from the rewritten cache
        state.queries, state.query_anchor = unrotated, anchor
        scored = pool.reselect(seq, anchor)
    assert scored.selected == tuple(range(0, 16)) + tuple(range(16 * matched, 16 * (matched + 1)))
    assert scored.tail_from == 16 * 13


def test_the_targets_view_bounds_what_the_drafter_reads(proposer):
    """A bounded target KV (seq.kv_view) is what the drafter reads, before any pool of its own."""
    prop, num_blocks = proposer
    view = KVView(tuple(range(0, 16)) + tuple(range(64, 96)), 160, BLOCK)
    seq = a_sequence(num_blocks, 701, seed=2, kv_view=view)
    k = prop.block_size - 1
    with torch.inference_mode():
        eager = prop._draft_logits(seq, k).clone()
        prop.graphs = static_graphs(prop, num_blocks)
        graphs = prop._draft_logits(seq, k)
        want = reference_logits(prop, seq, resident_positions(view, 700))
    assert (eager - want).abs().max() <= 1e-5
    assert (graphs - want).abs().max() <= 1e-5


def greedy(llm, prompts, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("graphs", ["static", pytest.param("captured", marks=gpu)])
def test_graph_generation_with_a_small_pool_equals_plain_decoding(graphs, hf_models, tmp_path, monkeypatch):
    """Static: the graph bodies run eagerly on the CPU. Captured: the pool is enabled after the engine
    captured its drafter graphs, which are then captured again with the query hooks inside."""
    monkeypatch.setattr(draft_pool, "RESELECT_INTERVAL", 16)  # reselect several times in 40 tokens
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "dflash")
    prompts = [{"prompt_token_ids": [(7 * i + j * j) % 300 + 3 for j in range(n)]}
               for i, n in enumerate((90, 400, 700))]
    common = dict(device="cuda" if graphs == "captured" else "cpu", dtype="float32", block_size=BLOCK,
                  max_model_len=1024, kv_cache_memory=64 << 20)
    want = [o.outputs[0].token_ids for o in greedy(LLM(str(target), **common), prompts, 40)]
    llm = LLM(str(target), cuda_graphs=True, **common,
              speculative_config={"method": "dflash", "model": str(drafter), "adaptive": False})
    prop = llm.engine.speculator.proposer
    if graphs == "static":
        prop.graphs = static_graphs(prop, llm.engine.runner.num_blocks)
    prop.enable_pool(POOL)
    outs = greedy(llm, prompts, 40)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert prop.pool.selections > 4 and not prop.pool.sequences  # released with their sequences
    drafts = {size: graph for (kind, size), graph in prop.graphs.graphs.items() if kind == "draft"}
    assert max(drafts) == 512  # never the 1024 bucket of the longest context
    assert all((graph is not None) == (graphs == "captured") for graph in drafts.values())


@pytest.mark.skipif(not (BUNDLED_DRAFTER / "config.json").is_file(), reason="the drafter is not bundled")
def test_bundled_pair_with_a_small_drafter_pool_is_lossless():
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex frozen jam".split()
    rng = random.Random(0)
    story = " ".join(rng.choice(words) for _ in range(250))  # ~520 tokens
    prompts = [story + "\n\ndef fibonacci(n):"]
    small = dict(max_model_len=1024, kv_cache_memory=64 << 20)
    plain = [o.outputs[0].token_ids for o in greedy(LLM(str(BUNDLED), speculative_config={}, **small), prompts, 48)]
    taus = {}
    for pool in (0, POOL):
        llm = LLM(str(BUNDLED), speculative_config={"method": "dflash", "model": str(BUNDLED_DRAFTER),
                                                     "adaptive": False}, **small)
        prop = llm.engine.speculator.proposer
        prop.enable_pool(pool)
        outs = greedy(llm, prompts, 48)
        assert [o.outputs[0].token_ids for o in outs] == plain
        assert all(len(o.prompt_token_ids) > POOL for o in outs)
        taus[pool] = 1 + sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_drafts for o in outs)
        if pool:
            assert prop.pool.selections > 0
    print(f"\nbundled pair, T = 0, a ~520-token prompt: tau full drafter context {taus[0]:.2f}, "
          f"{POOL}-token drafter pool {taus[POOL]:.2f}")
    assert taus[POOL] > 1.0


def test_a_dflash2_drafter_drafts_alike_through_graphs_and_eagerly_with_a_pool(hf_models, tmp_path, monkeypatch):
    """DFlash2 reuses the DFlash passes: with the pool its greedy drafts are the same eagerly and
    through the graph bodies, and the output equals plain decoding."""
    from tests.spec.test_dflash2 import record_drafts, write_dflash2_drafter
    monkeypatch.setattr(draft_pool, "RESELECT_INTERVAL", 16)
    target = hf_models["qwen3"]
    drafter = write_dflash2_drafter(target, tmp_path / "d", block_size=4, seed=6)
    prompts = [{"prompt_token_ids": [(5 * i + j * j) % 300 + 3 for j in range(n)]} for i, n in enumerate((350, 600))]
    common = dict(device="cpu", dtype="float32", block_size=BLOCK, max_model_len=1024, kv_cache_memory=64 << 20)
    plain = [o.outputs[0].token_ids for o in greedy(LLM(str(target), **common), prompts, 24)]
    runs = []
    for use_graphs in (False, True):
        llm = LLM(str(target), cuda_graphs=use_graphs, **common,
                  speculative_config={"method": "dflash", "model": str(drafter), "adaptive": False})
        prop = llm.engine.speculator.proposer
        if use_graphs:
            prop.graphs = static_graphs(prop, llm.engine.runner.num_blocks)
        prop.enable_pool(POOL)
        drafted = record_drafts(prop)
        runs.append(([o.outputs[0].token_ids for o in greedy(llm, prompts, 24)], drafted))
        assert prop.pool.selections > 2
    assert runs[0] == runs[1]
    assert runs[0][0] == plain
