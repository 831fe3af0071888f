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
           "rms_norm_triton", "rms_norm_residual_triton", "rms_norm_rounded_triton", "rms_norm_add_triton"]


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
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, q_ptr, n_rows, n_cols,
                         stride_x, stride_r, stride_o, stride_s, stride_q, eps,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr,
                         ROUND: tl.constexpr = False, ADD_AFTER: tl.constexpr = False, PDL: tl.constexpr = False):
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
        w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
        out = (w[None, :] * y).to(o_ptr.dtype.element_ty)
        if ADD_AFTER:  # r + the normalised row (Gemma's post-norms), rounded as torch's add
            r = tl.load(r_ptr + rows * stride_r + cols[None, :], mask=mask, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + rows * stride_o + cols[None, :], out, mask=mask)
        if ROUND:  # the output row rounded to int8 too (ROWS == 1), for products on int8 activations
            b = tl.arange(0, BLOCK_N // 32)
            store_rounded(q_ptr + tl.program_id(0) * stride_q, tl.reshape(out.to(tl.float32), [BLOCK_N // 32, 32]),
                           b, b < n_cols // 32, n_cols // 32)

    return _rms_norm_kernel


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            rounded: bool = False, addend: torch.Tensor | None = None):
    n = x.shape[-1]
    x2 = _rows(x, n)
    rows = x2.shape[0]
    row_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, row_dtype)
    if addend is not None:
        out_dtype = torch.promote_types(out_dtype, addend.dtype)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    total = torch.empty(rows, n, dtype=row_dtype, device=x.device) if residual is not None else None
    packed = None
    if rounded:
        if n % 256:
            raise ValueError(f"rms_norm: rows rounded to int8 need a multiple of 256 values, got {n}")
        from .triton_dp4a import rounded_rows_like
        packed = rounded_rows_like(out)
    r2 = _rows(residual, n) if residual is not None else _rows(addend, n) if addend is not None else x2
    if rows:
        block_n = next_pow2(n)
        per_prog = 1 if rounded else min(next_pow2(rows), max(1, 4096 // block_n))  # small rows (q/k norm): batch them
        warps = min(16, max(1, per_prog * block_n // 512))
        s = total if total is not None else out
        q = packed if packed is not None else out
        _kernel()[(-(-rows // per_prog),)](
            x2, r2, weight, out, s, q, rows, n, x2.stride(0), r2.stride(0), out.stride(0), s.stride(0),
            q.stride(0), float(eps), BLOCK_N=block_n, ROWS=per_prog, HAS_RES=residual is not None, ROUND=rounded,
            ADD_AFTER=addend is not None, num_warps=warps, **pdl_launch(out.device))
    shape = x.shape[:-1] + (n,)
    return out.reshape(shape), (total.reshape(shape) if total is not None else None), packed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def rms_norm_add_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, addend: torch.Tensor) -> torch.Tensor:
    """addend + rms_norm(x) in one launch (kernels/norm.rms_norm_add)."""
    if addend.shape != x.shape:
        raise ValueError(f"rms_norm_add: x {tuple(x.shape)} and addend {tuple(addend.shape)} differ")
    return _launch(x, None, weight, eps, addend=addend)[0]


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


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape:
        raise ValueError(f"rms_norm_residual: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
