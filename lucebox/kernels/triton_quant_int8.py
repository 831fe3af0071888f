"""Quantised products on int8 activations (Triton, NVIDIA): Q4_K rows in ggml's layout and Q8_0 /
Q6_K rows in the split layout (triton_split_rows), for decode (one row: the dp4a GEMVs of
triton_dp4a) and verify (2..64 rows: here, on integer tensor cores).

As in llama.cpp, each activation row is rounded to int8 per 32 values, x ~ xd * qx (one launch,
triton_dp4a.quantize_rows), and each weight block's integer values meet the int8 activations in
integer dot products, scaled once per block and row: for a Q4_K sub-block j of 32 values
    x' . w = d * sc_j * xd_j * sum(q * qx) - dmin * m_j * xd_j * sum(qx),
for a Q8_0 block d * xd * sum(q * qx), for a Q6_K 16-value group d * sc * xd * sum((q - 32) * qx).
The result is the float product of the rounded activations with the exact weights (the float
kernels' verify tiles round the dequantised weights to bf16 instead). A row's integer sums are the
same whether it is decoded alone or verified with others (every row is rounded alike). Which
products take this path is routing.QUANT_ROUTES' choice, by speed.

Verify's kernel: a program owns BLOCK_N weight rows and a range of 256-value units of K; per
32-value block one tl.dot of the block's int8 weights [BLOCK_N, 32] (Q4_K nibbles and Q6_K 6-bit
values unpacked in registers, Q6_K's -32 folded in) with the rows' int8 activations [32, BLOCK_M]
into int32, then the block's float scaling into a float32 accumulator. Q6_K's two 16-value scale
groups in a block take two dots, each against activations with the other group zeroed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from . import triton_dp4a
from .dispatch import next_pow2, num_sms, pdl_launch
from .routing import INT8, MAX_FUSED_M, QUANT_ROUTES, RUNS_ONLY_TYPES
from .triton_dp4a import SUPER, quantize_rows, scales_mins
from .triton_one_row import f16, one_row_program, reduce_splits
from .triton_pdl import wait_for_previous_kernel


@triton.jit
def _rows_program(x_ptr, w_ptr, M, N, row_bytes, n_units, units_per_prog, stride_xm,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """A verify program's weight rows (as one_row_program: rn, their byte pointers, units [u0, u1)),
    its activation rows rm (m_ok: < M), their quantize_rows rows x_row (int8 values, then the
    float32 scales xd, then xd * sum(qx)) and the scales' pointers xd."""
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    x_row = x_ptr + rm * stride_xm
    return rn, row, u0, u1, rm, rm < M, x_row, (x_row + n_units * 256).to(tl.pointer_type(tl.float32))


@triton.jit
def _x_block(x_row, m_ok, v0):
    """The rows' int8 activations v0 .. v0 + 31: [32, BLOCK_M] (rows past M read as 0)."""
    i = tl.arange(0, 32)
    return tl.load((x_row[None, :] + v0 + i[:, None]).to(tl.pointer_type(tl.int8)), mask=m_ok[None, :], other=0)


@triton.jit
def _store_rows(acc, rn, N, rm, M, o_ptr, b_ptr, stride_om, stride_os, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (float32) -> output rows rm, features rn (+ bias), or a split's partial."""
    n_mask = rn < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    ptrs = o_ptr + tl.program_id(1) * stride_os + rm[None, :] * stride_om + rn[:, None]
    tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=n_mask[:, None] & (rm[None, :] < M))


