"""Tensor parallelism over two gloo processes for the Qwen 3.5 hybrids: TP=2 computes what TP=1 computes.

Each rank keeps its own Gated DeltaNet heads' recurrent state; rank 0's cache manager resets, commits
(after verifies), compacts and snapshots slots, and rank 1 follows. Float32 logits agree within
reduction-order error, greedy tokens exactly, with speculation (n-gram; DFlash chains and trees) and with
prefix snapshots reused across requests."""
from __future__ import annotations

import re

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.convert import convert_hf_to_gguf
from lucebox.engine.step_plan import PlanRow, RowKind, StepPlan
from lucebox.errors import UnsupportedError
from lucebox.weights.quant import PermutedInputQuantLinear, QuantLinear
from tests.conftest import build_hf_model
from tests.engine.test_tensor_parallel import PROMPTS, engine_kwargs
from tests.model.test_gguf_hybrid import ARCHS
from tests.model.test_qwen3_5 import HYBRID
from tests.model.test_qwen3_5_moe import HYBRID_MOE
from tests.spec_fixtures import write_dflash_drafter

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
BLOCK = 4  # small blocks: prompts cross several boundaries, so prefix snapshots are taken and reused


def hybrid_kwargs(**extra) -> dict:
    return engine_kwargs(block_size=BLOCK) | extra


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one bare forward (the last blocks of each KV cache group's pool), from a
    fresh recurrent slot where the model has recurrent layers (reset on every rank)."""
    engine = llm.engine
    cache, runner = engine.scheduler.cache, engine.runner
    slots = None
    if cache.recurrent:
        slots = [cache.free_slots[0]]
        for state in cache.states:
            state.reset(torch.tensor(slots))
    blocks = -(-len(ids) // runner.block_size)
    table, *windows = [list(range(pool - blocks, pool)) for pool in (runner.num_blocks, *runner.group_scratch)]
    plan = StepPlan.forward([ids], [0], [table], window_tables=[windows], all_logits=True, state_slots=slots)
    return runner.run(plan).logits


def outputs(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("tp-hybrid")
    return {name: build_hf_model("qwen3", root / name, tokenizer_dir, **spec)
            for name, spec in (("dense", HYBRID), ("moe", HYBRID_MOE))}


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_hybrid_tp2_equals_tp1_with_ngram_speculation_and_prefix_snapshots(models, name):
    model = str(models[name])
    plain = LLM(model, speculative_config={}, **hybrid_kwargs())
    ids = plain.tokenizer.encode(PROMPTS[0])
    logits, tokens = all_logits(plain, ids), outputs(plain)
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, tensor_parallel_size=2,
              **hybrid_kwargs())
    try:
        engine, cfg = llm.engine, llm.engine.loaded.config
        net = next(layer.linear_attn for layer in engine.model.layers if layer.kind == "linear_attention")
        assert (net.num_k_heads, net.num_v_heads) == (cfg.linear_num_key_heads // 2, cfg.linear_num_value_heads // 2)
        assert engine.scheduler.cache.states[0].state.shape[1] == cfg.linear_num_value_heads // 2  # its heads' state
        got = all_logits(llm, ids)
        assert (got - logits).abs().max().item() <= 1e-4
        assert outputs(llm) == tokens
        assert engine.step_counts["verify"] > 0  # drafts verified, the accepted ones committed on both ranks
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # from the prompts' snapshots, on both ranks
        assert all(out.num_cached_tokens > 0 for out in again)
        assert engine.scheduler.cache.snapshots.loaded > 0
        assert [out.outputs[0].token_ids for out in again] == tokens
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tree_budget", [None, 8])
def test_hybrid_tp2_dflash_chains_and_trees_stay_token_identical(models, tmp_path, tree_budget):
    # tree verifies compact each rank's stash onto the accepted path before the commit
    model = models["dense"]
    drafter = write_dflash_drafter(model, tmp_path / "dflash", taps=(0, 2), block_size=4)
    tokens = outputs(LLM(str(model), speculative_config={}, **hybrid_kwargs()))
    spec = {"method": "dflash", "model": str(drafter)} | ({"tree_budget": tree_budget} if tree_budget else {})
    llm = LLM(str(model), speculative_config=spec, tensor_parallel_size=2, **hybrid_kwargs())
    try:
        assert outputs(llm) == tokens
        assert llm.engine.step_counts["verify"] > 0
    finally:
        llm.engine.shutdown()


def tree_then_decode(llm: LLM, prompt: list[int], tree: list[int], path: list[int]) -> torch.Tensor:
    """Prefill `prompt` into a fresh slot, verify a draft tree after it, accept the tree's `path` (each rank's
    stash compacted onto it, the state committed, the K/V rows moved), then decode: that step's logits."""
    engine = llm.engine
    cache, runner = engine.scheduler.cache, engine.runner
    slot = cache.free_slots[0]
    for state in cache.states:
        state.reset(torch.tensor([slot]))
    table = list(range(4))
    runner.run(StepPlan.forward([prompt], [0], [table], state_slots=[slot]))
    tokens = [(7 * i + 3) % 200 for i in range(len(tree))]
    row = PlanRow(tokens, len(prompt), table, RowKind.VERIFY, parents=tree)
    runner.run(StepPlan([row], all_logits=True, state_slots=[slot]))
    base = slot * cache.verify_positions
    moves = [(base + row, base + k) for k, row in enumerate(path) if row != k]
    for pool in cache.pools:
        pool.compact_stash(*(torch.tensor(rows) for rows in zip(*moves)))
        pool.commit(torch.tensor([slot]), torch.tensor([len(path) - 1]))
    runner.compact_tree_rows([table], [len(prompt)], [path])
    start = len(prompt) + len(path)
    return runner.run(StepPlan.forward([[tokens[path[-1]]]], [start], [table], state_slots=[slot])).logits


