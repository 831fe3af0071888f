"""Paged attention over PagedKVCache storage (Triton): decode, verify and prefill chunks alike.
(kernels/attention.py sends eager prefill chunks of prefill_attention.MIN_QUERY_LEN tokens or more
to SDPA instead, kernels/prefill_attention.py; this kernel takes everything else, graphs included.)

One program owns one (sequence, kv head, tile of BLOCK_Q new tokens, split of the context). GQA
is folded into the rows of the query tile: row r is query token r // GROUP of head
kv_head * GROUP + r % GROUP, so every K/V tile read from memory serves all query heads that
share it, and a decode (1 token x GROUP heads) still fills a tensor-core tile. K/V are gathered
through the block table one token at a time (any block_size), dequantised in registers for
fp8 / q8_0 / q4_0 caches, and combined with an online softmax in float32 (base 2). Tall query tiles
(64 rows or more: prefill chunks, long verifies) take the key tiles every row sees whole without masks
(triton_attention_tiles.attend_tile holds one tile's step).

Split-K (flash-decoding): for long contexts and few programs, the context is cut into NUM_SPLITS
ranges processed in parallel; each writes its normalised partial output and log-sum-exp, and a
second kernel merges them. Splits are chosen on the host from host-side lengths (no device sync)
or passed explicitly (`num_splits`).

Graph-safe mode (a device-only ForwardBatch, as a CUDA graph replays): the host knows only the
bucket's bounds (max_query_len, and max_seq_len from the block-table width), so tile sizes, the
grid and the split count follow those and stay fixed across replays, while the kernels read the
true lengths from device tensors. Each split's range then comes from the true context length, so
on a short context the trailing splits are empty: they store lse = -inf and the merge weighs them 0.

Masks: key k is visible to the query at absolute position p when k <= p (causal, which covers
the new tokens among themselves) and, with a sliding window w, p - k < w. p is the storage
position seq_len - q_len + i, never the rope position. Tree verify rows (ForwardBatch.tree_mask,
TREE): each query row loads its int64 mask once, and a key of this step's row at offset j is
visible only when bit j is set (offsets past 63 test bit 63: every bit of an ordinary row's -1);
tiles wholly before the row skip the test, and without a tree mask it is not compiled in. With a
window, a tree token's window is measured from start + depth (depth = popcount(mask) - 1), as
kernels/attention.tree_window_positions defines it.

Rotated caches (PagedKVCache(rotate=True) stores x @ H with H an orthonormal Hadamard matrix):
q.k = (q @ H).(k @ H), so q is rotated once instead of un-rotating every key, and the output
(a mix of rotated values) is un-rotated once at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2, num_sms, pdl_launch, shared_memory
from .forward_batch import check_tree_window
from .triton_attention_tiles import attend_tile
from .triton_dp4a import rounded_rows_like, store_rounded
from .triton_pdl import wait_for_previous_kernel

_KV_PLAIN, _KV_FP8, _KV_Q8_0, _KV_Q4_0 = range(4)
_KV_FORMATS = {"f32": _KV_PLAIN, "f16": _KV_PLAIN, "bf16": _KV_PLAIN, "fp8": _KV_FP8,
               "q8_0": _KV_Q8_0, "q4_0": _KV_Q4_0}
SUPPORTED_CACHE_TYPES = frozenset(_KV_FORMATS)
_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _popcount64(x):
    """Set bits of int64 x (SWAR; the masks drop what arithmetic shifts smear in from the sign)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


