"""The KV cache groups as the benchmarks see them (model/cache_spec.kv_groups; DESIGN.md, the cache seam).

A model mixing sliding-window and full attention (Gemma 4, Laguna) keeps one block pool and one
table per sequence for each group: its full-attention layers' (the primary, seq.block_table) and
one per window (seq.window_tables), whose blocks behind the window go back to the pool. A bare
`runner.forward` needs every group's table; these helpers build them the way the cache manager
would have left them, size the KV budget of a one-sequence engine from the groups, and read the
KV memory a running sequence holds in all groups.
"""
from __future__ import annotations

import torch

from ..engine.runner import model_kv_groups
from ..model.cache_spec import bytes_per_token, window_blocks


def group_block_bytes(cache) -> list[int]:
    """Bytes of one block in each KV cache group of a CacheManager (primary first)."""
    return [round(bytes_per_token([cache.specs[i] for i in g.layers]) * cache.block_size) for g in cache.groups]


def held_kv_bytes(engine) -> int:
    """KV bytes the engine's running sequences hold now, every group's blocks (released ones not counted)."""
    cache = engine.scheduler.cache
    sizes = group_block_bytes(cache)
    return sum(blocks * size for seq in engine.scheduler.running
               for blocks, size in zip(cache.held_by_group(seq), sizes))


def pool_bytes(model, specs, max_len: int, block_size: int, step_tokens: int) -> int:
    """A KV budget for one sequence of max_len positions (and two spare blocks): the primary group
    holds the whole context, each window group its window with a full step of new tokens in flight
    (what model/cache_spec.plan_pools asks for one sequence)."""
    groups = model_kv_groups(model, specs)
    total = 0
    for index, group in enumerate(groups):
        size = bytes_per_token([specs[i] for i in group.layers]) * block_size
        if index == 0 or group.window is None:
            blocks = -(-max_len // block_size) + 2
        else:
            step = min(step_tokens, max_len)
            blocks = max(window_blocks(group.window, block_size, step),
                         window_blocks(group.window, block_size, 1) + -(-step // block_size)) + 1
        total += round(size * blocks)
    return total


def allocate(engine, positions: int, cached: int) -> tuple[list[int], list[list[int]]]:
    """Tables of every group for a bare forward of positions [cached, positions) after `cached` positions
    (their KV whatever the pool holds): the primary's blocks for all of them, each window group's from
    the block its window of position `cached` reaches, released entries before it."""
    cache = engine.scheduler.cache
    table: list[int] = []
    cache.blocks.allocate(table, positions)
    windows = []
    for pool, window in zip(cache.window_pools, cache.windows):
        skipped = max(0, cached - window + 1) // cache.block_size
        windows.append([])
        pool.admit(windows[-1], [], skipped)
        pool.allocate(windows[-1], positions)
    return table, windows


def free(engine, table: list[int], windows: list[list[int]]) -> None:
    cache = engine.scheduler.cache
    cache.blocks.free_table(table)
    for pool, window_table in zip(cache.window_pools, windows):
        pool.free_table(window_table)


def all_logits(engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position of `ids`, forwarded `chunk` tokens at a time; window groups release
    the blocks behind their window between chunks, as the engine's chunked prefill does, so a
    sequence longer than a window group's pool still fits."""
    cache = engine.scheduler.cache
    table: list[int] = []
    windows: list[list[int]] = [[] for _ in cache.window_pools]
    out = []
    try:
        for start in range(0, len(ids), chunk):
            end = min(len(ids), start + chunk)
            cache.blocks.allocate(table, end)
            for pool, window_table in zip(cache.window_pools, windows):
                pool.allocate(window_table, end)
            out.append(engine.runner.forward([ids[start:end]], [start], [table], window_tables=[windows],
                                             all_logits=True))
            for pool, window_table, window in zip(cache.window_pools, windows, cache.windows):
                pool.release_before(window_table, end - window + 1)
    finally:
        free(engine, table, windows)
    return torch.cat(out)
