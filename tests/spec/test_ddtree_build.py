"""DDTree construction equals a brute-force best-first reference: every node of the top-K rank tree
enumerated, scored by cumulative log-prob, sorted, and the best `budget` taken (seeded: the top-1 chain first)."""
from __future__ import annotations

import itertools

import pytest
import torch

from lucebox.spec.tree import BRANCHES, build_tree, depths_of, path_tokens, tree_children, tree_nodes


def reference_tree(log_probs: torch.Tensor, budget: int, chain_seed: bool = True):
    depth = log_probs.shape[0]
    k = min(BRANCHES, log_probs.shape[1])
    values, ids = torch.sort(log_probs.float(), dim=-1, descending=True, stable=True)
    values, ids = values[:, :k].tolist(), ids[:, :k].tolist()
    nodes = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(k), repeat=d):
            score = 0.0
            for i, r in enumerate(path):
                score += values[i][r]
            nodes.append((-score, path))
    nodes.sort()
    chain = [tuple([0] * d) for d in range(1, min(depth, budget) + 1)] if chain_seed else []
    rest = [p for _, p in nodes if p not in set(chain)]
    chosen = sorted(chain + rest[:budget - len(chain)])
    row = {p: i + 1 for i, p in enumerate(chosen)}
    tokens = [ids[len(p) - 1][p[-1]] for p in chosen]
    parents = [row[p[:-1]] if len(p) > 1 else 0 for p in chosen]
    return tokens, parents, [len(p) for p in chosen]


def random_log_probs(seed: int, depth: int, vocab: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2
    if ties:  # coarse logits: many equal log-probs, within a depth and across paths
        logits = logits.round()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ties", [False, True])
def test_tree_equals_the_brute_force_best_first_reference(seed, ties):
    depth, vocab = [(2, 12), (3, 10), (4, 9)][seed % 3]
    budget = [depth + 1, 7, 15, 40][seed % 4]
    log_probs = random_log_probs(seed, depth, vocab, ties)
    for chain_seed in (True, False):
        tree = build_tree(log_probs, budget, chain_seed)
        assert (tree.tokens, tree.parents, tree.depths) == reference_tree(log_probs, budget, chain_seed)
        k = min(BRANCHES, vocab)
        assert len(tree.tokens) == min(budget, sum(k ** d for d in range(1, depth + 1)))
        assert tree_nodes(budget, depth) == min(budget, sum(BRANCHES ** d for d in range(1, depth + 1)))
        # rows 1..depth are the top-1 chain (the engine's chain record reads them)
        spine = max(tree.depths)
        assert _rank_paths(log_probs, tree)[:spine] == [(0,) * d for d in range(1, spine + 1)]


def _rank_paths(log_probs, tree):
    order = torch.sort(log_probs.float(), dim=-1, descending=True, stable=True).indices.tolist()
    paths = []
    for row in range(1, len(tree.tokens) + 1):
        path = tuple(order[d].index(t) for d, t in enumerate(path_tokens(tree.tokens, tree.parents, row)))
        paths.append(path)
    return paths


def test_seeded_budget_up_to_the_depth_is_the_top1_chain():
    log_probs = random_log_probs(3, 6, 20)
    tree = build_tree(log_probs, 4, chain_seed=True)
    assert tree.parents == [0, 1, 2, 3] and tree.depths == [1, 2, 3, 4]
    assert tree.tokens == log_probs.argmax(-1)[:4].tolist()
    assert build_tree(log_probs, 6, chain_seed=True).tokens == log_probs.argmax(-1).tolist()


def test_unseeded_small_budgets_branch_where_the_chain_is_unlikely():
    # Depth 1 is a near tie, depth 2 certain: best-first takes both depth-1 tokens before the spine's depth 3.
    log_probs = torch.full((3, 10), -20.0)
    log_probs[0, 4], log_probs[0, 7] = -0.69, -0.70
    log_probs[1, 2], log_probs[2, 5] = 0.0, -2.0
    tree = build_tree(log_probs, 3)
    assert (tree.tokens, tree.parents, tree.depths) == ([4, 2, 7], [0, 1, 0], [1, 2, 1])


def test_chain_seed_keeps_the_whole_top1_chain_even_when_siblings_score_higher():
    # Nearly uniform slots: best-first alone takes depth 1's runners-up before the chain's depth 2.
    log_probs = torch.zeros(4, 10)
    log_probs[:, 3] = 0.1  # the top-1 of every slot
    log_probs = log_probs.log_softmax(-1)
    seeded, unseeded = build_tree(log_probs, 5, chain_seed=True), build_tree(log_probs, 5, chain_seed=False)
    assert seeded.tokens[:4] == [3, 3, 3, 3] and seeded.depths == [1, 2, 3, 4, 1]
    assert unseeded.depths == [1, 1, 1, 1, 1]  # the five best single tokens


def test_dfs_order_parents_precede_children_and_child_maps_point_at_rows():
    tree = build_tree(random_log_probs(7, 5, 16), 30)
    assert all(p < i + 1 for i, p in enumerate(tree.parents))
    assert depths_of(tree.parents) == tree.depths
    children = tree_children(tree.tokens, tree.parents)
    for row, kids in enumerate(children):
        for token, child in kids.items():
            assert tree.parents[child - 1] == row and tree.tokens[child - 1] == token
    assert sum(len(k) for k in children) == len(tree.tokens)  # siblings never repeat a token
    # DFS: each subtree is a contiguous run of rows.
    for row in range(1, len(tree.tokens) + 1):
        below = [i + 1 for i in range(len(tree.tokens)) if row in _ancestors(tree.parents, i + 1)]
        assert below == list(range(row + 1, row + 1 + len(below)))
    assert path_tokens(tree.tokens, tree.parents, 0) == []


def _ancestors(parents, row):
    out = set()
    while row > 0:
        row = parents[row - 1]
        out.add(row)
    return out


def test_bad_budget_is_named():
    with pytest.raises(ValueError, match="budget 64"):
        build_tree(random_log_probs(0, 3, 8), 64)
