"""One key tile of the paged-attention kernel (triton_paged_attention): its K and V gathered through the
block table and dequantised (load_kv), and the online-softmax step that folds it into a query tile's
running max, sum and output (attend_tile). Tiles a query tile sees whole skip the masks (MASKED False)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv(v_ptr, s_ptr, slot, kmask, stride_slot, stride_s_slot, head_off, s_head_off,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
             FMT: tl.constexpr, TRANS: tl.constexpr):
    """A K or V tile of BLOCK_KV tokens (slots [BLOCK_KV], int64) in float32: [BLOCK_D, BLOCK_KV]
    when TRANS (keys, ready for q @ k^T) else [BLOCK_KV, BLOCK_D]. fp8 comes back unscaled (its
    scale is per token, applied to the scores / probabilities by the caller)."""
    if FMT == 0 or FMT == 1:
        d = tl.arange(0, BLOCK_D)
        if TRANS:
            ptrs = v_ptr + slot[None, :] * stride_slot + head_off + d[:, None]
            mask = kmask[None, :] & (d[:, None] < HEAD_DIM)
        else:
            ptrs = v_ptr + slot[:, None] * stride_slot + head_off + d[None, :]
            mask = kmask[:, None] & (d[None, :] < HEAD_DIM)
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        # q8_0 / q4_0: blocks of 32 values along head_dim, one fp16 scale each.
        NB: tl.constexpr = BLOCK_D // 32
        b = tl.arange(0, NB)
        bmask = b < HEAD_DIM // 32
        if FMT == 2:
            j = tl.arange(0, 32)
            if TRANS:  # [NB, 32, BLOCK_KV]
                ptrs = (v_ptr + slot[None, None, :] * stride_slot + head_off
                        + (b[:, None, None] * 32 + j[None, :, None]))
                mask = kmask[None, None, :] & bmask[:, None, None]
                sc = tl.load(s_ptr + slot[None, None, :] * stride_s_slot + s_head_off + b[:, None, None],
                             mask=mask, other=0.0).to(tl.float32)
            else:  # [BLOCK_KV, NB, 32]
                ptrs = (v_ptr + slot[:, None, None] * stride_slot + head_off
                        + (b[None, :, None] * 32 + j[None, None, :]))
                mask = kmask[:, None, None] & bmask[None, :, None]
                sc = tl.load(s_ptr + slot[:, None, None] * stride_s_slot + s_head_off + b[None, :, None],
                             mask=mask, other=0.0).to(tl.float32)
            q = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
            x = q * sc
            if TRANS:
                x = tl.reshape(x, [BLOCK_D, BLOCK_KV])
            else:
                x = tl.reshape(x, [BLOCK_KV, BLOCK_D])
        else:
            # q4_0: 16 bytes per block; byte j holds value j (low nibble) and j + 16 (high).
            j = tl.arange(0, 16)
            if TRANS:  # [NB, 16, BLOCK_KV]
                ptrs = (v_ptr + slot[None, None, :] * stride_slot + head_off
                        + (b[:, None, None] * 16 + j[None, :, None]))
                mask = kmask[None, None, :] & bmask[:, None, None]
                sc = tl.load(s_ptr + slot[None, None, :] * stride_s_slot + s_head_off + b[:, None, None],
                             mask=mask, other=0.0).to(tl.float32)
            else:  # [BLOCK_KV, NB, 16]
                ptrs = (v_ptr + slot[:, None, None] * stride_slot + head_off
                        + (b[None, :, None] * 16 + j[None, None, :]))
                mask = kmask[:, None, None] & bmask[None, :, None]
                sc = tl.load(s_ptr + slot[:, None, None] * stride_s_slot + s_head_off + b[None, :, None],
                             mask=mask, other=0.0).to(tl.float32)
            byte = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
            lo = ((byte & 15) - 8).to(tl.float32) * sc
            hi = ((byte >> 4) - 8).to(tl.float32) * sc
            x = tl.join(lo, hi)  # [..., 16, ..., 2]: move the new axis in front of the 16
            if TRANS:
                x = tl.reshape(tl.permute(x, (0, 3, 1, 2)), [BLOCK_D, BLOCK_KV])
            else:
                x = tl.reshape(tl.permute(x, (0, 1, 3, 2)), [BLOCK_KV, BLOCK_D])
    return x


@triton.jit
def attend_tile(q, m_i, l_i, acc, start, s_hi, q_pos, win_pos, tree_lo, tree_hi, ctx0, window, qk_scale, bt_row,
                block_size, k_ptr, ks_ptr, stride_k_slot, stride_ks_slot, k_head, ks_head,
                v_ptr, vs_ptr, stride_v_slot, stride_vs_slot, v_head, vs_head,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
                K_FMT: tl.constexpr, V_FMT: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_IEEE: tl.constexpr,
                TREE: tl.constexpr, MASKED: tl.constexpr):
    """Keys start..start + BLOCK_KV - 1 (those below s_hi) into (m_i, l_i, acc) of the query rows q (base-2
    scores). MASKED: each key's visibility (causal at q_pos, the window from win_pos, this step's tree bits);
    else every key of the tile is visible to every row (the caller's interior tiles)."""
    kpos = start + tl.arange(0, BLOCK_KV)
    if MASKED:
        kmask = kpos < s_hi
    else:
        kmask = tl.full([BLOCK_KV], 1, tl.int1)
    page = tl.load(bt_row + kpos // block_size, mask=kmask, other=0)
    slot = page.to(tl.int64) * block_size + (kpos % block_size)

    kt = load_kv(k_ptr, ks_ptr, slot, kmask, stride_k_slot, stride_ks_slot, k_head, ks_head,
                 HEAD_DIM, BLOCK_D, BLOCK_KV, K_FMT, True)
    if DOT_IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt.to(q.dtype))
    if K_FMT == 1:
        s *= tl.load(ks_ptr + slot * stride_ks_slot + ks_head, mask=kmask, other=0.0)[None, :]
    s *= qk_scale
    if MASKED:
        visible = kmask[None, :] & (kpos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= (win_pos[:, None] - kpos[None, :]) < window
        if TREE:
            if start + BLOCK_KV > ctx0:  # the tile reaches this step's row
                # bit min(rel, 63) of the row's mask, tested in 32-bit halves (cheaper than int64 shifts)
                rel = tl.minimum(kpos - ctx0, 63)
                word = tl.where(rel[None, :] < 32, tree_lo[:, None], tree_hi[:, None])
                bit = (word >> (rel[None, :] & 31)) & 1
                visible &= (rel[None, :] < 0) | (bit != 0)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc *= alpha[:, None]

    v = load_kv(v_ptr, vs_ptr, slot, kmask, stride_v_slot, stride_vs_slot, v_head, vs_head,
                HEAD_DIM, BLOCK_D, BLOCK_KV, V_FMT, False)
    if V_FMT == 1:
        p *= tl.load(vs_ptr + slot * stride_vs_slot + vs_head, mask=kmask, other=0.0)[None, :]
    if DOT_IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return m_new, l_i, acc
