"""A DFlash draft block's attention over its context: a block of few queries (16) against every context
key and the block's own.

Up to SPLIT_KEYS_ABOVE keys the context K/V are gathered whole and SDPA runs. Past it SDPA is the wrong
kernel: it runs the handful of queries as one tile per head that walks every key after each K/V head is
repeated for its query heads (slower than the slices from 2,048 keys on: docs/benchmarks-log.md). There the keys
go in KEY_SPLIT slices, each gathered from the paged cache only when its turn comes (no whole-context
copy, in a draft graph's memory pool or anywhere), merged by their running max and sum; each query head
group reads its K/V head in place, products in 16-bit with float32 sums where torch can.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

SPLIT_KEYS_ABOVE = 2048  # the shortest context scripts/bench_draft_attention.py times; below it SDPA stays
KEY_SPLIT = 16384


class PagedContext:
    """A pass's context K/V in a drafter layer's paged caches at `slots` [m], read as `dtype`."""

    def __init__(self, k_cache, v_cache, slots: torch.Tensor, dtype: torch.dtype):
        self.k_cache, self.v_cache, self.slots, self.dtype = k_cache, v_cache, slots, dtype

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def read(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots[start:end]
        return self.k_cache.gather(slots, self.dtype), self.v_cache.gather(slots, self.dtype)


Context = PagedContext | tuple[torch.Tensor, torch.Tensor]  # or the K/V themselves, [m, kv_heads, d] each


def context_length(context: Context) -> int:
    return len(context) if isinstance(context, PagedContext) else int(context[0].shape[0])


def read_context(context: Context, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(context, PagedContext):
        return context.read(start, end)
    return context[0][start:end], context[1][start:end]


def key_slices(context: Context, own_k: torch.Tensor, own_v: torch.Tensor, mask: torch.Tensor | None
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(keys, values, mask columns) of the context in KEY_SPLIT slices, then of the block's own K/V;
    mask [n, m + own] as the whole attention's."""
    m = context_length(context)
    for start in range(0, m, KEY_SPLIT):
        end = min(start + KEY_SPLIT, m)
        k, v = read_context(context, start, end)
        yield k.to(own_k.dtype), v.to(own_v.dtype), None if mask is None else mask[:, start:end]
    yield own_k, own_v, None if mask is None else mask[:, m:]


def split_key_attention(q: torch.Tensor, parts, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over the keys of `parts` ((keys, values [c, kv_heads, d], mask [n, c] or
    None) in key order; every query row may attend to some key) for q [heads, n, d] -> [heads, n, d]
    float32, by each part's running max and sum."""
    heads, n, d = q.shape
    best = total = out = rows = None
    for keys, values, mask in parts:
        if rows is None:
            kv_heads = keys.shape[1]
            rows = q.reshape(kv_heads, heads // kv_heads * n, d).to(keys.dtype)  # head h reads K/V head h // groups
            best = torch.full((kv_heads, rows.shape[1], 1), float("-inf"), device=q.device)
            total = torch.zeros_like(best)
            out = torch.zeros(rows.shape, dtype=torch.float32, device=q.device)
        scores = _bmm_float32(rows, keys.permute(1, 2, 0)) * scale
        if mask is not None:  # row j * n + i of a group is query i's
            scores = scores.masked_fill(~mask.repeat(heads // kv_heads, 1), float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)  # a row masked so far
        p = torch.exp(scores - safe)
        keep = torch.exp(best - safe)
        total = total * keep + p.sum(-1, keepdim=True)
        out = out * keep + _bmm_float32(p.to(values.dtype), values.transpose(0, 1))
        best = new_best
    return (out / total).reshape(heads, n, d)


_MIXED_BMM: dict[torch.device, bool] = {}  # per device: bmm takes out_dtype=float32 for 16-bit inputs


def _bmm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched) as float32: 16-bit inputs multiplied as they are with float32 sums where torch can
    (CUDA's bmm out_dtype: tensor cores), else converted first. Probed on first use, which for a draft
    graph is its warm-up, never inside a capture."""
    if a.dtype in (torch.float16, torch.bfloat16):
        mixed = _MIXED_BMM.get(a.device)
        if mixed is None:
            try:
                torch.bmm(a[:1, :1], b[:1, :, :1], out_dtype=torch.float32)
                mixed = True
            except (TypeError, RuntimeError):
                mixed = False
            _MIXED_BMM[a.device] = mixed
        if mixed:
            return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())
