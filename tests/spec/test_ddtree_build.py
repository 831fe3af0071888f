"""DDTree construction equals a brute-force best-first reference: every node of the top-K rank tree
enumerated, scored by cumulative log-prob, sorted, and the best `budget` taken (seeded: the top-1 chain first)."""
from __future__ import annotations

import itertools

import pytest
import torch

from lucebox.spec.tree import (BRANCHES, build_lattice_tree, build_tree, depths_of, path_tokens, top_chain,
                               tree_children, tree_nodes)


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


def reference_lattice_tree(candidates: torch.Tensor, log_probs: torch.Tensor, budget: int, chain_seed: bool):
    """Every candidate path enumerated with its rank path (each node's place among its siblings by its
    conditional log-prob, ties to the lower candidate index), the best `budget` by cumulative score."""
    depth, k = candidates.shape
    nodes = {}  # rank path -> (score, token path)
    for d in range(1, depth + 1):
        for path in itertools.product(range(k), repeat=d):  # candidate indices
            score, ranks, parent = 0.0, [], 0
            for i, c in enumerate(path):
                row = log_probs[i, parent].tolist()
                ranks.append(sorted(range(k), key=lambda j: (-row[j], j)).index(c))
                score += row[c]
                parent = c
            nodes[tuple(ranks)] = (score, [int(candidates[i, c]) for i, c in enumerate(path)])
    ordered = sorted(nodes, key=lambda p: (-nodes[p][0], p))
    chain = [tuple([0] * d) for d in range(1, min(depth, budget) + 1)] if chain_seed else []
    chosen = sorted(chain + [p for p in ordered if p not in set(chain)][:budget - len(chain)])
    row = {p: i + 1 for i, p in enumerate(chosen)}
    return ([nodes[p][1][-1] for p in chosen], [row[p[:-1]] if len(p) > 1 else 0 for p in chosen],
            [len(p) for p in chosen])


def random_lattice(seed: int, depth: int, k: int, vocab: int, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    candidates = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(depth)])
    scores = torch.randn(depth, k, k, generator=g) * 2
    scores[0] = scores[0, 0]  # depth 1 sits below the pending token: one row
    if ties:
        scores = scores.round()
    return candidates, scores.log_softmax(-1)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("ties", [False, True])
def test_lattice_tree_equals_the_brute_force_reference_over_conditional_scores(seed, ties):
    depth, k = [(2, 5), (3, 4), (4, 3)][seed % 3]
    budget = [depth, 6, 13, 40][seed % 4]
    candidates, log_probs = random_lattice(seed, depth, k, 50, ties)
    for chain_seed in (True, False):
        tree = build_lattice_tree(candidates, log_probs, budget, chain_seed)
        assert (tree.tokens, tree.parents, tree.depths) == reference_lattice_tree(candidates, log_probs, budget,
                                                                                  chain_seed)
        assert len(tree.tokens) == min(budget, sum(k ** d for d in range(1, depth + 1)))
        assert all(p < i + 1 for i, p in enumerate(tree.parents))


def test_a_lattice_whose_rows_agree_grows_the_marginal_tree():
    """Scores that ignore the parent are per-slot distributions: the same tree as build_tree's."""
    log_probs = random_log_probs(4, 4, 40)
    values, ids = torch.sort(log_probs, dim=-1, descending=True, stable=True)
    k = BRANCHES
    lattice = values[:, None, :k].expand(4, k, k)
    for budget in (3, 9, 30):
        a, b = build_lattice_tree(ids[:, :k], lattice, budget), build_tree(log_probs, budget)
        assert (a.tokens, a.parents, a.depths) == (b.tokens, b.parents, b.depths)


def test_lattice_children_follow_their_parent_token():
    # Depth 2 after candidate 0 prefers candidate 1, after candidate 1 prefers candidate 0.
    candidates = torch.tensor([[10, 11], [20, 21]])
    log_probs = torch.log(torch.tensor([[[0.6, 0.4], [0.6, 0.4]], [[0.1, 0.9], [0.8, 0.2]]]))
    tree = build_lattice_tree(candidates, log_probs, 4)  # 10: 0.6, 10-21: 0.54, 11: 0.4, 11-20: 0.32
    assert (tree.tokens, tree.parents, tree.depths) == ([10, 21, 11, 20], [0, 1, 0, 3], [1, 2, 1, 2])


def test_bad_lattice_shapes_are_named():
    with pytest.raises(ValueError, match=r"\[D, K, K\]"):
        build_lattice_tree(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, 5), 5)


@pytest.mark.parametrize("seed", range(6))
def test_top_chain_is_the_rank_0_walk_the_tree_holds(seed):
    """Per-slot trees hold the top-1 chain to their depth; a lattice tree may hold less of its walk."""
    tree = build_tree(random_log_probs(seed, 5, 30), [4, 9, 25][seed % 3])
    rows = [0] + tree.depths
    assert top_chain(rows, [0]) == (max(tree.depths), 0)
    candidates, log_probs = random_lattice(seed, 4, 4, 50)
    budget = [3, 7, 12][seed % 3]
    tree = build_lattice_tree(candidates, log_probs, budget)
    ranks = _lattice_rank_paths(candidates, log_probs, budget)
    walk = max(d for d in range(5) if all((0,) * i in ranks for i in range(1, d + 1)))
    assert top_chain([0] + tree.depths, [0])[0] == walk
    for j in range(walk + 1):  # accepted along the walk's first j nodes, then (maybe) elsewhere
        assert top_chain([0] + tree.depths, list(range(j + 1)))[1] == j


def _lattice_rank_paths(candidates, log_probs, budget):
    tokens, parents, _ = reference_lattice_tree(candidates, log_probs, budget, False)
    paths = {}
    for row, (token, parent) in enumerate(zip(tokens, parents), 1):
        d = len(paths.get(parent, ()))
        below = paths.get(parent, ())
        prev = candidates[d - 1].tolist().index(tokens[parent - 1]) if parent else 0
        order = sorted(range(candidates.shape[1]), key=lambda j: (-log_probs[d, prev, j].item(), j))
        paths[row] = below + (order.index(candidates[d].tolist().index(token)),)
    return set(paths.values())


def test_top_chain_stops_where_a_lattice_tree_leaves_its_walk():
    # The walk's first token leads nowhere sure (0.25 each); the runner-up's child is near certain.
    candidates = torch.tensor([[10, 11, 12, 13]] * 2)
    after = torch.full((4, 4), 0.25)
    after[1] = torch.tensor([0.97, 0.01, 0.01, 0.01])
    log_probs = torch.stack([torch.tensor([0.55, 0.40, 0.03, 0.02]).expand(4, 4), after]).log()
    tree = build_lattice_tree(candidates, log_probs, 3)  # 10: .55, 11: .40, 11-10: .388; 10-*: .1375
    assert (tree.tokens, tree.parents) == ([10, 11, 10], [0, 0, 2])
    assert top_chain([0] + tree.depths, [0, 1]) == (1, 1)  # the walk is row 1 alone, though the tree is 2 deep