@triton.jit
def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, lse_ptr,
        qsl_ptr, seq_lens_ptr, bt_ptr, tree_ptr,
        qk_scale, window, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
        stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
        stride_ks_slot, stride_ks_head, stride_vs_slot, stride_vs_head,
        stride_bt, block_size,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KV: tl.constexpr,
        K_FMT: tl.constexpr, V_FMT: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
        DOT_IEEE: tl.constexpr, TREE: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_bh = tl.program_id(0)
    pid_q = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq = pid_bh // KV_HEADS
    kvh = pid_bh % KV_HEADS
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    q0 = pid_q * BLOCK_Q
    if q0 < q_len:
        r = tl.arange(0, BLOCK_R)
        qi = q0 + r // GROUP
        head = kvh * GROUP + r % GROUP
        row_ok = (r < BLOCK_Q * GROUP) & (qi < q_len)
        ctx0 = seq_len - q_len  # cached tokens before this step's new ones
        q_pos = ctx0 + qi
        tok = (q_start + qi).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_IEEE:
            q = q.to(tl.float32)
        win_pos = q_pos  # where each query's window is measured from
        tree_lo = 0
        tree_hi = 0
        if TREE:  # visibility bits of each row's query token among this step's keys
            tree_bits = tl.load(tree_ptr + tok, mask=row_ok, other=-1)
            tree_lo = tree_bits.to(tl.int32)  # bits 0..31 (truncation)
            tree_hi = (tree_bits >> 32).to(tl.int32)  # bits 32..63, arithmetic: -1 stays all ones
            if HAS_WINDOW:
                depth = (_popcount64(tree_bits) - 1).to(tl.int32)
                win_pos = tl.where(tree_bits == -1, q_pos, ctx0 + depth)

        # Keys this query tile can see: [lo, hi).
        hi = ctx0 + tl.minimum(q0 + BLOCK_Q, q_len)
        lo = 0
        if HAS_WINDOW:
            if TREE:  # a token's depth may be anything up to its index
                lo = tl.maximum(ctx0 - window + 1, 0)
            else:
                lo = tl.maximum(ctx0 + q0 - window + 1, 0)
        per_split = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_KV) * BLOCK_KV
        s_lo = lo + pid_s * per_split
        s_hi = tl.minimum(s_lo + per_split, hi)

        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        k_head = kvh * stride_k_head
        v_head = kvh * stride_v_head
        ks_head = kvh * stride_ks_head
        vs_head = kvh * stride_vs_head
        if BLOCK_R >= 64:
            # Tall tiles (prefill chunks, long verifies) are bound by the tile's instructions: the tiles every
            # row sees whole skip the masks (keys before the tile's first query, before this step's row for
            # trees, and within every row's window). Short ones (decode) keep one loop and fewer registers.
            full_lo = lo
            if HAS_WINDOW:
                full_lo = tl.maximum(hi - window, lo)
            full_hi = ctx0 if TREE else ctx0 + q0 + 1
            tiles = tl.cdiv(s_hi - s_lo, BLOCK_KV)
            first_full = tl.minimum(tl.cdiv(tl.maximum(full_lo - s_lo, 0), BLOCK_KV), tiles)
            end_full = tl.maximum(tl.minimum(tl.maximum(full_hi - s_lo, 0), s_hi - s_lo) // BLOCK_KV, first_full)
            a = s_lo + first_full * BLOCK_KV
            b = s_lo + end_full * BLOCK_KV
            for seg in tl.static_range(3):  # masked edge, interior, masked edge
                seg_lo = s_lo if seg == 0 else (a if seg == 1 else b)
                seg_hi = a if seg == 0 else (b if seg == 1 else s_hi)
                for start in range(seg_lo, seg_hi, BLOCK_KV):
                    m_i, l_i, acc = attend_tile(
                        q, m_i, l_i, acc, start, s_hi, q_pos, win_pos, tree_lo, tree_hi, ctx0, window, qk_scale,
                        bt_row, block_size, k_ptr, ks_ptr, stride_k_slot, stride_ks_slot, k_head, ks_head,
                        v_ptr, vs_ptr, stride_v_slot, stride_vs_slot, v_head, vs_head,
                        HEAD_DIM, BLOCK_D, BLOCK_KV, K_FMT, V_FMT, HAS_WINDOW, DOT_IEEE, TREE, seg != 1)
        else:
            for start in range(s_lo, s_hi, BLOCK_KV):
                m_i, l_i, acc = attend_tile(
                    q, m_i, l_i, acc, start, s_hi, q_pos, win_pos, tree_lo, tree_hi, ctx0, window, qk_scale, bt_row,
                    block_size, k_ptr, ks_ptr, stride_k_slot, stride_ks_slot, k_head, ks_head,
                    v_ptr, vs_ptr, stride_v_slot, stride_vs_slot, v_head, vs_head,
                    HEAD_DIM, BLOCK_D, BLOCK_KV, K_FMT, V_FMT, HAS_WINDOW, DOT_IEEE, TREE, True)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_ptrs = o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        o_mask = row_ok[:, None] & d_ok[None, :]
        if SPLIT:
            tl.store(o_ptrs + pid_s * stride_os, out, mask=o_mask)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(lse_ptr + tok * stride_lt + head * stride_lh + pid_s, lse, mask=row_ok)
        else:
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, o_ptr, rows_ptr, num_splits, n_blocks,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh, stride_rt,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         ROUND: tl.constexpr = False, PDL: tl.constexpr = False):
    """One (token, head): the splits' outputs weighed by their log-sum-exp; with ROUND, also the
    head's values of the token's row rounded to int8 as triton_dp4a.quantize_rows packs them."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits have lse = -inf: weight 0
    part = tl.load(part_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    if ROUND:  # from the stored (model dtype) values, as quantize_rows reads them
        x = tl.reshape(out.to(o_ptr.dtype.element_ty).to(tl.float32), [BLOCK_D // 32, 32])
        b = tl.arange(0, BLOCK_D // 32)
        store_rounded(rows_ptr + t * stride_rt, x, h * (HEAD_DIM // 32) + b, b < HEAD_DIM // 32, n_blocks)


def supports(q: torch.Tensor, k_cache, v_cache) -> bool:
    return (k_cache.cache_type in _KV_FORMATS and v_cache.cache_type in _KV_FORMATS
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and q.shape[1] % k_cache.num_kv_heads == 0 and q.shape[-1] == k_cache.head_dim)


def _storage(cache):
    """(values, scales) viewed by slot: [slots, H, X]; scales default to the values (unused)."""
    vals = cache.values.view(-1, *cache.values.shape[2:])
    scales = cache.scales.view(-1, *cache.scales.shape[2:]) if cache.scales is not None else vals
    return vals, scales


def key_tile(block_r: int, block_d: int, kv_bytes: int, shared: int) -> int:
    """Keys a program's tile takes per step: 128 for decode and verify tiles (<= 64 rows) of a 16-bit
    cache where three stages of its K and V tiles fit shared memory (the H100 sweep's fastest, run
    by 4 warps), else 64 for those rows, 32 for taller or wider tiles. kv_bytes: a cache value's
    bytes (f32 4; fp8 / q8_0 / q4_0 1, whose unpacking the sweep has not priced at 128)."""
    if block_d > 128 or block_r > 64:
        return 32
    stages_bytes = 3 * 2 * 128 * block_d * kv_bytes + block_r * block_d * 2
    return 128 if kv_bytes == 2 and stages_bytes <= shared else 64


def rounds_rows(q: torch.Tensor, v_cache) -> bool:
    """Whether paged_attention(..., rounded=True) can round its output rows for an int8 product."""
    tokens, heads, head_dim = q.shape
    return not v_cache.rotate and head_dim % 32 == 0 and heads * head_dim % 256 == 0


def paged_attention(q: torch.Tensor, k_cache, v_cache, batch, scale: float,
                    sliding_window: int | None = None, *, num_splits: int | None = None,
                    block_kv: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, rows: int | None = None, rounded: bool = False):
    """Same contract as kernels.attention.paged_attention: q [T, heads, head_dim] -> same shape;
    this step's K/V must already be written. The keyword launch settings (splits of the keys, key
    tile, warps, stages, query rows a program) override the heuristics: for sweeps. rounded (where
    rounds_rows): (output, its rows [T, heads * head_dim] rounded to int8 as quantize_rows packs
    them), the merge launch writing both (it runs even over one split)."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.num_kv_heads
    group = heads // kv_heads
    num_seqs = int(batch.query_start_loc.shape[0]) - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    packed = rounded_rows_like(out.view(tokens, -1)) if rounded else None
    if tokens == 0 or num_seqs <= 0:
        return (out, packed) if rounded else out
    if rounded and not rounds_rows(q, v_cache):
        raise ValueError(f"paged attention: rows rounded to int8 need head_dim % 32 == 0, heads * head_dim % 256 "
                         f"== 0 and an unrotated V cache, got {heads} x {head_dim}, rotate={v_cache.rotate}")
    if k_cache.rotate:
        q = (q.float() @ k_cache._hadamard).to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if batch.device_only:  # graph-safe: bounds fixed per bucket, never the lengths themselves
        max_q, max_ctx = batch.max_query_len or tokens, batch.max_seq_len
    else:  # host-side lengths when the batch carries them (no device sync); else safe upper bounds
        q_lens = batch.query_lens_host or [tokens]
        max_q = max(q_lens)
        max_ctx = max(batch.seq_lens_host) if batch.seq_lens_host else None

    block_d = max(32, next_pow2(head_dim))
    # Rows per program: a whole verify step (<= 32 tokens x GROUP heads) in one tile up to 128 rows,
    # so its KV is read once; a prefill chunk's tiles each read the whole cached prefix, so they are
    # as tall too (half the KV traffic of 64-row tiles on a long prefix). Wider heads (Gemma 4's 512)
    # keep the tile's area, so its q tile and K/V stages fit shared memory.
    rows = rows or 128 * 128 // max(128, block_d)
    block_q = max(1, min(next_pow2(max_q), rows // next_pow2(group)))
    block_r = max(16, next_pow2(block_q * group))
    if block_kv is None:
        kv_bytes = k_cache.values.element_size()
        if v_cache.values.element_size() != kv_bytes:
            kv_bytes = 0  # mixed K / V storage: the narrow tiles
        block_kv = key_tile(block_r, block_d, kv_bytes, shared_memory(q.device))
    q_tiles = triton.cdiv(max_q, block_q)
    programs = num_seqs * kv_heads * q_tiles
    if num_splits is None:
        num_splits = 1
        if max_ctx is not None and programs < 2 * num_sms(q.device):
            want = triton.cdiv(4 * num_sms(q.device), programs)
            num_splits = max(1, min(want, triton.cdiv(max_ctx, 256), MAX_SPLITS))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))

    k_vals, k_scales = _storage(k_cache)
    v_vals, v_scales = _storage(v_cache)
    split = num_splits > 1 or rounded
    # A rotated V cache gives rotated outputs: written aside, un-rotated into `out` at the end.
    final = torch.empty(q.shape, dtype=q.dtype, device=q.device) if v_cache.rotate else out
    if split:
        part = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=q.device)
        o_arg, stride_ot, stride_oh, stride_os = part, part.stride(0), part.stride(1), part.stride(2)
        stride_lt, stride_lh = lse.stride(0), lse.stride(1)
    else:
        lse = q  # unused
        o_arg, stride_ot, stride_oh, stride_os = final, final.stride(0), final.stride(1), 0
        stride_lt = stride_lh = 0
    # 8 warps for the tall (or wide) tiles of verify/prefill keep the float32 accumulator and the q8_0/q4_0
    # unpacking out of local memory
    kwargs = {"num_warps": num_warps or (8 if block_r * block_d >= 64 * 128 and block_kv < 128 else 4)}
    if num_stages is not None or block_d > 256:
        kwargs["num_stages"] = num_stages or 2  # 3 stages of 512-wide K and V tiles overflow shared memory
    window = int(sliding_window) if sliding_window is not None else 0
    check_tree_window(batch, sliding_window)
    tree = batch.tree_mask
    _paged_attn_kernel[(num_seqs * kv_heads, q_tiles, num_splits)](
        q, k_vals, v_vals, k_scales, v_scales, o_arg, lse,
        batch.query_start_loc, batch.seq_lens, batch.block_tables, tree if tree is not None else batch.seq_lens,
        float(scale) * _LOG2E, window, num_splits,
        q.stride(0), q.stride(1), stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
        k_vals.stride(0), k_vals.stride(1), v_vals.stride(0), v_vals.stride(1),
        k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1),
        batch.block_tables.stride(0), batch.block_size,
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_Q=block_q, BLOCK_R=block_r, BLOCK_KV=block_kv,
        K_FMT=_KV_FORMATS[k_cache.cache_type], V_FMT=_KV_FORMATS[v_cache.cache_type],
        HAS_WINDOW=sliding_window is not None, SPLIT=split, DOT_IEEE=q.dtype == torch.float32,
        TREE=tree is not None, **kwargs, **pdl_launch(q.device))
    if split:
        _merge_splits_kernel[(tokens, heads)](
            part, lse, final, packed if rounded else part, num_splits, heads * head_dim // 32,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            final.stride(0), final.stride(1), packed.stride(0) if rounded else 0,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, next_pow2(num_splits)), ROUND=rounded, num_warps=4,
            **pdl_launch(q.device))
    if v_cache.rotate:
        out.copy_(final.float() @ v_cache._hadamard.T)
    return (out, packed) if rounded else out