@triton.jit
def _q4_k_int8_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, row_bytes, n_units, units_per_prog, stride_xm,
                      stride_om, stride_os, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1, rm, m_ok, x_row, xd = _rows_program(x_ptr, w_ptr, M, N, row_bytes, n_units, units_per_prog,
                                                         stride_xm, BLOCK_N, BLOCK_M)
    xs = xd + n_units * 8
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for u in range(u0, u1):
        base = row + u * 144  # d, dmin, 12 scale bytes, 128 nibble bytes
        d = f16(base)[:, None]
        dmin = f16(base + 2)[:, None]
        sw = (base + 4).to(tl.pointer_type(tl.int32))
        w1, w2, w3 = tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)
        for g in tl.static_range(4):  # bytes 32g..32g+31: sub-block 2g in low nibbles, 2g + 1 in high
            q = tl.load(base[:, None] + 16 + 32 * g + i[None, :])
            for h in tl.static_range(2):
                j = 2 * g + h
                dots = tl.dot(((q >> (4 * h)) & 15).to(tl.int8), _x_block(x_row, m_ok, u * 256 + 32 * j),
                              out_dtype=tl.int32)
                sc, mn = scales_mins(w1, w2, w3, tl.full([1], j, tl.int32))  # [BLOCK_N, 1]
                xd_j = tl.load(xd + u * 8 + j, mask=m_ok, other=0.0)[None, :]
                xs_j = tl.load(xs + u * 8 + j, mask=m_ok, other=0.0)[None, :]
                acc += (d * sc) * xd_j * dots.to(tl.float32) - (dmin * mn) * xs_j
    _store_rows(acc, rn, N, rm, M, o_ptr, b_ptr, stride_om, stride_os, HAS_BIAS)


@triton.jit
def _q8_0_split_int8_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, row_bytes, n_units, units_per_prog, stride_xm,
                            stride_om, stride_os, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1, rm, m_ok, x_row, xd = _rows_program(x_ptr, w_ptr, M, N, row_bytes, n_units, units_per_prog,
                                                         stride_xm, BLOCK_N, BLOCK_M)
    values = row.to(tl.pointer_type(tl.int8))  # split rows: the K int8 values, then K/32 fp16 scales
    scales = (row + n_units * 256).to(tl.pointer_type(tl.float16))
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for u in range(u0, u1):
        for blk in tl.static_range(8):
            q = tl.load(values[:, None] + u * 256 + 32 * blk + i[None, :])
            dots = tl.dot(q, _x_block(x_row, m_ok, u * 256 + 32 * blk), out_dtype=tl.int32)
            dw = tl.load(scales + u * 8 + blk).to(tl.float32)[:, None]
            acc += dw * tl.load(xd + u * 8 + blk, mask=m_ok, other=0.0)[None, :] * dots.to(tl.float32)
    _store_rows(acc, rn, N, rm, M, o_ptr, b_ptr, stride_om, stride_os, HAS_BIAS)


