"""DDTree: a draft tree built from the per-slot distributions of one DFlash pass.

Slot d of the drafter's block (d = 1..D) predicts the token at depth d below the pending token.
Every depth keeps its top-K tokens (K = BRANCHES), and a node is a path of ranks (r_1..r_d) scored by
the cumulative log-probability of its tokens. The tree is the `budget` best nodes, best first: a
max-heap pops the best candidate and pushes its next sibling and its first child (with chain_seed the
whole top-1 chain is taken first). Ties go to the lexicographically smaller rank path, so the same
distributions always give the same tree, and the top-1 chain reaches the tree's depth (its node is the
best of each depth): rows 1..depth are the chain the adaptive policy's chain record reads (top_chain).
A DFlash2 drafter's tree grows over its selector's lattice instead (build_lattice_tree): the same
best-first search where a node's children are ranked by their scores given the node's own token.

Measured on the bundled pair (CPU, T = 0, scripts/tree_tau.py; docs/benchmarks-log.md): plain best-first
beats the seeded chain at every budget (22 nodes: tau 3.44 against 3.27; the seed spends 15 of them on
a spine that rarely survives past depth 5), K = 16 beats K = 8 from 32 nodes on (ten prompts), and
branching pays at budgets below the depth too (8 nodes: 1.09x the chain). A temperature on the
log-probs, a learned calibration of them, candidates from the neighbouring slots and a second drafter
pass over the block with a branch's tokens filled in all measured within noise of this.

The verify row is the pending token (row 0) then the nodes in DFS order (rows 1..budget): each
node's parent comes before it, and its K/V sits at position start + row, its RoPE position at
start + depth (kernels/forward_batch.py: tree_mask).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..sampling.tree_acceptance import tree_children

BRANCHES = 16  # top-K tokens per depth
CHAIN_SEED = False  # take the whole top-1 chain first (measured worse on the bundled pair; module note)
MAX_TREE_TOKENS = 64  # a tree verify row: the pending token and up to 63 nodes (one int64 mask word)


@dataclass
class DraftTree:
    tokens: list[int]  # node tokens, DFS order (row i + 1 of the verify row)
    parents: list[int]  # each node's parent row (0: the pending token)
    depths: list[int]  # each node's depth (1: a child of the pending token)
    children: list[dict[int, int]] = field(default_factory=list)  # per row: token -> child row

    def __post_init__(self):
        if not self.children:
            self.children = tree_children(self.tokens, self.parents)


def tree_nodes(budget: int, depth: int) -> int:
    """Nodes of a tree of this budget over `depth` slots (at most K^1 + ... + K^depth)."""
    return min(budget, sum(BRANCHES ** d for d in range(1, depth + 1)))


def build_tree(log_probs: torch.Tensor, budget: int, chain_seed: bool = CHAIN_SEED) -> DraftTree:
    """log_probs: [D, vocab] per-slot log-probabilities (temperature 1) of one drafter pass; the tree's
    `budget` nodes (fewer when D and K allow fewer)."""
    if log_probs.dim() != 2 or log_probs.shape[0] == 0:
        raise ValueError(f"tree construction needs [depths, vocab] log-probs, got {tuple(log_probs.shape)}")
    _check_budget(budget)
    k = min(BRANCHES, log_probs.shape[1])
    # A stable descending sort: equal log-probs rank by token id.
    values, ids = torch.sort(log_probs.float(), dim=-1, descending=True, stable=True)
    values, ids = values[:, :k].tolist(), ids[:, :k].tolist()
    paths = best_first(values, budget, chain_seed)
    return tree_of(sorted(paths), ids)


def build_lattice_tree(candidates: torch.Tensor, log_probs: torch.Tensor, budget: int,
                       chain_seed: bool = CHAIN_SEED) -> DraftTree:
    """A tree over conditional scores (a DFlash2 selector's lattice): candidates [D, K] each depth's
    tokens; log_probs [D, K, K], log_probs[d, p, c] the score of candidate c at depth d + 1 below
    candidate p at depth d (row 0 at depth 1, below the pending token). Rank r of a node is its place
    among its siblings by that score, so the all-zero rank path is the greedy walk over the lattice."""
    if candidates.dim() != 2 or log_probs.shape != (*candidates.shape, candidates.shape[1]) or not len(candidates):
        raise ValueError(f"a lattice tree needs candidates [D, K] and log-probs [D, K, K], got "
                         f"{tuple(candidates.shape)} and {tuple(log_probs.shape)}")
    _check_budget(budget)
    values, order = torch.sort(log_probs.float(), dim=-1, descending=True, stable=True)
    values, order, tokens = values.tolist(), order.tolist(), candidates.tolist()

    def candidate(path: tuple[int, ...]) -> int:  # the candidate index a rank path ends on (0: the root)
        c = 0
        for d, r in enumerate(path):
            c = order[d][c][r]
        return c

    paths = sorted(ranked_best_first(lambda d, parent: values[d][candidate(parent)], len(values), budget,
                                     chain_seed))
    return _tree(paths, [tokens[len(p) - 1][candidate(p)] for p in paths])


def _check_budget(budget: int) -> None:
    if not 1 <= budget < MAX_TREE_TOKENS:
        raise ValueError(f"tree budget {budget} must be 1..{MAX_TREE_TOKENS - 1}")


def best_first(values: list[list[float]], budget: int, chain_seed: bool = CHAIN_SEED) -> list[tuple[int, ...]]:
    """The rank paths of the best `budget` nodes over per-depth sorted log-probs values[d][r]."""
    return ranked_best_first(lambda d, parent: values[d], len(values), budget, chain_seed)


def ranked_best_first(children: Callable[[int, tuple[int, ...]], list[float]], depth: int, budget: int,
                      chain_seed: bool = CHAIN_SEED) -> list[tuple[int, ...]]:
    """The rank paths of the best `budget` nodes of a tree `depth` deep, where children(d, parent) gives the
    sorted (descending) log-probs of the depth-d children of the node at rank path `parent` (() for the root)."""
    chosen: list[tuple[int, ...]] = []
    heap: list[tuple[float, tuple[int, ...]]] = []

    def push(path: tuple[int, ...], parent_score: float) -> None:
        d, r = len(path) - 1, path[-1]
        if d < depth and r < len(row := children(d, path[:-1])):
            heapq.heappush(heap, (-(parent_score + row[r]), path))

    score = 0.0
    if chain_seed:
        chain: tuple[int, ...] = ()
        for d in range(min(depth, budget)):
            push(chain + (1,), score)  # each chain node's next sibling waits in the heap
            score += children(d, chain)[0]
            chain += (0,)
            chosen.append(chain)
    else:
        push((0,), 0.0)
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        parent_score = -neg - children(len(path) - 1, path[:-1])[path[-1]]
        push(path[:-1] + (path[-1] + 1,), parent_score)
        push(path + (0,), -neg)
    return chosen


def tree_of(paths: list[tuple[int, ...]], ids: list[list[int]]) -> DraftTree:
    """The tree of these rank paths, sorted (DFS order: a parent before its children, siblings by rank)."""
    return _tree(paths, [ids[len(p) - 1][p[-1]] for p in paths])


def _tree(paths: list[tuple[int, ...]], tokens: list[int]) -> DraftTree:
    row = {path: i + 1 for i, path in enumerate(paths)}
    parents = [row[p[:-1]] if len(p) > 1 else 0 for p in paths]
    return DraftTree(tokens, parents, [len(p) for p in paths])


def top_chain(row_depths: list[int], accepted_rows: list[int]) -> tuple[int, int]:
    """A tree's top-1 chain and how much of it a verify accepted: (its nodes, those accepted). Every
    node's first child in DFS order is its rank-0 child (a sibling is pushed only when the one ranked
    before it is taken), so the chain is the leading rows whose depth is their row. It reaches the
    tree's depth in per-slot trees; a lattice tree may cut it shorter. row_depths and accepted_rows
    start with row 0 (the pending token)."""
    nodes = next((r for r in range(1, len(row_depths)) if row_depths[r] != r), len(row_depths)) - 1
    accepted = next((j for j, r in enumerate(accepted_rows) if r != j), len(accepted_rows)) - 1
    return nodes, accepted


def depths_of(parents: list[int]) -> list[int]:
    """Each node's depth from its parent row (parents precede children)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 + (depths[parent - 1] if parent > 0 else 0))
    return depths


def path_tokens(tokens: list[int], parents: list[int], row: int) -> list[int]:
    """The node tokens from the root down to verify row `row` (0: none)."""
    out: list[int] = []
    while row > 0:
        out.append(tokens[row - 1])
        row = parents[row - 1]
    return out[::-1]
