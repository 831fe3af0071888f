"""A step plan as one int64 tensor: what rank 0 broadcasts so every tensor-parallel rank runs the same forward.

The ranks other than 0 only need the forward's inputs (token ids, positions and RoPE shifts, block tables, the tables
of KV cache groups 1.., tree parents, whether K/V are written) and which rows reach the LM head,
whose vocabulary-parallel product they take part in; with recurrent layers (hybrids), each row's state slot
and how many of its tokens advance the state (ModelRunner.state_rows: rank 0 knows the sequences). Layout:

    [rows, groups, write_kv, all_logits, logits rows (-1: None), trees, states]
    per row: [tokens, start, rope shift, table length, *tokens, *table, per group: (length, *table),
              if trees: (has parents, *parents), if states: (slot, advance)]
    then the logits rows, then the CUDA graph rank 0 replays (-1: none; else B, Q, sampled, tree, queries,
    prefill, tap count, *taps: CudaGraphRunner.key_for), which every rank replays with its own shard, so
    the padded collectives match.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedError
from .step_plan import PlanRow, StepPlan


@dataclass
class RankPlan(StepPlan):
    """A plan as another rank gets it: with recurrent layers, each row's advance next to its slot; the
    graph rank 0 replays it through (None: eagerly)."""
    state_advance: list[int] | None = None
    graph_key: tuple | None = None


def pack_plan(plan: StepPlan, state_rows: tuple[list[int], list[int]] | None = None,
              graph_key: tuple | None = None) -> torch.Tensor:
    """state_rows: (slots, advances) of the plan's rows (ModelRunner.state_rows), for recurrent layers;
    graph_key: the CUDA graph rank 0 replays the step through."""
    if plan.has_position_maps:  # the ranks would rotate at storage positions
        raise UnsupportedError("speculative prefill (prefill_keep_ratio) is not supported under tensor parallelism yet")
    groups = len(plan.rows[0].window_tables) if plan.rows else 0
    trees = plan.has_trees
    rows = plan.logits_rows
    out = [len(plan.rows), groups, int(plan.write_kv), int(plan.all_logits), -1 if rows is None else len(rows),
           int(trees), int(state_rows is not None)]
    for index, row in enumerate(plan.rows):
        out += [len(row.tokens), row.start, row.rope_shift, len(row.block_table), *row.tokens, *row.block_table]
        for table in row.window_tables:
            out += [len(table), *table]
        if trees:
            out += [0] if row.parents is None else [1, *row.parents]
        if state_rows is not None:
            out += [state_rows[0][index], state_rows[1][index]]
    out += rows or []
    if graph_key is None:
        out.append(-1)
    else:
        num_seqs, query_len, taps, sampled, tree, queries, prefill = graph_key
        out += [num_seqs, query_len, int(sampled), int(tree), int(queries), int(prefill), len(taps), *taps]
    return torch.tensor(out, dtype=torch.int64)


def unpack_plan(packed: torch.Tensor) -> RankPlan:
    """The plan pack_plan packed, as far as a forward reads it (no sequences, no taps)."""
    values = packed.tolist()
    num_rows, groups, write_kv, all_logits, num_logits, trees, states = values[:7]
    at, rows, offset, slots, advance = 7, [], 0, [], []
    for index in range(num_rows):
        n, start, shift, t = values[at:at + 4]
        at += 4
        tokens, table = values[at:at + n], values[at + n:at + n + t]
        at += n + t
        windows = []
        for _ in range(groups):
            m = values[at]
            windows.append(values[at + 1:at + 1 + m])
            at += 1 + m
        row = PlanRow(tokens, start, table, offset=offset, index=index, window_tables=windows, rope_shift=shift)
        if trees:
            if values[at]:
                row.parents = values[at + 1:at + 1 + n]
                at += n
            at += 1
        if states:
            slots.append(values[at])
            advance.append(values[at + 1])
            at += 2
        rows.append(row)
        offset += n
    logits_rows = None if num_logits < 0 else values[at:at + num_logits]
    at += max(num_logits, 0)
    key = None
    if values[at] >= 0:
        num_seqs, query_len, sampled, tree, queries, prefill, taps = values[at:at + 7]
        key = (num_seqs, query_len, tuple(values[at + 7:at + 7 + taps]), bool(sampled), bool(tree), bool(queries),
               bool(prefill))
    return RankPlan(rows, logits_rows=logits_rows, all_logits=bool(all_logits), write_kv=bool(write_kv),
                    state_slots=slots if states else None, state_advance=advance if states else None,
                    graph_key=key)


def pack_compaction(tables: list[list[int]], starts: list[int], accepted: list[list[int]],
                    window_tables: list[list[list[int]]] = ()) -> torch.Tensor:
    """ModelRunner.compact_tree_rows' arguments: [sequences, groups beyond the first, per sequence: start,
    table, accepted rows, then each window group's table]."""
    groups = len(window_tables[0]) if len(window_tables) else 0
    out = [len(tables), groups]
    for b, (table, start, rows) in enumerate(zip(tables, starts, accepted)):
        out += [start, len(table), *table, len(rows), *rows]
        for window_table in window_tables[b] if groups else ():
            out += [len(window_table), *window_table]
    return torch.tensor(out, dtype=torch.int64)


def unpack_compaction(packed: torch.Tensor) -> tuple[list[list[int]], list[int], list[list[int]], list]:
    values = packed.tolist()
    tables, starts, accepted, windows, at = [], [], [], [], 2

    def take() -> list[int]:
        nonlocal at
        n = values[at]
        at += 1 + n
        return values[at - n:at]

    for _ in range(values[0]):
        starts.append(values[at])
        at += 1
        tables.append(take())
        accepted.append(take())
        windows.append([take() for _ in range(values[1])])
    return tables, starts, accepted, windows if values[1] else []
