"""Triton RMSNorm, alone or fused with the residual add that precedes it (the references and the
dispatching `rms_norm` / `rms_norm_residual` are in kernels/norm.py, re-exported here).

The fused form reads x and residual once and writes the sum and the normalised row in the same
pass (one kernel instead of three memory passes). Arithmetic follows kernels/norm.py: the sum is
rounded to its dtype, the row is normalised in float32, rounded to that dtype, then multiplied by
the weight in the promoted dtype.
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, pdl_launch
from .norm import rms_norm, rms_norm_reference, rms_norm_residual, rms_norm_residual_reference

__all__ = ["rms_norm", "rms_norm_residual", "rms_norm_reference", "rms_norm_residual_reference",
           "rms_norm_triton", "rms_norm_residual_triton", "rms_norm_rounded_triton", "rms_norm_add_triton",
           "rms_norm_many_triton", "rms_norm_pair_add_triton"]


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use: importing this module must not import Triton,
    whose interpreter mode is fixed at import (tests set TRITON_INTERPRET=1 first)."""
    global triton, tl, wait_for_previous_kernel, store_rounded
    import triton
    import triton.language as tl

    from .triton_dp4a import store_rounded
    from .triton_pdl import wait_for_previous_kernel

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, q_ptr, g_ptr, n_rows, n_cols,
                         stride_x, stride_r, stride_o, stride_s, stride_q, stride_w, plane_o, eps,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr,
                         ROUND: tl.constexpr = False, ADD_AFTER: tl.constexpr = False, SCALE: tl.constexpr = False,
                         OUTS: tl.constexpr = 1, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        c_ok = cols < n_cols
        mask = (rows < n_rows)[:, None] & c_ok[None, :]
        rows = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + rows * stride_r + cols[None, :], mask=mask, other=0.0)
            total = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + rows * stride_s + cols[None, :], total, mask=mask)
            h = total.to(tl.float32)
            row_ty = s_ptr.dtype.element_ty
        else:
            h = x.to(tl.float32)
            row_ty = x_ptr.dtype.element_ty
        inv = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        y = (h * inv[:, None]).to(row_ty).to(tl.float32)
        for i in tl.static_range(OUTS):  # one normalised row, OUTS weights (plane i of the output)
            w = tl.load(w_ptr + i * stride_w + cols, mask=c_ok, other=0.0).to(tl.float32)
            out = (w[None, :] * y).to(o_ptr.dtype.element_ty)
            if ADD_AFTER:  # r + the normalised row (Gemma's post-norms), rounded as torch's add
                r = tl.load(r_ptr + rows * stride_r + cols[None, :], mask=mask, other=0.0)
                out = (out.to(tl.float32) + r.to(tl.float32)).to(o_ptr.dtype.element_ty)
            if SCALE:  # times a one-value tensor (Gemma's layer scalar), rounded as torch's mul
                out = (out.to(tl.float32) * tl.load(g_ptr).to(tl.float32)).to(o_ptr.dtype.element_ty)
            tl.store(o_ptr + i * plane_o + rows * stride_o + cols[None, :], out, mask=mask)
            if ROUND and i == 0:  # the first output's row rounded to int8 too (ROWS == 1), for int8 products
                b = tl.arange(0, BLOCK_N // 32)
                store_rounded(q_ptr + tl.program_id(0) * stride_q,
                              tl.reshape(out.to(tl.float32), [BLOCK_N // 32, 32]), b, b < n_cols // 32, n_cols // 32)

    return _rms_norm_kernel


@functools.cache
def _pair_kernel():
    """stream + rms_norm_o(rms_norm_a(a) + rms_norm_b(b)), [* scale]: a row a program, each step
    rounded to the row's dtype as the torch ops are (Gemma 4's MoE FFN output)."""
    global _normed  # a helper the kernel calls: Triton resolves it among the module's globals
    _kernel()  # imports triton, tl and wait_for_previous_kernel

    @triton.jit
    def _normed(v, w_ptr, cols, ok, n_cols, eps):
        ty = w_ptr.dtype.element_ty
        y = (v * tl.rsqrt(tl.sum(v * v, axis=0) / n_cols + eps)).to(ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        return (w * y).to(ty).to(tl.float32)

    @triton.jit
    def _rms_norm_pair_add_kernel(a_ptr, b_ptr, s_ptr, w_ptr, g_ptr, o_ptr, n_cols, stride_a, stride_b,
                                  stride_s, stride_w, stride_o, eps, BLOCK_N: tl.constexpr,
                                  SCALE: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        ok = cols < n_cols
        ty = o_ptr.dtype.element_ty
        a = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
        h = (_normed(a, w_ptr, cols, ok, n_cols, eps) + _normed(b, w_ptr + stride_w, cols, ok, n_cols, eps))
        h = h.to(ty).to(tl.float32)
        stream = tl.load(s_ptr + row * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
        out = (stream + _normed(h, w_ptr + 2 * stride_w, cols, ok, n_cols, eps)).to(ty)
        if SCALE:
            out = (out.to(tl.float32) * tl.load(g_ptr).to(tl.float32)).to(ty)
        tl.store(o_ptr + row * stride_o + cols, out, mask=ok)

    return _rms_norm_pair_add_kernel


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            rounded: bool = False, addend: torch.Tensor | None = None, scale: torch.Tensor | None = None):
    """weight [n] or [outputs, n]: several weights give one output plane each ([outputs, rows, n])."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    rows = x2.shape[0]
    weights = weight.reshape(-1, n)
    row_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, row_dtype)
    for other in (addend, scale):
        if other is not None:
            out_dtype = torch.promote_types(out_dtype, other.dtype)
    out = torch.empty(weights.shape[0], rows, n, dtype=out_dtype, device=x.device)
    total = torch.empty(rows, n, dtype=row_dtype, device=x.device) if residual is not None else None
    packed = None
    if rounded:
        if n % 256:
            raise ValueError(f"rms_norm: rows rounded to int8 need a multiple of 256 values, got {n}")
        from .triton_dp4a import rounded_rows_like
        packed = rounded_rows_like(out[0])
    r2 = _rows(residual, n) if residual is not None else _rows(addend, n) if addend is not None else x2
    if rows:
        block_n = next_pow2(n)
        per_prog = 1 if rounded else min(next_pow2(rows), max(1, 4096 // block_n))  # small rows (q/k norm): batch them
        warps = min(16, max(1, per_prog * block_n // 512))
        s = total if total is not None else out[0]
        q = packed if packed is not None else out[0]
        _kernel()[(-(-rows // per_prog),)](
            x2, r2, weights, out, s, q, scale if scale is not None else weights, rows, n, x2.stride(0), r2.stride(0),
            out.stride(1), s.stride(0), q.stride(0), weights.stride(0), out.stride(0), float(eps), BLOCK_N=block_n,
            ROWS=per_prog, HAS_RES=residual is not None, ROUND=rounded, ADD_AFTER=addend is not None,
            SCALE=scale is not None, OUTS=weights.shape[0], num_warps=warps, **pdl_launch(out.device))
    shape = x.shape[:-1] + (n,)
    out = out.reshape(weights.shape[:1] + shape) if weight.dim() == 2 else out.reshape(shape)
    return out, (total.reshape(shape) if total is not None else None), packed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def rms_norm_add_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, addend: torch.Tensor,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """(addend + rms_norm(x)) [* scale] in one launch (kernels/norm.rms_norm_add)."""
    if addend.shape != x.shape:
        raise ValueError(f"rms_norm_add: x {tuple(x.shape)} and addend {tuple(addend.shape)} differ")
    _check_scale(scale)
    return _launch(x, None, weight, eps, addend=addend, scale=scale)[0]


def rms_norm_many_triton(x: torch.Tensor, weights: torch.Tensor, eps: float, rounded: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([outputs, *x.shape] = rms_norm(x, weights[i]) each, the first output's rows rounded to int8
    or None) in one launch (kernels/norm.rms_norm_many)."""
    if weights.dim() != 2 or weights.shape[1] != x.shape[-1]:
        raise ValueError(f"rms_norm_many: weights {tuple(weights.shape)} must be [outputs, {x.shape[-1]}]")
    out, _, packed = _launch(x, None, weights, eps, rounded=rounded)
    return out, packed


def rms_norm_pair_add_triton(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor, eps: float,
                             stream: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(stream + rms_norm(rms_norm(a, weights[0]) + rms_norm(b, weights[1]), weights[2])) [* scale] in
    one launch (kernels/norm.rms_norm_pair_add); every tensor in one dtype."""
    n = stream.shape[-1]
    if a.shape != stream.shape or b.shape != stream.shape or tuple(weights.shape) != (3, n):
        raise ValueError(f"rms_norm_pair_add: a {tuple(a.shape)}, b {tuple(b.shape)} and stream "
                         f"{tuple(stream.shape)} must match, weights {tuple(weights.shape)} be [3, {n}]")
    dtypes = {t.dtype for t in (a, b, stream, weights) + ((scale,) if scale is not None else ())}
    if len(dtypes) != 1:
        raise ValueError(f"rms_norm_pair_add: one dtype for all tensors, got {sorted(map(str, dtypes))}")
    _check_scale(scale)
    a2, b2, s2 = _rows(a, n), _rows(b, n), _rows(stream, n)
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    out = torch.empty_like(s2)
    if s2.shape[0]:
        block_n = next_pow2(n)
        kernel = _pair_kernel()
        kernel[(s2.shape[0],)](
            a2, b2, s2, weights, scale if scale is not None else weights, out, n, a2.stride(0), b2.stride(0),
            s2.stride(0), weights.stride(0), out.stride(0), float(eps), BLOCK_N=block_n, SCALE=scale is not None,
            num_warps=min(16, max(1, block_n // 512)), **pdl_launch(out.device))
    return out.reshape(stream.shape)


def rms_norm_residual_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_residual(x, residual)
    return _launch(x, residual, weight, eps)[:2]


def rms_norm_rounded_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(rms_norm(x [+ residual]), x + residual or None, the output's rows rounded to int8 as
    triton_dp4a.quantize_rows packs them) in one launch."""
    if residual is not None:
        _check_residual(x, residual)
    return _launch(x, residual, weight, eps, rounded=True)


def _check_scale(scale: torch.Tensor | None) -> None:
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"rms_norm_add: the scale must hold one value, got shape {tuple(scale.shape)}")


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape:
        raise ValueError(f"rms_norm_residual: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
