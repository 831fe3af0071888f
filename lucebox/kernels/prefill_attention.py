"""Prefill attention: chunks of many new tokens through torch SDPA's fused kernels (FlashAttention
on NVIDIA GPUs), one sequence at a time.

Same contract and semantics as kernels.attention.paged_attention_reference: each sequence's new
queries attend causally to its cached context and to themselves; with a sliding window w a query
at position p sees keys k with p - k < w. kernels/attention.py sends here the sequences of an
eager step (host lengths known; never a CUDA graph's) that bring at least MIN_QUERY_LEN tokens;
decodes and verifies stay on the Triton kernel (or the reference on the CPU).

Per sequence, K/V are gathered once out of the paged cache into contiguous [n, kv_heads, D]
(dequantised for fp8 / q8_0 / q4_0, un-rotated), and SDPA runs without a dense mask where it can:
  - no cached context (the chunk starts at position 0): is_causal=True -- FlashAttention on GPUs.
  - cached context (chunked prefill, prefix-cache hit): the causal diagonal is offset by the
    context length, i.e. aligned to the lower right. On CUDA that is
    torch.nn.attention.bias.causal_lower_right, which torch runs as FlashAttention's own
    bottom-right causal mode (no mask tensor); elsewhere the [q_len, n] bool mask is built, as the
    reference does (CPU runs are tests and small models).
  - a sliding window that bites (some query is more than w - 1 positions past the first gathered
    key): queries go in tiles; each tile attends only to the keys its window can reach, with a
    small [tile, tile + w - 1] mask. Keys a window hides from every query are never gathered.
GQA: enable_gqa, so K/V heads are not repeated; the masked window tiles do repeat them, so CUDA's
memory-efficient kernel (which takes masks) accepts them on every torch version. Heads wider than
the fused kernels take with enable_gqa (Gemma 4's 512) go as one batch entry a K/V head instead.

The chunk's own K/V are read back from the cache too (rope_and_write_kv has just written them),
not taken fresh from the projection. With a quantised cache the chunk therefore attends to the
same dequantised K/V that every later decode and verify step will see -- what the reference,
the Triton kernel, vLLM v1's FlashAttention backend (flash_attn_varlen_func over the paged
cache) and llama.cpp (attention over views of its K/V cache) all do -- so the result does not
depend on how a prompt was chunked or whether a prefix came from the prefix cache, and the path
is exact against the reference for every cache type. The price is one gather of the chunk's own
K/V, q_len * kv_heads * head_dim values: tiny next to the q_len^2 attention it feeds.

Prefill is never graphed, so host-side lengths and Python loops over sequences (each one a big
chunk) are fine here; nothing loops per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .forward_batch import MAX_TREE_TOKENS, ForwardBatch

# Sequences bringing at least this many new tokens take this path. Below it (decode, speculative
# verify of up to 32 tokens) the Triton kernel reads the paged cache in place, while this path
# first copies the sequence's whole context out of it -- a cost only a chunk of a few dozen
# queries amortises. Not yet tuned on a GPU: scripts/bench_kernels.py --only prefill times both
# sides of it.
MIN_QUERY_LEN = 64
# A sliding-window layer's query tile is window / WINDOW_TILES queries (at least MIN_WINDOW_TILE, so a
# small window does not mean many tiny SDPA calls): a tile computes its queries against tile + window - 1
# keys, so a tile as long as the window would compute twice the products its window keeps.
WINDOW_TILES = 4
MIN_WINDOW_TILE = 128
# The widest head that torch's fused SDPA kernels (FlashAttention, cuDNN: 16-bit only) take with enable_gqa;
# Gemma 4's full-attention layers have 512.
FUSED_GQA_MAX_HEAD_DIM = 256


def prefill_sequences(batch: ForwardBatch) -> list[int]:
    """Indices of the sequences of an eager (host-length) batch that take the prefill path. With a
    tree mask, rows a tree could fill (<= MAX_TREE_TOKENS) stay on the masked short-step paths;
    longer rows are ordinary (all -1), so plain causal attention here is theirs."""
    if batch.device_only:
        return []
    shortest = MIN_QUERY_LEN if batch.tree_mask is None else max(MIN_QUERY_LEN, MAX_TREE_TOKENS + 1)
    return [i for i, n in enumerate(batch.query_lens_host) if n >= shortest]


def prefill_attention(q: torch.Tensor, k_cache, v_cache, batch: ForwardBatch, scale: float,
                      sliding_window: int | None = None, seqs: list[int] | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, heads, head_dim] -> out [T, heads, head_dim], for the tokens of sequences `seqs`
    (default: every sequence; any q_len works); other rows of `out` are left as they are. This
    step's K/V must already be written. Needs host lengths (not a device-only batch)."""
    if batch.device_only:
        raise ValueError("prefill_attention needs host-side lengths; a device-only batch goes to the "
                         "Triton kernel or the device-only reference")
    if out is None:
        out = torch.empty_like(q)
    starts = batch.query_starts_host
    for i in range(batch.num_seqs) if seqs is None else seqs:
        q_len = batch.query_lens_host[i]
        if q_len == 0:
            continue
        start = starts[i]
        out[start:start + q_len] = attend_one(q[start:start + q_len], k_cache, v_cache, batch.context_slots(i),
                                              scale, sliding_window)
    return out


