"""Draft trees through the engine (speculative_config tree_budget): greedy output token-identical to
plain decoding across batch shapes, prefix-cache hits and stop positions; the accepted path's K/V
compacted (the cached blocks serve later prompts correctly); blocks back to baseline after many
rejected trees; sampled output with the target's distribution; sliding windows refused (hybrid
targets: tests/spec/test_ddtree_hybrid.py)."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from lucebox import LLM, SamplingParams
from lucebox.cli import build_parser, speculative_config
from lucebox.config import SpeculativeConfig
from lucebox.default_model import default_speculative_config
from lucebox.engine.cuda_graphs import CudaGraphRunner
from lucebox.errors import LuceboxError, RequestError, UnsupportedError
from tests.spec.test_spec import (  # noqa: F401
    PROMPT,
    chi_square_rejects,
    exact_pair_distribution,
    sample_pairs,
    small_pair,
)
from tests.spec_fixtures import write_dflash_drafter

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(small_pair, tmp_path_factory):
    """The 7-token peaked target and a random DFlash drafter: top-7 trees cover every next token, so
    most steps accept off the top-1 chain (compaction moves rows)."""
    target, _ = small_pair
    return target, write_dflash_drafter(target, tmp_path_factory.mktemp("tree-dflash"), block_size=4)


def tree_llm(target, drafter, budget: int, **kwargs) -> LLM:
    config = {"method": "dflash", "model": str(drafter), "tree_budget": budget, "adaptive": False}
    return LLM(str(target), block_size=4, speculative_config=config | kwargs.pop("spec", {}), **kwargs)


def small_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(6) for _ in range(rng.randint(2, 9))]} for _ in range(n)]


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_llm(pair):
    return LLM(str(pair[0]), block_size=4)


class CompactionSpy:
    """Counts the tree verifies whose accepted rows left the top-1 chain (their K/V moved)."""

    def __init__(self, llm: LLM):
        self.moved = 0
        runner = llm.engine.runner
        compact = runner.compact_tree_rows

        def spy(tables, starts, accepted, *windows):
            self.moved += len(accepted)
            compact(tables, starts, accepted, *windows)

        runner.compact_tree_rows = spy


@pytest.mark.parametrize("budget,batch", [(12, {}), (3, {}), (20, {"max_num_batched_tokens": 24})])
def test_greedy_trees_equal_plain_decoding(pair, plain_llm, budget, batch):
    """Several sequences at once; with a small token budget prompt chunks run beside tree verifies and
    trees are cut short (a DFS prefix); budget 3 (the depth count) is the three best nodes."""
    target, drafter = pair
    prompts = small_prompts(6)
    llm = tree_llm(target, drafter, budget, **batch)
    spy = CompactionSpy(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == token_ids(plain_llm, prompts, GREEDY)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert accepted > 0
    if budget > 3:
        assert spy.moved > 0
    engine = llm.engine
    assert engine.scheduler.blocks.num_free_blocks == engine.runner.num_blocks  # every block back


def test_the_adaptive_policy_prices_tree_rows_and_stays_lossless(pair, plain_llm):
    """With adaptive drafting (the default) the policy weighs a draft of depth k at its tree's width."""
    target, drafter = pair
    config = {"method": "dflash", "model": str(drafter), "tree_budget": 20}
    llm = LLM(str(target), block_size=4, speculative_config=config)
    policy = llm.engine.speculator.policy
    assert [policy.row_tokens(k) for k in (1, 2, 3)] == [1 + 16, 1 + 20, 1 + 20]  # top-16 per depth
    prompts = small_prompts(4, seed=12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(plain_llm, prompts, params)


def test_trees_chains_and_plain_rows_in_one_batch(pair, plain_llm):
    """n-gram lookups draft chains where the text repeats, the drafter trees elsewhere; a sequence whose
    max_tokens leaves no room decodes plainly beside them."""
    target, drafter = pair
    prompts = small_prompts(5, seed=3) + [{"prompt_token_ids": [0, 1, 2, 0, 1, 2, 0, 1]}]
    params = [GREEDY] * 5 + [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]
    llm = tree_llm(target, drafter, 10, spec={"ngram_first": True, "prompt_lookup_min": 1})
    assert token_ids(llm, prompts, params) == token_ids(plain_llm, prompts, params)
    steps = llm.engine.speculator.steps_by_source
    assert steps["model"] > 0 and steps["lookup"] > 0


def test_prefix_cache_hits_serve_the_compacted_kv(pair, plain_llm):
    """Prompts extending earlier prompts by their outputs hit the blocks those wrote through tree
    verifies: their continuations equal plain decoding, so the cached K/V are the committed tokens'."""
    target, drafter = pair
    prompts = small_prompts(4, seed=5)
    llm = tree_llm(target, drafter, 16)
    first = token_ids(llm, prompts, GREEDY)
    blocks = llm.engine.scheduler.blocks
    hits = blocks.hits
    longer = [{"prompt_token_ids": p["prompt_token_ids"] + out[:12]} for p, out in zip(prompts, first)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert token_ids(llm, longer, params) == token_ids(plain_llm, longer, params)
    assert blocks.hits - hits >= 4 * len(prompts)  # at least one block each (block size 4)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_stops_inside_a_tree_match_plain_decoding(pair, plain_llm, max_tokens):
    """max_tokens and stop tokens / strings that end the output in the middle of an accepted path."""
    target, drafter = pair
    prompts = small_prompts(4, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[3]),
              SamplingParams(temperature=0, max_tokens=20, stop=["c d"]),
              SamplingParams(temperature=0, max_tokens=20, stop=["e"], include_stop_str_in_output=True)]
    llm = tree_llm(target, drafter, 14)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = plain_llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason) == \
               (w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason)
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.runner.num_blocks


