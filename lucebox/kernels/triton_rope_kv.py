"""Triton: RoPE on q and k fused with the paged K/V cache write (reference: kernels/rope.py).

One program per token rotates all of its q heads into a new tensor and all of its k heads
straight into the cache slot `slot_mapping[t]`, and copies its v heads into the V cache: one
launch instead of the reference's dozen-odd elementwise kernels and two scatter writes.

Rounding follows the reference to the bit: cos/sin come in q's dtype, each product is rounded
to that dtype before the sum (as torch's elementwise ops round), and compilation runs without
FMA contraction, which would skip that intermediate rounding. A cache stored in another plain
dtype receives the rounded value converted, as `PagedKVCache.write` does.

Only plain storage (f32 / f16 / bf16, no Hadamard rotation) is written in place. For a quantised
or rotated cache the kernel writes rotated k to a scratch tensor and `PagedKVCache.write`
quantises it (K and V are decided separately: their cache types may differ).

Given `qk_norm` (Qwen3's RMSNorm over each head of q and k before RoPE), each head is normalised
in the same program before it is rotated: no separate norm launches, and no copy of the q/k
column slices of a fused qkv projection. Rounding follows kernels/norm.py's arithmetic (the
rsqrt and the sum order may differ from torch's in the last bit, as in triton_norm).

Given `v_norm_eps` (Gemma 4's RMSNorm without a weight over each head of v), v is normalised in the
same program before it is stored.

CUDA-graph safe: the grid is the token count, slots are read on the device, nothing syncs.
A negative slot (a padding token of a captured graph) is skipped rather than written.
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, pdl_launch
from .norm import unit_rms_norm
from .triton_norm import rms_norm_triton


def writes_in_place(cache) -> bool:
    """Whether the kernel can store into this PagedKVCache directly (no quantiser, no rotation)."""
    return cache.scales is None and not cache.rotate


@functools.cache
def _kernel():
    """Defined on first use: importing this module must not import Triton (see triton_norm).
    Module globals, not closure variables: jit functions resolve the names they call there."""
    global triton, tl, _rotate_heads, wait_for_previous_kernel
    import triton
    import triton.language as tl

    from .triton_pdl import wait_for_previous_kernel

    @triton.jit
    def _rotate_heads(src, dst, heads, half, rest, src_head_stride, dst_head_stride, cos_lo, cos_hi, sin_lo, sin_hi,
                      row, norm_w, eps, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                      NORM: tl.constexpr):
        # dims [0, 2 * half) rotate; the `rest` dims after them (partial rotary) pass through
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_HALF)
        # row < 0: a padding slot, store nothing. Broadcast arithmetically: Triton's interpreter
        # rejects a mask made by and-ing a block with a scalar boolean.
        head_ok = (h < heads)[:, None] & (h[:, None] * 0 + row >= 0)
        mask = head_ok & (d < half)[None, :]
        src_at = src + h[:, None] * src_head_stride + d[None, :]
        lo = tl.load(src_at, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(src_at + half, mask=mask, other=0.0).to(tl.float32)
        ty = src.dtype.element_ty
        dst_ty = dst.dtype.element_ty
        dst_at = dst + h[:, None] * dst_head_stride + d[None, :]
        if BLOCK_REST > 0:
            r = tl.arange(0, BLOCK_REST)
            rest_mask = head_ok & (r < rest)[None, :]
            rest_at = h[:, None] * src_head_stride + 2 * half + r[None, :]
            kept = tl.load(src + rest_at, mask=rest_mask, other=0.0).to(tl.float32)
        if NORM:  # RMSNorm over each whole head first (kernels/norm.py's arithmetic; masked lanes are 0)
            sum_sq = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
            if BLOCK_REST > 0:
                sum_sq += tl.sum(kept * kept, axis=1)
            inv = tl.rsqrt(sum_sq / (2 * half + rest) + eps)[:, None]
            w_lo = tl.load(norm_w + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
            w_hi = tl.load(norm_w + half + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
            lo = (w_lo * (lo * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
            hi = (w_hi * (hi * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
            if BLOCK_REST > 0:
                w_rest = tl.load(norm_w + 2 * half + r, mask=r < rest, other=0.0).to(tl.float32)[None, :]
                kept = (w_rest * (kept * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        if BLOCK_REST > 0:
            tl.store(dst + h[:, None] * dst_head_stride + 2 * half + r[None, :], kept.to(ty).to(dst_ty),
                     mask=rest_mask)
        # Reference: x * cos + cat(-x_hi, x_lo) * sin, every op rounded to the input dtype.
        out_lo = ((lo * cos_lo[None, :]).to(ty).to(tl.float32) - (hi * sin_lo[None, :]).to(ty).to(tl.float32)).to(ty)
        out_hi = ((hi * cos_hi[None, :]).to(ty).to(tl.float32) + (lo * sin_hi[None, :]).to(ty).to(tl.float32)).to(ty)
        tl.store(dst_at, out_lo.to(dst_ty), mask=mask)
        tl.store(dst_at + half, out_hi.to(dst_ty), mask=mask)

    @triton.jit
    def _rope_kv_kernel(q, k, v, cos, sin, slots, q_out, k_dst, v_dst, q_norm_w, k_norm_w, eps, v_eps,
                        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, scos_t, ssin_t,
                        sqo_t, sqo_h, skd_t, skd_h, svd_t, svd_h, num_q_heads, num_kv_heads, half, rest,
                        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                        BLOCK_REST: tl.constexpr,
                        BLOCK_D: tl.constexpr, K_TO_CACHE: tl.constexpr, V_TO_CACHE: tl.constexpr,
                        NORM: tl.constexpr, V_NORM: tl.constexpr = False, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_HALF)
        d_ok = d < half
        cos_lo = tl.load(cos + t * scos_t + d, mask=d_ok, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos + t * scos_t + half + d, mask=d_ok, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin + t * ssin_t + d, mask=d_ok, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin + t * ssin_t + half + d, mask=d_ok, other=0.0).to(tl.float32)
        slot = tl.load(slots + t).to(tl.int64)
        _rotate_heads(q + t * sq_t, q_out + t * sqo_t, num_q_heads, half, rest, sq_h, sqo_h,
                      cos_lo, cos_hi, sin_lo, sin_hi, t, q_norm_w, eps, BLOCK_HQ, BLOCK_HALF, BLOCK_REST, NORM)
        if K_TO_CACHE:
            _rotate_heads(k + t * sk_t, k_dst + slot * skd_t, num_kv_heads, half, rest, sk_h, skd_h,
                          cos_lo, cos_hi, sin_lo, sin_hi, slot, k_norm_w, eps, BLOCK_HK, BLOCK_HALF, BLOCK_REST,
                          NORM)
        else:
            _rotate_heads(k + t * sk_t, k_dst + t * skd_t, num_kv_heads, half, rest, sk_h, skd_h,
                          cos_lo, cos_hi, sin_lo, sin_hi, t, k_norm_w, eps, BLOCK_HK, BLOCK_HALF, BLOCK_REST,
                          NORM)
        if V_TO_CACHE:
            h = tl.arange(0, BLOCK_HK)
            dd = tl.arange(0, BLOCK_D)
            mask = (h < num_kv_heads)[:, None] & (dd < 2 * half + rest)[None, :] & (h[:, None] * 0 + slot >= 0)
            x = tl.load(v + t * sv_t + h[:, None] * sv_h + dd[None, :], mask=mask, other=0.0)
            if V_NORM:  # kernels/norm.unit_rms_norm per head, in float32
                xf = x.to(tl.float32)
                inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / (2 * half + rest) + v_eps)[:, None]
                x = (xf * inv).to(v.dtype.element_ty)
            tl.store(v_dst + slot * svd_t + h[:, None] * svd_h + dd[None, :],
                     x.to(v_dst.dtype.element_ty), mask=mask)

    return _rope_kv_kernel


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache, v_cache, slot_mapping: torch.Tensor, qk_norm=None,
                      v_norm_eps: float | None = None) -> torch.Tensor:
    """Same contract as kernels/rope.rope_and_write_kv_reference: returns rotated q [T, Hq, D]."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, rotary = k.shape[1], cos.shape[-1]
    if (rotary % 2 or rotary > head_dim or k.shape != (tokens, num_kv_heads, head_dim) or v.shape != k.shape
            or sin.shape != cos.shape):
        raise ValueError(f"rope_and_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos {tuple(cos.shape)} do not describe the same tokens and an even rotary width "
                         "within the head")
    norm_w = (q, k)  # placeholders: not read without NORM
    eps = 0.0
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        if q_w.dtype == k_w.dtype == q.dtype == k.dtype:  # the norm keeps the dtype: fold it in
            norm_w = (_unit_last(q_w), _unit_last(k_w))
        else:  # the norm promotes (reference semantics): normalise first, rotate in the new dtype
            q, k = rms_norm_triton(q, q_w, eps), rms_norm_triton(k, k_w, eps)
            qk_norm = None
    q, k, v, cos, sin = (_unit_last(t) for t in (q, k, v, cos, sin))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_to_cache, v_to_cache = writes_in_place(k_cache), writes_in_place(v_cache)
    k_dst = (k_cache.values.view(-1, num_kv_heads, head_dim) if k_to_cache
             else torch.empty(k.shape, dtype=k.dtype, device=k.device))
    v_dst = v_cache.values.view(-1, num_kv_heads, head_dim) if v_to_cache else v  # unused when not in place
    if tokens:
        block_hq, block_hk, block_half = next_pow2(num_q_heads), next_pow2(num_kv_heads), next_pow2(rotary // 2)
        rest = head_dim - rotary
        warps = min(8, max(1, block_hq * next_pow2(head_dim) // 512))
        _kernel()[(tokens,)](
            q, k, v, cos, sin, slot_mapping, q_out, k_dst, v_dst, *norm_w, float(eps), float(v_norm_eps or 0.0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), q_out.stride(0), q_out.stride(1), k_dst.stride(0), k_dst.stride(1),
            v_dst.stride(0), v_dst.stride(1), num_q_heads, num_kv_heads, rotary // 2, rest,
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BLOCK_REST=next_pow2(rest) if rest else 0,
            BLOCK_D=next_pow2(head_dim),
            K_TO_CACHE=k_to_cache, V_TO_CACHE=v_to_cache, NORM=qk_norm is not None,
            V_NORM=v_norm_eps is not None, num_warps=warps,
            enable_fp_fusion=False, **pdl_launch(q.device))
    if not k_to_cache:
        k_cache.write(k_dst, slot_mapping)
    if not v_to_cache:  # a quantised V cache quantises the normalised rows itself
        v_cache.write(v if v_norm_eps is None else unit_rms_norm(v, v_norm_eps), slot_mapping)
    return q_out
