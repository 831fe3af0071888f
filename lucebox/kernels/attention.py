"""Paged attention: which implementation runs, and the plain-torch reference they all answer to.

K/V live in paged stores (model/kv_cache.PagedKVCache: [num_blocks, block_size, kv_heads,
head_dim] in the chosen cache type, gathered back as floats). Each sequence's new
queries attend causally to its cached context and to themselves; a layer with a sliding window
sees only keys with q_pos - k_pos < window.

`paged_attention` dispatches, per sequence of an eager step (host lengths known):
  - prefill chunks (q_len >= prefill_attention.MIN_QUERY_LEN): kernels/prefill_attention.py,
    torch SDPA without a dense mask (FlashAttention on GPUs), on every device;
  - everything shorter (decode, speculative verify): the Triton kernel
    (kernels/triton_paged_attention.py) where kernels/dispatch.py allows it, else the reference.
A step mixing both splits its batch (ForwardBatch.select) and runs each part on its path.

Tree verify rows (ForwardBatch.tree_mask, kernels/forward_batch.py): every path also hides the
in-row keys whose bit is clear in the query's mask; causal bounds come from storage positions
(seq_len - q_len + i), never from `positions`, which a tree row sets to start + depth. Rows a tree
can fill never take the prefill path. On a sliding-window layer a query's window is measured from
its depth (its distance from a committed key is start + depth - key, as if its path had been
verified as a chain): tree_window_positions; windows shorter than a tree row are refused.

A device-only batch (ForwardBatch.from_device, a CUDA graph's) has no host lengths: it goes to the
Triton kernel, or to a reference that attends over the whole block-table width with masks, reading
lengths only from device tensors. That one costs memory in proportion to max_seq_len, so it suits
tests and small contexts (the runner captures graphs only when `uses_triton` says so).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import prefill_attention as pa
from .dispatch import use_triton
from .forward_batch import ForwardBatch, check_tree_window


def paged_attention(q: torch.Tensor, k_cache, v_cache, batch: ForwardBatch, scale: float,
                    sliding_window: int | None = None, rounded: bool = False):
    """q [T, heads, head_dim] -> [T, heads, head_dim]; the new K/V must already be written. rounded:
    (that, its rows [T, heads * head_dim] rounded to int8 as quantize_rows packs them where the
    Triton decode / verify kernel runs and can write them in its last launch, else None)."""
    check_tree_window(batch, sliding_window)
    if batch.query_capture is not None:  # each row's last token (a graph's rows: max_query_len tokens each)
        batch.query_capture[id(k_cache)] = (q.view(-1, batch.max_query_len, *q.shape[1:])[:, -1] if batch.device_only
                                             else q[[start - 1 for start in batch.query_starts_host[1:]]])
    triton = uses_triton(q, k_cache, v_cache)
    prefill = [] if batch.device_only else pa.prefill_sequences(batch)
    if triton and not prefill:  # decode / verify steps (all of a graph's)
        from . import triton_paged_attention as tpa
        if rounded and tpa.rounds_rows(q, v_cache):
            return tpa.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, rounded=True)
        out = tpa.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)
    elif batch.device_only:
        out = _device_only_reference(q, k_cache, v_cache, batch, scale, sliding_window)
    elif not prefill:
        out = paged_attention_reference(q, k_cache, v_cache, batch, scale, sliding_window)
    else:
        out = pa.prefill_attention(q, k_cache, v_cache, batch, scale, sliding_window, seqs=prefill)
        rest = [i for i, n in enumerate(batch.query_lens_host) if n > 0 and i not in prefill]
        if rest:
            if triton:
                from . import triton_paged_attention as tpa
                sub, rows = batch.select(rest)
                out[rows] = tpa.paged_attention(q[rows], k_cache, v_cache, sub, scale, sliding_window)
            else:
                _reference_into(out, q, k_cache, v_cache, batch, scale, sliding_window, rest)
    return (out, None) if rounded else out


def attention_output(q: torch.Tensor, k_cache, v_cache, batch: ForwardBatch, scale: float,
                     sliding_window: int | None, projection) -> torch.Tensor:
    """projection(paged_attention(...) as [T, heads * head_dim]). Where the product takes int8 rows,
    the attention's last launch rounds them if it can (no quantize_rows launch of their own)."""
    from .linear import linear, linears, takes_int8
    tokens = q.shape[0]
    if not takes_int8((projection,), q.reshape(tokens, -1)):
        return linear(paged_attention(q, k_cache, v_cache, batch, scale, sliding_window).reshape(tokens, -1),
                      projection)
    o, rows = paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, rounded=True)
    return linears(o.reshape(tokens, -1), (projection,), rows)[0]