def attend_one(q: torch.Tensor, k_cache, v_cache, slots: torch.Tensor, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
    """One sequence: q [q_len, heads, D] are the queries of its last q_len positions; `slots` [n]
    hold positions 0..n-1 in the cache (the chunk's own included). Returns [q_len, heads, D]."""
    q_len, heads, head_dim = q.shape
    n = int(slots.shape[0])
    ctx0 = n - q_len  # cached positions before the chunk
    lo = max(0, ctx0 - sliding_window + 1) if sliding_window is not None else 0  # first key any query sees
    k = k_cache.gather(slots[lo:], q.dtype).transpose(0, 1)  # [kv_heads, m, D]
    v = v_cache.gather(slots[lo:], q.dtype).transpose(0, 1)
    m = n - lo
    qh = q.transpose(0, 1)  # [heads, q_len, D]
    gqa = heads != k.shape[0]
    if sliding_window is None or m - 1 < sliding_window:  # the window hides nothing among [lo, n)
        o = _causal_lower_right(qh, k, v, scale, gqa)
    else:
        o = _windowed(qh, k, v, scale, sliding_window, ctx0 - lo)
    return o.transpose(0, 1)


def _causal_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
    """q [H, q_len, D] at the last q_len of the m key positions of k, v [Hkv, m, D]: query j sees
    keys 0..m - q_len + j."""
    heads, q_len, head_dim = q.shape
    if gqa and (head_dim > FUSED_GQA_MAX_HEAD_DIM or (q.is_cuda and q.dtype == torch.float32)):
        # No fused kernel broadcasts K/V heads this wide, or in float32 on CUDA (enable_gqa would fall
        # back to the math kernel and its [heads, q_len, m] scores): one call per member of the query
        # groups, each K/V head a batch entry (K/V expanded over the group broke the lower-right bias).
        kv_heads = k.shape[0]
        groups = q.reshape(kv_heads, heads // kv_heads, q_len, head_dim)
        outs = [_sdpa_lower_right(groups[:, g, None], k[:, None], v[:, None], scale, False)
                for g in range(groups.shape[1])]
        return torch.cat(outs, dim=1).reshape(heads, q_len, -1)
    return _sdpa_lower_right(q[None], k[None], v[None], scale, gqa)[0]


def _sdpa_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
    """_causal_lower_right's SDPA call on [B, H, L, D] tensors."""
    q_len, m = q.shape[2], k.shape[2]
    if q_len == m:  # no context: the plain causal square
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q_len == 1:  # a single query sees every key
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    elif q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, m), scale=scale,
                                           enable_gqa=gqa)
    else:
        mask = torch.ones(q_len, m, dtype=torch.bool, device=q.device).tril_(m - q_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, q0: int) -> torch.Tensor:
    """Sliding-window causal attention in query tiles: q [H, q_len, D], query j at key position q0 + j
    of k, v [Hkv, m, D]; key p is visible to query position t when p <= t and t - p < window."""
    heads, q_len, _ = q.shape
    group = heads // k.shape[0]
    tile = max(window // WINDOW_TILES, MIN_WINDOW_TILE)
    out = torch.empty_like(q)
    for a in range(0, q_len, tile):
        b = min(a + tile, q_len)
        k_lo, k_hi = max(0, q0 + a - window + 1), q0 + b  # keys the tile's queries can reach
        t = torch.arange(q0 + a, q0 + b, device=q.device)[:, None]
        p = torch.arange(k_lo, k_hi, device=q.device)[None, :]
        mask = (p <= t) & (t - p < window)
        kt, vt = k[:, k_lo:k_hi], v[:, k_lo:k_hi]
        if group > 1:
            kt, vt = kt.repeat_interleave(group, dim=0), vt.repeat_interleave(group, dim=0)
        out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], kt[None], vt[None], attn_mask=mask,
                                                     scale=scale)[0]
    return out

