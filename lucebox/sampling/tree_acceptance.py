"""Accepting a draft tree (spec/tree.py): descend while the target's choice at a node is one of its children.

A tree verify row is the pending token (row 0) then the nodes in DFS order; `Draft.parents[i]` is
node i's parent row. The target's logits row r is its distribution p_r after the path to row r.
At every row the target makes its choice y_r -- the argmax of the processed logits (greedy), or a
sample of the processed p_r (temperature, top-k/p, min-p, penalties over the row's own history:
the output plus the path's tokens) -- and the walk from row 0 descends into the child holding y_r,
committing it, until y_r is no child: y_r is then the bonus token.

Exact at any temperature for deterministic trees (every child a point mass): the committed tokens
are y_0, y_{r1}, ... each drawn from p at its own path, which is sampling the target alone
(speculative-sampling.md section 3, "deterministic top-k trees"). Every row is sampled at once
(independent draws; only the ones on the walk are used), then one host transfer.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from .sampler import Sampler, SamplingState, exponential_race


def tree_children(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    """Per verify row (0: the pending token, then each node), its children's tokens -> their rows."""
    children: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if not 0 <= parent <= i:
            raise ValueError(f"tree node {i + 1}'s parent row {parent} does not come before it")
        children[parent].setdefault(token, i + 1)
    return children


def path_to(parents: list[int], row: int) -> list[int]:
    """The rows from the first node down to `row` (0: none)."""
    rows: list[int] = []
    while row > 0:
        rows.append(row)
        row = parents[row - 1]
    return rows[::-1]


def tree_row_states(seq, tokens: list[int], parents: list[int]) -> list[SamplingState]:
    """One sampling state per row: row r has seen the output plus the tokens of the path to r."""
    out = list(seq.output_token_ids)
    return [SamplingState(seq.params, seq.prompt_token_ids, out + [tokens[i - 1] for i in path_to(parents, row)],
                          seq.generator) for row in range(len(tokens) + 1)]


def walk_tree(choices: Seq[int], tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """(accepted rows [0, r1, ...], committed tokens) from the target's choice at every row."""
    children = tree_children(tokens, parents)
    rows, row = [0], 0
    while (child := children[row].get(choices[row])) is not None:
        rows.append(child)
        row = child
    return rows, [tokens[r - 1] for r in rows[1:]] + [choices[row]]


def tree_choices(sampler: Sampler, logits: torch.Tensor, seqs: Seq, drafts: Seq) -> list[int]:
    """The target's choice at every row of these trees (each draft's len(tokens) + 1 rows, in order):
    the processed argmax for greedy sequences, a sample of the processed p otherwise."""
    states = [st for seq, d in zip(seqs, drafts) for st in tree_row_states(seq, d.tokens, d.parents)]
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} tree verify rows")
    if all(seq.params.is_greedy for seq in seqs):
        return sampler.process_logits(logits, states).argmax(-1).tolist()
    return exponential_race(sampler.processed_probs(logits, states), states).tolist()
