"""The adaptive policy choosing among plain steps, chains and draft trees (spec/adaptive.py widths):
synthetic costs and acceptances, a simulated engine loop against the best fixed choice, and an
engine run with adaptive trees greedy-identical to plain decoding."""
from __future__ import annotations

import random

import pytest

from lucebox import LLM, SamplingParams
from lucebox.spec.adaptive import (MIN_REALIZED, MIN_WIDTH_STEPS, PLAIN_STRETCH, DraftLengthPolicy,
                                   SequenceAcceptance, expected_tokens, tree_widths)
from lucebox.spec.tree import tree_nodes
from tests.spec.test_ddtree_engine import pair, plain_llm, small_prompts, token_ids  # noqa: F401
from tests.spec.test_spec import small_pair  # noqa: F401


def test_widths_are_chains_then_tree_budgets_up_to_the_configured_one():
    assert tree_widths(None) == [None]
    assert tree_widths(22) == [None, 8, 16, 22]
    assert tree_widths(8) == [None, 8]
    assert tree_widths(63) == [None, 8, 16, 32, 63]
    policy = DraftLengthPolicy(3, tree_budget=22)
    assert [policy.row_tokens(k, None) for k in (1, 2, 3)] == [2, 3, 4]
    assert [policy.row_tokens(k, 22) for k in (1, 2, 3)] == [1 + tree_nodes(22, k) for k in (1, 2, 3)] == [17, 23, 23]
    assert policy.row_tokens(2) == 23  # default: the widest


class World:
    """A simulated target and drafter: step seconds by tokens in the forward (the verify cost per
    node count), draft seconds by width, and each width's true per-depth acceptance."""

    def __init__(self, forward, draft, alphas: dict, seed: int = 0):
        self.forward, self.draft, self.alphas = forward, draft, alphas
        self.rng = random.Random(seed)

    def accepted(self, width, k: int) -> tuple[int, int]:
        """(drafts accepted, of which along the top-1 chain): a depth whose draw passes the chain's
        alpha stays on the chain; a tree may go on off it, up to its own alpha."""
        tree = chain = 0
        on_chain = True
        while tree < k:
            u = self.rng.random()
            if u >= self.alphas[width]:
                break
            on_chain = on_chain and u < self.alphas[None]
            tree += 1
            chain += on_chain
        return tree, chain

    def best_fixed(self, policy: DraftLengthPolicy, widths) -> float:
        """Tokens per second of the best fixed choice among plain decoding and `widths` at any length."""
        rates = [1 / self.forward(1)]
        for w in widths:
            for k in policy.candidates:
                cost = self.forward(policy.row_tokens(k, w)) + self.draft(w, k)
                rates.append(expected_tokens(self.alphas[w], k) / cost)
        return max(rates)


def run(policy: DraftLengthPolicy, world: World, steps: int) -> tuple[float, list]:
    """The engine's loop around the policy (one sequence): choose, draft, verify, record costs, the
    width's acceptance and what the step delivered. Returns (tokens per second, choices)."""
    acceptance = {w: SequenceAcceptance() for w in policy.widths}
    tokens = seconds = 0.0
    choices = []
    for _ in range(steps):
        k = policy.choose({w: [acceptance[w].alpha] for w in policy.widths}, 0)
        width = policy.width
        if k == 0:
            cost, committed = world.forward(1), 1
            policy.forward.add(1, cost)
            policy.record_delivered(1, 1, cost, False)
        else:
            forward, draft = world.forward(policy.row_tokens(k, width)), world.draft(width, k)
            accepted, chain = world.accepted(width, k)
            policy.forward.add(policy.row_tokens(k, width), forward)
            policy.drafts[width].add(k, draft)
            acceptance[width].update(k, accepted)
            if width is not None:  # what the chain would have accepted (Speculator.record)
                acceptance[None].update(k, chain)
            policy.record_width(width)
            cost, committed = forward + draft, 1 + accepted
            policy.record_delivered(1, committed, cost, True)
        tokens += committed
        seconds += cost
        choices.append((width, k) if k else 0)
    return tokens / seconds, choices


