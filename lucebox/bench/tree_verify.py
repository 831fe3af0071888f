"""`lucebox bench speed --tree-nodes N..`: a DDTree verify forward of N nodes against a decode forward.

Trees pay only where verifying one costs little more than a decode step (issue 28's bound: a 32-node
tree <= 1.6x). The tree is what DDTree builds (spec/tree.py: best-first over per-slot distributions)
from a fixed drafter-like shape: confidence that falls with depth, so it is deep on its top-1 spine
and bushy near the root. Its verify row runs as the engine runs one: through a CUDA-graph tree bucket
where the engine keeps graphs (dense targets), eagerly otherwise (recurrent layers follow each node's
parent chain eagerly).
"""
from __future__ import annotations

import dataclasses

import torch

from ..engine.step_plan import PlanRow, RowKind, StepPlan
from ..spec.tree import DraftTree, build_tree, depths_of

DRAFT_DEPTH = 15  # a DFlash block of 16: the pending token's 15 successors
TOP1_DECAY = 0.93  # the top-1 probability falls by this factor per depth, from 0.9


def drafter_like_tree(nodes: int, vocab: int = 256) -> DraftTree:
    """The DDTree of `nodes` nodes over slots whose top-1 probability is 0.9 x 0.93^d and whose other
    candidates share the rest geometrically (a drafter more sure of the next token than of later ones)."""
    probs = torch.zeros(DRAFT_DEPTH, vocab, dtype=torch.float64)
    ranks = torch.arange(1, vocab, dtype=torch.float64)
    for d in range(DRAFT_DEPTH):
        top = 0.9 * TOP1_DECAY ** d
        rest = 0.5 ** ranks
        probs[d, 0], probs[d, 1:] = top, (1 - top) * rest / rest.sum()
    return build_tree(probs.log(), nodes)


def tree_plan(tree: DraftTree, context: int, table: list[int], windows: list[list[int]],
              recurrent: bool) -> StepPlan:
    """The verify step of one sequence at `context` holding `tree`: pending token then nodes, all logits."""
    parents = [-1] + tree.parents
    row = PlanRow(list(range(1, len(parents) + 1)), context, table, kind=RowKind.VERIFY, window_tables=windows,
                  parents=parents, depths=[0] + depths_of(tree.parents))
    return StepPlan([row], logits_rows=list(range(len(parents))), state_slots=[0] if recurrent else None)


def attach_tree_buckets(runner, nodes: list[int]) -> None:
    """Give the runner's graphs tree buckets for these node counts, as an engine drafting such trees has."""
    if runner.graphs is not None:
        settings = runner.graphs.settings
        runner.attach_graphs(dataclasses.replace(settings, tree_lens=tuple(n + 1 for n in nodes)))


def tree_rows(runner, nodes: list[int], context: int, tables, decode_step_s: float, timer) -> list[dict]:
    """Per node count: the tree's depth, its verify forward's time (timer(fn) -> seconds a call) and its
    ratio to `decode_step_s`; the graph replays show whether it ran through a tree bucket."""
    if not nodes:
        return []
    attach_tree_buckets(runner, nodes)
    rows = []
    recurrent = bool(runner.recurrent_layers)
    for n in nodes:
        tree = drafter_like_tree(n)
        before = _tree_replays(runner)
        step = timer(lambda tree=tree: runner.run(tree_plan(tree, context, *tables, recurrent)))
        rows.append({"nodes": n, "depth": max(depths_of(tree.parents)), "verify_step_s": step,
                     "ratio": step / decode_step_s, "cuda_graph": _tree_replays(runner) > before})
    return rows


def _tree_replays(runner) -> int:
    return sum(runner.graphs.tree_replays.values()) if runner.graphs is not None else 0
