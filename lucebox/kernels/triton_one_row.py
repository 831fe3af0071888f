"""The one-row (decode) GEMV machinery shared by the quantised kernels (Triton).

A one-row GEMV program owns BLOCK_N weight rows and a range of K's units (`one_row_program`), reads
fp16 fields through byte pointers (`f16`) and stores its row sums, or its split's float32 partial,
with `store_one_row`; on the host, `one_row_gemv` chooses the split of K (enough programs to fill
the GPU) and launches such a kernel, and `reduce_splits` sums the split-K partials in one small
kernel (`_sum_splits_kernel`) that also adds the bias and casts, in a fixed order so results stay
deterministic. The float kernel (triton_quant_matmul), the split-row GEMVs (triton_split_rows) and
the int8 kernels (triton_dp4a, triton_quant_int8) share these.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import num_sms, pdl_launch
from .triton_pdl import wait_for_previous_kernel

# ----------------------------------------------------------------------------- device helpers

@triton.jit
def f16(p):
    """fp16 at byte pointer(s) p (2-byte aligned) -> float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N: tl.constexpr):
    """A one-row GEMV program's rows rn [BLOCK_N], their byte pointers (rows past N re-read row
    N-1, so weight loads need no mask; dropped at the store) and its units of K, [u0, u1)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * row_bytes
    u0 = tl.program_id(1) * units_per_prog
    return rn, row, u0, tl.minimum(u0 + units_per_prog, n_units)


@triton.jit
def store_one_row(res, rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS: tl.constexpr):
    """Store a one-row program's sums res [BLOCK_N] (float32) for rows rn: the output (+ bias) when
    K is whole, otherwise this split's partial (summed by reduce_splits)."""
    n_mask = rn < N
    if HAS_BIAS:
        res += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + tl.program_id(1) * stride_os + rn, res.to(o_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, o_ptr, add_ptr, gate_ptr, gate_stride, scale, total, N,
                       SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr = False,
                       GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    """out = sum over the SPLITS float32 partials [SPLITS, total] (+ bias per column), cast: one
    launch where torch needs a reduction, a bias add and a copy (each a few microseconds at decode
    sizes, for every quantised GEMV). ADD (a MoE's shared expert): scale * sum + add [M, N], with
    GATED each row's add times sigmoid(gate[row])."""
    wait_for_previous_kernel(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * total + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        value = tl.load(add_ptr + i, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            gate = tl.load(gate_ptr + (i // N) * gate_stride, mask=mask, other=0.0).to(tl.float32)
            value = value / (1.0 + tl.exp(-gate))
        acc = acc * scale + value
    tl.store(o_ptr + i, acc.to(o_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side

def reduce_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  shared=None) -> None:
    """out [M, N] = the float32 split-K partials [splits, M, N] summed (+ bias), cast; shared (a
    kernels.moe.Shared, value contiguous): scale * that sum + (sigmoid(gate) *) value, in float32
    before the cast."""
    total, block = out.numel(), 256
    value = shared.value if shared is not None else partials
    gate = shared.gate if shared is not None and shared.gate is not None else partials
    _sum_splits_kernel[(triton.cdiv(total, block),)](
        partials, bias if bias is not None else partials, out, value, gate, gate.stride(0),
        float(shared.scale) if shared is not None else 1.0, total, out.shape[1], SPLITS=partials.shape[0],
        HAS_BIAS=bias is not None, BLOCK=block, ADD=shared is not None,
        GATED=shared is not None and shared.gate is not None, **pdl_launch(out.device))


def one_row_gemv(kernel, x: torch.Tensor, weights: torch.Tensor, in_features: int, unit: int,
                 bias: torch.Tensor | None, what: str, *, block_n: int, split_k: int | None,
                 num_warps: int, waves: int = 8, min_units: int = 2, max_units: int | None = None,
                 stages: int = 1, operand: torch.Tensor | None = None, unroll: int = 1) -> torch.Tensor:
    """x [1, K] @ W.T (+ bias) through a one-row GEMV `kernel` over rows of `unit`-value units, whose
    arguments are (x, w, bias, partials or out, N, row_bytes, n_units, units_per_prog, stride_os,
    BLOCK_N, HAS_BIAS, STAGES): the K range split over programs when there are fewer than `waves`
    programs an SM, each keeping at least `min_units` units (and, given max_units, at most that
    many), the float32 partials summed by reduce_splits. stages > 1: the loop over units software-
    pipelined (the next units' weights copied to shared memory while one is multiplied; an option
    to measure); unroll > 1: that many units an iteration (kernels with an UNROLL constexpr). `operand`: what the kernel reads as x, when not x
    itself (e.g. x quantised); x still sets the output's dtype. `what` names the layout in errors."""
    if in_features % unit:
        raise ValueError(f"{what} rows need in_features a multiple of {unit}, got {in_features}")
    x2 = x.reshape(-1, in_features)
    if x2.shape[0] != 1:
        raise ValueError(f"the {what} GEMV multiplies one row, got {x2.shape[0]}")
    n, n_units = weights.shape[0], in_features // unit
    programs_n = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = max(1, min(waves * num_sms(x.device) // programs_n, n_units // min_units))
        if max_units:
            split_k = max(split_k, triton.cdiv(n_units, max_units))
    per = triton.cdiv(n_units, max(1, min(split_k, n_units)))
    split_k = triton.cdiv(n_units, per)
    out = x2.new_empty(1, n)
    target = torch.empty(split_k, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    has_bias = bias is not None and split_k == 1
    kernel[(programs_n, split_k)](
        x2.contiguous() if operand is None else operand, weights, bias if has_bias else x2, target,
        n, weights.shape[1], n_units, per, n,
        BLOCK_N=block_n, HAS_BIAS=has_bias, STAGES=stages, num_warps=num_warps, **pdl_launch(x.device),
        **({"UNROLL": unroll} if unroll > 1 else {}))
    if split_k > 1:
        reduce_splits(target.view(split_k, 1, n), bias, out)
    return out.reshape(*x.shape[:-1], n)