def memory_bound(fixed=0.010, per_token=0.00005):
    """A step's cost is mostly reading the weights: a 23-node tree costs 1.1x a plain step."""
    return lambda tokens: fixed + per_token * tokens


def one_pass(width, k, seconds=0.002, per_node=0.00002):
    """One drafter pass for any length; building a tree adds host time per node."""
    return seconds + (per_node * tree_nodes(width, k) if width is not None else 0.0)


def test_trees_that_accept_deeper_are_chosen_with_their_budget():
    policy = DraftLengthPolicy(4, tree_budget=22)
    world = World(memory_bound(), one_pass, {None: 0.5, 8: 0.7, 16: 0.8, 22: 0.85})
    rate, choices = run(policy, world, 1500)
    late = choices[-300:]
    assert max(set(late), key=late.count) == (22, 4)
    assert rate >= 0.95 * world.best_fixed(policy, policy.widths)


def test_trees_whose_verify_costs_more_than_their_acceptance_gives_are_left_for_chains():
    """Compute-bound verify (each node costs a tenth of a plain step): trees accept a little deeper
    but cost too much; the chain wins and the policy ends up on it."""
    policy = DraftLengthPolicy(4, tree_budget=22)
    world = World(memory_bound(0.010, 0.001), one_pass, {None: 0.7, 8: 0.74, 16: 0.76, 22: 0.77})
    rate, choices = run(policy, world, 1500)
    late = [c for c in choices[-300:] if c]
    assert len(late) > 250 and sum(width is None for width, _ in late) >= 0.9 * len(late)
    chains_only, _ = run(DraftLengthPolicy(4), World(world.forward, one_pass, world.alphas), 1500)
    assert rate >= 0.95 * chains_only


@pytest.mark.parametrize("alphas,forward", [
    ({None: 0.05, 8: 0.1, 16: 0.12, 22: 0.13}, memory_bound(0.010, 0.0004)),  # nothing pays: plain
    ({None: 0.8, 8: 0.8, 16: 0.8, 22: 0.8}, memory_bound()),  # trees accept no deeper than the chain
    ({None: 0.6, 8: 0.75, 16: 0.8, 22: 0.82}, memory_bound(0.010, 0.0003)),  # close call
    ({None: 0.3, 8: 0.6, 16: 0.7, 22: 0.75}, memory_bound(0.010, 0.0001)),  # trees pay
], ids=["plain", "no-gain", "close", "trees"])
def test_trees_never_make_decoding_5_percent_slower_than_the_best_of_plain_and_chain(alphas, forward):
    """Against the best fixed choice of plain steps and chains (known costs and acceptance) and
    against the policy without trees in the same world; where trees pay, they are taken."""
    for seed in range(3):
        policy = DraftLengthPolicy(4, tree_budget=22)
        world = World(forward, one_pass, alphas, seed=seed)
        rate, _ = run(policy, world, 3000)
        chains_only, _ = run(DraftLengthPolicy(4), World(forward, one_pass, alphas, seed=seed), 3000)
        best = world.best_fixed(policy, [None])
        assert rate >= 0.95 * best and rate >= 0.95 * chains_only
        if world.best_fixed(policy, policy.widths) > 1.1 * best:  # trees pay: faster than any chain could be
            assert rate > best


def test_every_tree_width_is_measured_before_it_is_judged():
    """After the plain baseline: each width's longest and shortest draft settled, and each tree width
    drafted MIN_WIDTH_STEPS times (its acceptance is its own), before the model chooses."""
    policy = DraftLengthPolicy(4, tree_budget=16)
    world = World(memory_bound(), one_pass, {None: 0.5, 8: 0.5, 16: 0.5})
    _, choices = run(policy, world, PLAIN_STRETCH + 40)
    explored = choices[PLAIN_STRETCH:]
    for width in policy.widths:
        assert explored.count((width, 4)) >= 2 and explored.count((width, 1)) >= 2
    for width in (8, 16):
        assert policy.width_steps[width] >= MIN_WIDTH_STEPS