def test_preempted_sequences_with_trees_recompute_to_the_same_tokens(pair, plain_llm):
    """A pool too small for every sequence's tree rows at once: some are preempted and recomputed."""
    target, drafter = pair
    prompts = small_prompts(6, seed=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = tree_llm(target, drafter, 20, max_model_len=48, kv_cache_memory=50_000)
    engine = llm.engine
    assert engine.runner.num_blocks < 6 * 12  # fewer than the sequences' blocks at their ends
    assert token_ids(llm, prompts, params) == token_ids(plain_llm, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.blocks.num_free_blocks == engine.runner.num_blocks


def test_history_reading_params_and_logprobs_match_plain_decoding(pair, plain_llm):
    """Penalties read each node's own path; the logprobs of committed tokens come from their nodes' rows."""
    target, drafter = pair
    prompts = small_prompts(3, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=0.7, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=10, logprobs=1)]
    llm = tree_llm(target, drafter, 16)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = plain_llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids
        if w.logprobs is None:
            continue
        assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
        for a, b in zip(g.logprobs, w.logprobs):
            assert [v.logprob for v in a.values()] == pytest.approx([v.logprob for v in b.values()], abs=1e-4)


def test_trees_near_the_context_end_stay_inside_it(pair):
    """Near max_model_len a tree keeps only the nodes whose storage positions exist (a DFS prefix)."""
    target, drafter = pair
    prompts = small_prompts(4, seed=6)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
    plain = LLM(str(target), block_size=4, max_model_len=24)
    llm = tree_llm(target, drafter, 30, max_model_len=24)
    runner, ends = llm.engine.runner, []
    run_eager = runner.run_eager
    runner.run_eager = lambda plan: (ends.extend(r.start + len(r.tokens) for r in plan.rows), run_eager(plan))[1]
    got = llm.generate(prompts, params, use_tqdm=False)
    assert max(ends) == 24  # storage reaches the window's last position, never past it
    assert [o.outputs[0].token_ids for o in got] == token_ids(plain, prompts, params)
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 24 for o in got)
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.runner.num_blocks


def test_many_rejected_trees_leave_the_pool_as_they_found_it(hf_models, tmp_path):
    """A random drafter on a 387-token target: nearly every tree is rejected. Greedy output still equals
    plain decoding, and every block comes back, mid-run (held = what the committed tokens need) and at
    the end."""
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "d", block_size=6)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(380) for _ in range(rng.randint(3, 20))]} for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = tree_llm(target, drafter, 30)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        for seq in engine.scheduler.running:  # blocks cover the committed tokens and the next one only
            assert engine.scheduler.cache.held_blocks(seq) == -(-(seq.num_computed + 1) // 4)
    trees = sum(o.metrics.num_drafts for o in outputs.values())
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs.values())
    assert trees >= 40 and accepted < trees  # most trees rejected outright
    assert engine.scheduler.blocks.num_free_blocks == engine.runner.num_blocks
    plain = LLM(str(target), block_size=4)
    assert [outputs[str(i)].outputs[0].token_ids for i in range(5)] == token_ids(plain, prompts, params)


