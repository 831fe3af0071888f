"""Paged attention: torch reference (CPU and any device); GPU tensors go to the Triton kernel
(kernels/triton_paged_attention.py) through kernels/dispatch.py.

K/V live in paged stores (engine/kv_cache.PagedKVCache: [num_blocks, block_size, kv_heads,
head_dim] in the chosen cache type, gathered back as floats). Each sequence's new
queries attend causally to its cached context and to themselves; a layer with a sliding window
sees only keys with q_pos - k_pos < window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.forward_batch import ForwardBatch
from .dispatch import use_triton


def paged_attention(q: torch.Tensor, k_cache, v_cache, batch: ForwardBatch, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim]; the new K/V must already be written."""
    if use_triton(q, k_cache.values, v_cache.values):
        from . import triton_paged_attention as tpa
        if tpa.supports(q, k_cache, v_cache):
            return tpa.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_cache.num_kv_heads
    start = 0
    for i, q_len in enumerate(batch.query_lens_host):
        if q_len == 0:
            continue
        slots = batch.context_slots(i)
        k = k_cache.gather(slots, q.dtype).transpose(0, 1)  # [kv_heads, ctx, d]
        v = v_cache.gather(slots, q.dtype).transpose(0, 1)
        if heads != kv_heads:
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        ctx = slots.shape[0]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= (q_pos - k_pos) < sliding_window
        qi = q[start:start + q_len].transpose(0, 1)  # [heads, q_len, d]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out