@triton.jit
def _q6_k_split_int8_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, row_bytes, n_units, units_per_prog, stride_xm,
                            stride_om, stride_os, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1, rm, m_ok, x_row, xd = _rows_program(x_ptr, w_ptr, M, N, row_bytes, n_units, units_per_prog,
                                                         stride_xm, BLOCK_N, BLOCK_M)
    # split rows: every unit's 128 ql bytes, then 64 qh bytes, 16 int8 scales, fp16 d
    qh_base = row + n_units * 128
    scales = (row + n_units * 192).to(tl.pointer_type(tl.int8))
    d_base = (row + n_units * 208).to(tl.pointer_type(tl.float16))
    i = tl.arange(0, 32)
    first = (i < 16)[:, None]  # the block's first scale group, as rows of its activations
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for u in range(u0, u1):
        d = tl.load(d_base + u).to(tl.float32)[:, None]
        for n in tl.static_range(2):
            qh = tl.load(qh_base[:, None] + u * 64 + 32 * n + i[None, :]).to(tl.int32)
            for a in tl.static_range(2):
                ql = tl.load(row[:, None] + u * 128 + 64 * n + 32 * a + i[None, :]).to(tl.int32)
                for nib in tl.static_range(2):
                    v0 = 128 * n + 64 * nib + 32 * a  # ggml's order of the 6-bit values
                    q = (((ql >> (4 * nib)) & 15) | (((qh >> (2 * a + 4 * nib)) & 3) << 4)) - 32
                    q = q.to(tl.int8)
                    x = _x_block(x_row, m_ok, u * 256 + v0)
                    lo = tl.dot(q, tl.where(first, x, 0), out_dtype=tl.int32)
                    hi = tl.dot(q, tl.where(first, 0, x), out_dtype=tl.int32)
                    sc_lo = tl.load(scales + u * 16 + v0 // 16).to(tl.float32)[:, None]
                    sc_hi = tl.load(scales + u * 16 + v0 // 16 + 1).to(tl.float32)[:, None]
                    xd_b = tl.load(xd + u * 8 + v0 // 32, mask=m_ok, other=0.0)[None, :]
                    acc += d * xd_b * (sc_lo * lo.to(tl.float32) + sc_hi * hi.to(tl.float32))
    _store_rows(acc, rn, N, rm, M, o_ptr, b_ptr, stride_om, stride_os, HAS_BIAS)


# (ggml type, split rows) -> verify's kernel; the same keys as triton_dp4a's GEMVs
_KERNELS = {(Q.Q4_K, False): _q4_k_int8_kernel, (Q.Q8_0, True): _q8_0_split_int8_kernel,
            (Q.Q6_K, True): _q6_k_split_int8_kernel}
assert _KERNELS.keys() == triton_dp4a._KERNELS.keys()
serves = triton_dp4a.serves
assert all(key in _KERNELS or (verify not in INT8 and key in RUNS_ONLY_TYPES)
           for key, (decode, verify) in QUANT_ROUTES.items() if INT8.intersection((decode, verify)))


def matmul(x: torch.Tensor, weights: torch.Tensor, qtype, split_rows: bool, in_features: int,
           bias: torch.Tensor | None = None, *, quantized: torch.Tensor | None = None, block_n: int = 64,
           split_k: int | None = None, num_warps: int = 4, stages: int = 1, runs: bool = False) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) on int8 activations for rows that serves() accepts, M = prod(x.shape[:-1])
    up to MAX_FUSED_M: one row on the dp4a GEMV, more on integer tensor cores. Output in x.dtype.
    quantized: x's rows as quantize_rows gives them, when already rounded (shared by products of one
    input); else rounded here. stages, runs: the one-row GEMV's (triton_dp4a.gemv)."""
    if not serves(qtype, split_rows, runs=runs and x.numel() == in_features):
        raise ValueError(f"no int8 product reads {Q(qtype).name} rows{' (split)' if split_rows else ''}")
    if in_features % SUPER:
        raise ValueError(f"int8 products need in_features a multiple of {SUPER}, got {in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    m, n = x2.shape[0], weights.shape[0]
    if m > MAX_FUSED_M:
        raise ValueError(f"int8 products handle at most {MAX_FUSED_M} rows, got {m}")
    if m == 0 or n == 0:
        return x2.new_empty(m, n).reshape(*lead, n)
    if quantized is None:
        quantized = quantize_rows(x2)
    elif quantized.shape != (m, in_features + in_features // 4):
        raise ValueError(f"rounded rows {tuple(quantized.shape)} do not match x {tuple(x2.shape)}")
    if m == 1:
        return triton_dp4a.gemv(x2, weights, qtype, split_rows, in_features, bias, quantized=quantized,
                                block_n=block_n, split_k=split_k, num_warps=num_warps,
                                stages=stages, runs=runs).reshape(*lead, n)
    n_units = in_features // SUPER
    programs_n = triton.cdiv(n, block_n)
    if split_k is None:  # as the float verify kernel: about four programs an SM, two units each at least
        split_k = max(1, min(4 * num_sms(x.device) // programs_n, n_units // 2))
    per = triton.cdiv(n_units, max(1, min(split_k, n_units)))
    split_k = triton.cdiv(n_units, per)
    out = x2.new_empty(m, n)
    target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    has_bias = bias is not None and split_k == 1
    kernel = _KERNELS[(qtype, split_rows)]
    kernel[(programs_n, split_k)](
        quantized, weights, bias if has_bias else out, target, m, n, weights.shape[1], n_units, per,
        quantized.stride(0), n, m * n if split_k > 1 else 0,
        BLOCK_N=block_n, BLOCK_M=max(16, next_pow2(m)), HAS_BIAS=has_bias, num_warps=num_warps,
        **pdl_launch(x.device))
    if split_k > 1:
        reduce_splits(target, bias, out)
    return out.reshape(*lead, n)