def static_graphs(llm: LLM) -> CudaGraphRunner:
    """The engine's graph buckets as static batches run eagerly (CPU), as tests/engine/test_cuda_graphs.py does."""
    runner = llm.engine.runner
    settings = replace(llm.engine._graph_settings(), capture=False)
    runner.graphs = CudaGraphRunner(runner.model, 4, runner.scratch_block, settings)
    return runner.graphs


def test_tree_rows_never_replay_a_chain_graph(pair, plain_llm):
    """Tree rows of 4 tokens fit the chain's verify bucket (3 drafts), which chain verifies replay: tree
    rows must take a tree bucket (tests/engine/test_tree_graphs.py), never that one."""
    target, drafter = pair
    prompts = small_prompts(4, seed=2)
    chain = LLM(str(target), block_size=4, device="cpu", cuda_graphs=True,
                speculative_config={"method": "dflash", "model": str(drafter), "adaptive": False})
    graphs = static_graphs(chain)
    assert token_ids(chain, prompts, GREEDY) == token_ids(plain_llm, prompts, GREEDY)
    assert any(q == 4 for (_, q) in graphs.replays)
    llm = tree_llm(target, drafter, 3, device="cpu", cuda_graphs=True)
    graphs = static_graphs(llm)
    key_for, trees_seen = graphs.key_for, []  # every step the runner offers the graphs
    graphs.key_for = lambda plan: (trees_seen.append(plan.has_trees), key_for(plan))[1]
    assert token_ids(llm, prompts, GREEDY) == token_ids(plain_llm, prompts, GREEDY)
    assert any(trees_seen) and not graphs.replays and sum(graphs.tree_replays.values()) == sum(trees_seen)
    assert llm.engine.step_counts["verify"] > 0


SAMPLES = 4000


def test_sampled_trees_follow_the_target_distribution(small_pair, tmp_path):
    """The engine's exact-distribution test (tests/spec/test_spec.py) with draft trees verified."""
    target, _ = small_pair
    drafter = write_dflash_drafter(target, tmp_path / "d", block_size=3)
    llm = LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter), "tree_budget": 6,
                                               "adaptive": False}, max_num_seqs=1024, max_num_batched_tokens=8192)
    counts = sample_pairs(llm, PROMPT, SAMPLES)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), SAMPLES)
    print(f"\ntrees: chi-square {stat:.1f} (reject above {critical:.1f})")
    assert not rejected
    assert llm.engine.speculator.overall["model"].alpha > 0  # trees were accepted, not just drafted


# ---------------------------------------------------------------------- settings and refusals
def test_tree_budget_settings_are_checked():
    with pytest.raises(RequestError, match="1..63"):
        SpeculativeConfig(method="dflash", model="d", tree_budget=64)
    with pytest.raises(RequestError, match="1..63"):
        SpeculativeConfig(method="dflash", model="d", tree_budget=True)
    with pytest.raises(RequestError, match="drafts chains only"):
        SpeculativeConfig(method="ngram", tree_budget=8)
    assert SpeculativeConfig.parse({"method": "dflash", "model": "d", "tree_budget": 22}).tree_budget == 22


def test_cli_flag_sets_the_tree_budget():
    args = build_parser().parse_args(["generate", "--draft", "d", "--spec-tree-budget", "22"])
    assert speculative_config(args).tree_budget == 22 and speculative_config(args).method == "dflash"
    serve = build_parser().parse_args(["serve", "--spec-tree-budget", "8"])  # no --draft: the default pair's drafter
    if (config := default_speculative_config()) is not None and config.method == "dflash":
        assert speculative_config(serve) == replace(config, tree_budget=8)
    else:
        with pytest.raises(LuceboxError, match="needs a DFlash drafter"):
            speculative_config(serve)


def test_sliding_windows_shorter_than_a_tree_row_refuse_trees(hf_models, tmp_path):
    """Windows of 64 and more take trees (tests/spec/test_ddtree_windows.py); this one's is 7."""
    target = hf_models["mistral"]
    drafter = write_dflash_drafter(target, tmp_path / "d", block_size=4)
    with pytest.raises(UnsupportedError, match=r"sliding-window layers' windows of at least 64 .* \[7\]"):
        tree_llm(target, drafter, 8)

