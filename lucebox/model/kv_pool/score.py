"""Chunk scores for the resident-set choice (KVFlash's `qk` policy, with Quest's bound).

When a chunk of a sequence is complete, each pooled layer's keys over it (post-RoPE, dequantised) are
reduced per KV head to their elementwise min and max: 2 vectors per (layer, KV head), 2/64 of the
keys' size. For a query q the largest q.k any key of the chunk can reach is at most
sum_d max(q_d * min_d, q_d * max_d) (Quest, Tang et al. 2024); a chunk's score against the latest
queries (the last token's, per layer [heads, head_dim], captured in the step before a reselect) is
that bound, max over the heads, standardised over the chunks within each layer (layers' logits
differ in scale), then averaged over the layers. On the bundled model's needle task it keeps the
needle resident about twice as often as the cosine to mean-pooled keys. Layers may differ in head
counts and sizes (Laguna, Gemma 4), so each keeps its own buffer.
"""
from __future__ import annotations

import torch


def chunk_bounds(keys: torch.Tensor) -> torch.Tensor:
    """One layer's keys [chunks, chunk tokens, kv_heads, head_dim] -> [chunks, 2, kv_heads, head_dim] (min, max)."""
    return torch.stack([keys.amin(1), keys.amax(1)], dim=1).float()


def key_bound(summaries: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """summaries [C, 2, kv_heads, D], q [heads, D] -> [C]: the best head's upper bound of q.k over each chunk."""
    kv_heads, dim = summaries.shape[2:]
    q = q.float().to(summaries.device).view(kv_heads, -1, dim)  # query heads grouped by their KV head
    low = torch.einsum("ckd,kgd->ckgd", summaries[:, 0], q)
    high = torch.einsum("ckd,kgd->ckgd", summaries[:, 1], q)
    return torch.maximum(low, high).sum(-1).flatten(1).amax(-1)


class ChunkSummaries:
    """One sequence's summaries, chunk after chunk, in per-layer buffers grown by doubling (on the keys' device)."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        self.dtype = dtype
        self.buffers: list[torch.Tensor] = []
        self.count = 0

    def extend(self, bounds: list[torch.Tensor]) -> None:
        """Append chunks: per layer their chunk_bounds [n, 2, kv_heads, head_dim] (n alike in every layer)."""
        n = bounds[0].shape[0]
        if not self.buffers:
            self.buffers = [torch.empty(max(16, n), *b.shape[1:], dtype=self.dtype, device=b.device) for b in bounds]
        size = self.buffers[0].shape[0]
        if self.count + n > size:
            size = max(2 * size, self.count + n)
            self.buffers = [torch.cat([b[:self.count], b.new_empty(size - self.count, *b.shape[1:])])
                            for b in self.buffers]
        for buffer, b in zip(self.buffers, bounds):
            buffer[self.count:self.count + n] = b.to(self.dtype)
        self.count += n

    def scores(self, queries: list[torch.Tensor]) -> torch.Tensor:
        """[chunks] float32 of per-layer queries [heads, head_dim] (heads a multiple of the layer's kv_heads)."""
        if self.count == 0:
            return torch.empty(0)
        total = torch.zeros(self.count, device=self.buffers[0].device)
        for buffer, q in zip(self.buffers, queries):
            bound = key_bound(buffer[:self.count].float(), q)
            if self.count > 1:
                total += (bound - bound.mean()) / (bound.std() + 1e-6)
        return (total / len(self.buffers)).cpu()
