"""Chunk scores for the resident-set choice (KVFlash's `qk` policy).

When a chunk of a sequence is complete, each pooled layer's keys over it (post-RoPE, as stored) are
mean-pooled per KV head and L2-normalised: one summary vector per (layer, KV head), 1/chunk of the
keys' size. A chunk's score against the latest queries q [layers, heads, head_dim] (the last token's,
captured in the step before a reselect) is the cosine of each query head with its KV head's
summary, max over the heads, mean over the layers: a chunk any layer attends to strongly ranks high.
"""
from __future__ import annotations

import torch


def chunk_summary(keys: list[torch.Tensor]) -> torch.Tensor:
    """keys: per pooled layer [chunk tokens, kv_heads, head_dim] -> [layers, kv_heads, head_dim], unit rows."""
    pooled = torch.stack([k.float().mean(0) for k in keys])
    return torch.nn.functional.normalize(pooled, dim=-1)


class ChunkSummaries:
    """One sequence's summaries, chunk after chunk, in a buffer grown by doubling (on its cache's device)."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None
        self.count = 0

    def append(self, summary: torch.Tensor) -> None:
        if self.buffer is None:
            self.buffer = torch.empty(16, *summary.shape, dtype=self.dtype, device=summary.device)
        elif self.count == self.buffer.shape[0]:
            grown = torch.empty(2 * self.count, *self.buffer.shape[1:], dtype=self.dtype, device=self.buffer.device)
            grown[:self.count] = self.buffer
            self.buffer = grown
        self.buffer[self.count] = summary.to(self.dtype)
        self.count += 1

    def scores(self, queries: torch.Tensor) -> torch.Tensor:
        """[chunks] float32 of queries [layers, heads, head_dim] (heads a multiple of kv_heads)."""
        if self.count == 0:
            return torch.empty(0)
        summaries = self.buffer[:self.count].float()  # [C, L, KVH, D]
        layers, kv_heads, dim = summaries.shape[1:]
        q = torch.nn.functional.normalize(queries.float().to(summaries.device), dim=-1)
        q = q.view(layers, kv_heads, -1, dim)  # query heads grouped by their KV head
        cos = torch.einsum("clkd,lkgd->clkg", summaries, q)
        return cos.flatten(2).amax(-1).mean(-1).cpu()