def test_trees_that_delivered_slower_than_chains_are_vetoed():
    """The model says the tree pays (its measured acceptance is high), but its drafted steps delivered
    tokens slower than the chain's (an unmodelled cost): the chain is chosen."""
    policy = DraftLengthPolicy(4, tree_budget=8)
    for _ in range(2):
        for tokens in (1, 2, 5, 9):
            policy.forward.add(tokens, 0.010)
        for width in (None, 8):
            for k in (1, 4):
                policy.drafts[width].add(k, 0.001)
    policy.width_steps[8] = MIN_WIDTH_STEPS
    alphas = {None: [0.6], 8: [0.9]}
    assert policy.choose(alphas, 0) == 4 and policy.width == 8
    for _ in range(MIN_REALIZED):
        policy.record_delivered(1, 4, 0.011, True, width=8)  # 2.75 ms a token
        policy.record_delivered(1, 3, 0.006, True, width=None)  # 2 ms a token
    assert policy.tree_loses(8, 1) and not policy.tree_loses(None, 1)
    assert policy.choose(alphas, 0) == 4 and policy.width is None


def test_adaptive_trees_through_the_engine_equal_plain_decoding(pair, plain_llm):
    """Adaptive drafting on (the default): the policy drafts chains and trees of several budgets, and
    the output stays token-identical to plain decoding."""
    target, drafter = pair
    llm = LLM(str(target), block_size=4, speculative_config={"method": "dflash", "model": str(drafter),
                                                             "tree_budget": 20})
    prop = llm.engine.speculator.proposer
    widths, propose = [], prop.propose
    prop.propose = lambda seqs, ks: (widths.append(prop.tree_budget), propose(seqs, ks))[1]
    prompts = small_prompts(4, seed=21)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(plain_llm, prompts, params)
    assert {None, 8, 16, 20} <= set(widths)
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.runner.num_blocks


def test_a_tree_verify_also_records_what_its_top_1_chain_would_have_accepted(pair, plain_llm):
    """Through the engine: a tree whose accepted path leaves the chain after one node counts 1 accepted
    draft for the chain at the tree's depth, the whole path for the tree's width."""
    target, drafter = pair
    llm = LLM(str(target), block_size=4, speculative_config={"method": "dflash", "model": str(drafter),
                                                             "tree_budget": 8})
    spec = llm.engine.speculator

    class Metrics:
        num_drafts = num_draft_tokens = num_accepted_tokens = 0
        accepted_per_position: list = []
    seq = type("Seq", (), {"metrics": Metrics()})()
    spec.source[id(seq)] = ("model", 8)
    before_chain, before_tree = spec._acceptance(seq, "model", None), spec._acceptance(seq, "model", 8)
    chain_alpha, tree_alpha = before_chain.alpha, before_tree.alpha
    spec.record(seq, 3, 3, chain=(3, 1))
    assert spec._acceptance(seq, "model", 8).alpha > tree_alpha  # all 3 accepted
    assert spec._acceptance(seq, "model", None).alpha < chain_alpha  # the chain stopped after 1 of 3
    assert spec.policy.width_steps[8] == 1 and spec.policy.width_steps[None] == 0
    # the engine derives the chain's record from the accepted rows: rows 1, 2, ... are the top-1 chain
    record = spec.record
    seen = []
    spec.record = lambda s, k, a, chain=None: (seen.append((k, a, chain)), record(s, k, a, chain))[1]
    prompts = small_prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(plain_llm, prompts, params)
    trees = [(k, a, c) for k, a, c in seen if c is not None]
    assert trees and all(0 <= accepted <= a <= k and nodes == k for k, a, (nodes, accepted) in trees)
    assert any(accepted < a for _, a, (_, accepted) in trees)  # some accepted paths left the chain