def paged_attention_reference(q: torch.Tensor, k_cache, v_cache, batch: ForwardBatch, scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    """The specification every path is tested against: per sequence, its whole context gathered
    (dequantised) from the cache, a dense [q_len, ctx] causal (and window, and tree) mask, and SDPA
    with grouped KV heads. Host lengths required."""
    check_tree_window(batch, sliding_window)
    out = torch.empty_like(q)
    return _reference_into(out, q, k_cache, v_cache, batch, scale, sliding_window,
                           range(len(batch.query_lens_host)))


def _reference_into(out: torch.Tensor, q: torch.Tensor, k_cache, v_cache, batch: ForwardBatch, scale: float,
                    sliding_window: int | None, seqs) -> torch.Tensor:
    """Write the reference attention of sequences `seqs` into their rows of `out`."""
    heads, kv_heads = q.shape[1], k_cache.num_kv_heads
    starts = batch.query_starts_host
    for i in seqs:
        q_len, start = batch.query_lens_host[i], starts[i]
        if q_len == 0:
            continue
        slots = batch.context_slots(i)
        ctx = slots.shape[0]
        # Keys no query's window reaches are not gathered: their blocks may be released (scratch).
        lo = max(0, ctx - q_len - sliding_window + 1) if sliding_window is not None else 0
        k = k_cache.gather(slots[lo:], q.dtype).transpose(0, 1)  # [kv_heads, ctx - lo, d]
        v = v_cache.gather(slots[lo:], q.dtype).transpose(0, 1)
        mask = None  # a decode step's one query sees every gathered key
        if q_len > 1:
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            k_pos = torch.arange(lo, ctx, device=q.device)[None, :]
            mask = k_pos <= q_pos
            tree = batch.tree_mask[start:start + q_len, None] if batch.tree_mask is not None else None
            if sliding_window is not None:
                win_pos = q_pos if tree is None else tree_window_positions(tree, q_pos)
                mask &= (win_pos - k_pos) < sliding_window
            if tree is not None:
                mask &= tree_visible(tree, k_pos - (ctx - q_len))
        qi = q[start:start + q_len].transpose(0, 1)  # [heads, q_len, d]
        # enable_gqa: query head h reads KV head h // (heads // kv_heads), without copying K and V.
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
        out[start:start + q_len] = o.transpose(0, 1)
    return out


def tree_window_positions(masks: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Where each query's sliding window is measured from: start + depth for a tree row's token
    (depth = its ancestors, popcount(mask) - 1), its storage position q_pos for an ordinary row's
    (-1). Windows are at least a row long (check_tree_window), so only committed keys can fall out."""
    bits = (masks >> torch.arange(64, device=masks.device)) & 1
    depth = bits.sum(-1, keepdim=True) - 1
    row_start = q_pos - torch.arange(q_pos.shape[-2], device=q_pos.device)[:, None]
    return torch.where(masks == -1, q_pos, row_start + depth)


def tree_visible(masks: torch.Tensor, k_rel: torch.Tensor) -> torch.Tensor:
    """Tree visibility: masks [..., 1] int64 (one per query), k_rel [..., K] key positions relative
    to the row's first token. Keys before the row (k_rel < 0) are committed: visible. Bits past 63
    repeat bit 63 (sign extension: every bit of -1, an ordinary row's mask)."""
    bit = (masks >> k_rel.clamp(0, 63)) & 1
    return (k_rel < 0) | (bit != 0)


def uses_triton(q: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether paged_attention sends these operands to the Triton kernel."""
    if not use_triton(q, k_cache.values, v_cache.values):
        return False
    from . import triton_paged_attention as tpa
    return tpa.supports(q, k_cache, v_cache)


def _device_only_reference(q: torch.Tensor, k_cache, v_cache, batch: ForwardBatch, scale: float,
                           sliding_window: int | None) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    num_seqs, q_len, bs = batch.num_seqs, batch.max_query_len, batch.block_size
    kv_heads = k_cache.num_kv_heads
    width = batch.block_tables.shape[1] * bs
    k_pos = torch.arange(width, device=q.device)
    # Past a sequence's end the table may hold anything, and entries behind a sliding window may
    # be released (the scratch block): clamping keeps the gather in bounds, and the causal and
    # window masks hide those keys before the softmax (their finite values get weight 0).
    slots = batch.block_tables[:, k_pos // bs].long().clamp_min(0) * bs + k_pos % bs  # [B, width]

    q_pos = batch.seq_lens[:, None] - q_len + torch.arange(q_len, device=q.device)  # [B, q_len]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    tree = batch.tree_mask.view(num_seqs, q_len, 1) if batch.tree_mask is not None else None
    if sliding_window is not None:
        win_pos = q_pos[:, :, None] if tree is None else tree_window_positions(tree, q_pos[:, :, None])
        mask &= (win_pos - k_pos[None, None, :]) < sliding_window
    if tree is not None:
        rel = k_pos[None, None, :] - (batch.seq_lens[:, None, None] - q_len)  # [B, 1, width]
        mask &= tree_visible(tree, rel)
    # Keys no query sees are zeroed, not just weighted 0: a released block may hold anything (NaN * 0 is NaN).
    seen = mask.any(1)[:, None, :, None]  # [B, 1, width, 1]

    def gather(cache):
        x = cache.gather(slots.reshape(-1), q.dtype).view(num_seqs, width, kv_heads, head_dim).transpose(1, 2)
        x = torch.where(seen, x, 0)
        return x.repeat_interleave(heads // kv_heads, dim=1) if heads != kv_heads else x

    qi = q.view(num_seqs, q_len, heads, head_dim).transpose(1, 2)  # [B, heads, q_len, d]
    o = F.scaled_dot_product_attention(qi, gather(k_cache), gather(v_cache), attn_mask=mask[:, None], scale=scale)
    return o.transpose(1, 2).reshape(tokens, heads, head_dim)