def test_each_rank_compacts_its_stash_onto_an_accepted_tree_path(models):
    # the path leaves the first chain (rows 0, 2, 3): the moves, the commit and the K/V compaction reach rank 1,
    # whose heads' state the next decode reads
    model, spec = str(models["dense"]), {"method": "ngram", "num_speculative_tokens": 3}
    prompt, tree, path = list(range(5, 14)), [-1, 0, 0, 2], [0, 2, 3]
    expected = tree_then_decode(LLM(model, speculative_config=spec, **hybrid_kwargs()), prompt, tree, path)
    llm = LLM(model, speculative_config=spec, tensor_parallel_size=2, **hybrid_kwargs())
    try:
        assert llm.engine.scheduler.cache.verify_positions >= len(tree)
        assert (tree_then_decode(llm, prompt, tree, path) - expected).abs().max().item() <= 1e-4
    finally:
        llm.engine.shutdown()


def test_q8_0_hybrid_moe_gguf_shards_on_whole_blocks_and_tp2_equals_tp1(tokenizer_dir, tmp_path):
    # three value heads a key head, tiled by llama.cpp: ssm_out's stored columns of rank r's six value heads are
    # three runs of two 32-value heads, gathered in whole Q8_0 blocks and read in another order than stored;
    # experts and shared expert 32 wide a rank
    spec = ARCHS["qwen35moe"] | {"linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_value_head_dim": 32,
                                 "moe_intermediate_size": 64}
    hf_dir = build_hf_model("qwen3", tmp_path / "hf", tokenizer_dir, **spec)
    model = str(convert_hf_to_gguf(hf_dir, tmp_path / "q8.gguf", "q8_0"))
    plain = LLM(model, speculative_config={}, **hybrid_kwargs())
    ids = plain.tokenizer.encode(PROMPTS[0])
    logits, tokens = all_logits(plain, ids), outputs(plain)
    llm = LLM(model, speculative_config={}, tensor_parallel_size=2, **hybrid_kwargs())
    try:
        layer = llm.engine.model.layers[0]
        out_proj, shared = layer.linear_attn.out_proj.local, layer.mlp.moe.shared_expert
        assert isinstance(out_proj, PermutedInputQuantLinear) and out_proj.in_features == 6 * 32
        assert isinstance(shared.down_proj, QuantLinear) and shared.down_proj.in_features == 32
        assert (all_logits(llm, ids) - logits).abs().max().item() <= 1e-4
        assert outputs(llm) == tokens
    finally:
        llm.engine.shutdown()


def test_a_preempted_hybrid_sequence_resumes_token_identical_on_both_ranks(models):
    # a pool too small for the batch: a preempted sequence's slot is freed and, readmitted, reset on every rank
    from tests.engine.test_hybrid_preemption import MAX_LEN, POOL_BLOCKS, SEQS
    from tests.engine.test_hybrid_preemption import engine as single
    from tests.model.test_qwen3_5 import prompts
    model = models["dense"]
    roomy = single(model)
    requests = [{"prompt_token_ids": p} for p in prompts(roomy.engine.loaded.config.vocab_size, [9, 6, 11], seed=4)]
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True, logprobs=0)
    reference = roomy.generate(requests, params, use_tqdm=False)
    cache = roomy.engine.scheduler.cache  # each rank keeps half the heads: half the bytes for the same blocks
    budget = cache.bytes_per_sequence * SEQS + cache.snapshot_bytes + cache.bytes_per_token * BLOCK * POOL_BLOCKS
    llm = LLM(str(model), block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=SEQS, max_num_batched_tokens=32,
              speculative_config={}, kv_cache_memory=budget // 2, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.num_blocks == POOL_BLOCKS
        outs = llm.generate(requests, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        for out, ref in zip(outs, reference):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            got = [v.logprob for d in out.outputs[0].logprobs for v in d.values()]
            assert got == pytest.approx([v.logprob for d in ref.outputs[0].logprobs for v in d.values()], abs=1e-4)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("spec, count", [(HYBRID | {"linear_num_key_heads": 3, "linear_num_value_heads": 6},
                                          "linear_num_key_heads (3)"),
                                         (HYBRID_MOE | {"shared_expert_intermediate_size": 49},
                                          "shared_expert_intermediate_size (49)")])
def test_what_does_not_split_is_refused_naming_the_count(tokenizer_dir, tmp_path, spec, count):
    hf_dir = build_hf_model("qwen3", tmp_path / "hybrid", tokenizer_dir, **spec)
    with pytest.raises(UnsupportedError, match=re.escape(f"--tensor-parallel-size 2 does not divide the model's {count}")):
        LLM(str(hf_dir), speculative_config={}, tensor_parallel_size=2, **hybrid_kwargs())


def test_sharding_a_fused_hybrid_is_refused(models):
    """shard_model needs the projections unfused: DeltaNet's fused input projections count, as q/k/v's do."""
    from lucebox.model.loader import load_model
    from lucebox.model.tensor_parallel import shard_model
    loaded = load_model(str(models["dense"]), dtype="float32", device="cpu")
    for layer in loaded.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.fuse()
    with pytest.raises(RuntimeError, match="before fuse_projections"):
        shard_model(loaded.model, 0, 2)
