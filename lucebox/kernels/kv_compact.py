"""KV compaction after a tree verify: the accepted path's rows move onto contiguous positions.

A tree verify row stores token i at position start + i (kernels/forward_batch.py). Once the
verdict is known, the accepted path's row indices a_0 = 0 < a_1 < ... < a_m must hold positions
start + 0 .. start + m, as if those tokens had been verified as a chain; the rejected rows'
positions are simply overwritten later (the sequence's length ends at start + m + 1).

`compaction_slots` turns every sequence's accepted path into (source slots, destination slots)
of one KV cache group; `compact_rows` applies them to every cache of that group (K and V of each
attention layer, values and quantisation scales alike) with one index_select + index_copy_ per
tensor: the gather copies every source row out before any destination is written, so moves whose
sources and destinations overlap (a_k = j for some later destination j) are safe. Both work on
device tensors without reading their values, so a captured graph can replay them (pad unused
entries with moves of the scratch block's slot onto itself, never a live slot: a padding copy of
a destination's old value could land after its real move). KV-shared layers (Gemma 4) read their
source layer's cache and need nothing. Layers of another KV cache group (sliding-window groups)
need their own slots (their block tables differ): one compaction_slots / compact_rows per group,
e.g. over the runner's caches of that group.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from ..util import host_to_device


def compaction_slots(block_tables: list[list[int]], block_size: int, starts: list[int],
                     accepted: list[list[int]], device: torch.device | str = "cpu"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sequence b: rows accepted[b] (increasing, starting at 0: the pending token) of its
    tree verify at starts[b] move to starts[b] + 0, 1, ...; returns (src, dst) int64 slot tensors
    (rows already in place are left out)."""
    if not len(block_tables) == len(starts) == len(accepted):
        raise ValueError(f"compaction_slots: {len(block_tables)} block tables, {len(starts)} starts and "
                         f"{len(accepted)} accepted paths must match")
    src, dst = [], []
    for b, (table, start, path) in enumerate(zip(block_tables, starts, accepted)):
        if path and path[0] != 0:
            raise ValueError(f"sequence {b}: an accepted path starts at row 0 (the pending token), got {path}")
        if any(later <= earlier for earlier, later in itertools.pairwise(path)):
            raise ValueError(f"sequence {b}: accepted rows must increase (DFS order), got {path}")
        for k, row in enumerate(path):
            if row != k:
                src.append(_slot(table, block_size, start + row, b))
                dst.append(_slot(table, block_size, start + k, b))
    return host_to_device(src, device, torch.long), host_to_device(dst, device, torch.long)


def _slot(table: list[int], block_size: int, pos: int, seq: int) -> int:
    block = pos // block_size
    if block >= len(table) or table[block] < 0:
        raise ValueError(f"sequence {seq}: position {pos} has no block in its table")
    return table[block] * block_size + pos % block_size


def compact_rows(caches: Iterable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slot src[i] onto slot dst[i] in every PagedKVCache of `caches` (values and scales).
    A cache listed twice is moved once (moving again would shift overlapping rows a second time)."""
    done = set()
    for cache in caches:
        if id(cache) in done:
            continue
        done.add(id(cache))
        for t in (cache.values, cache.scales):
            if t is None:
                continue
            # Bytes per slot: one copy kernel for every storage type (fp8 has no CPU index_copy).
            rows = t.view(t.shape[0] * t.shape[1], -1).view(torch.uint8)
            rows.index_copy_(0, dst, rows.index_select(0, src))
