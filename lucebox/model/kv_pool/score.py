"""Chunk scores for the resident-set choice (KVFlash's `qk` policy).

When a chunk of a sequence is complete, each pooled layer's keys over it (post-RoPE, as stored) are
mean-pooled per KV head and L2-normalised: one summary vector per (layer, KV head), 1/chunk of the
keys' size. A chunk's score against the latest queries (the last token's, per layer [heads, head_dim],
captured in the step before a reselect) is the cosine of each query head with its KV head's summary,
max over the heads, mean over the layers: a chunk any layer attends to strongly ranks high. Layers may
differ in head counts and sizes (Laguna, Gemma 4), so each keeps its own buffer.
"""
from __future__ import annotations

import torch


def chunk_summary(keys: list[torch.Tensor]) -> list[torch.Tensor]:
    """keys: per pooled layer [chunk tokens, kv_heads, head_dim] -> per layer [kv_heads, head_dim], unit rows."""
    return [torch.nn.functional.normalize(k.float().mean(0), dim=-1) for k in keys]


class ChunkSummaries:
    """One sequence's summaries, chunk after chunk, in per-layer buffers grown by doubling (on the keys' device)."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        self.dtype = dtype
        self.buffers: list[torch.Tensor] = []
        self.count = 0

    def append(self, summary: list[torch.Tensor]) -> None:
        if not self.buffers:
            self.buffers = [torch.empty(16, *s.shape, dtype=self.dtype, device=s.device) for s in summary]
        elif self.count == self.buffers[0].shape[0]:
            self.buffers = [torch.cat([b, torch.empty_like(b)]) for b in self.buffers]
        for buffer, s in zip(self.buffers, summary):
            buffer[self.count] = s.to(self.dtype)
        self.count += 1

    def scores(self, queries: list[torch.Tensor]) -> torch.Tensor:
        """[chunks] float32 of per-layer queries [heads, head_dim] (heads a multiple of the layer's kv_heads)."""
        if self.count == 0:
            return torch.empty(0)
        total = None
        for buffer, q in zip(self.buffers, queries):
            summaries = buffer[:self.count].float()  # [C, KVH, D]
            kv_heads, dim = summaries.shape[1:]
            q = torch.nn.functional.normalize(q.float().to(summaries.device), dim=-1).view(kv_heads, -1, dim)
            best = torch.einsum("ckd,kgd->ckg", summaries, q).flatten(1).amax(-1)
            total = best if total is None else total + best
        return (total / len(self.buffers)).cpu()
