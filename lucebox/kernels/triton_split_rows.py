"""The decode GEMVs of split rows (Triton; the layout is kernels/split_rows.py's).

In ggml's layout the fused kernel (triton_quant_matmul) loads Q8_0 and Q6_K fields a byte or two
at a time and shuffles bytes into place; in split rows a program loads 16 values with one
instruction. Decode (one row) runs the GEMVs here: Q8_0 multiplies a unit of 8 blocks as one
[rows, 8, 32] tile and applies each block's scale to the block's sum; Q6_K takes a super-block as
[rows, 2, 2, 2, 16] tiles per field (halves n, 32-value runs a, 16-value scale groups g, values i;
value v = 128n + 64h + 32a + 16g + i with h the low or high nibble, scale index 8n + 4h + 2a + g)
and per scale group computes d * sc * (sum(q*x) - 32 * sum(x)), sum(x) shared by every row of the
program. Verify and prefill read split rows through triton_quant_matmul (split_rows=True).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from .triton_one_row import one_row_gemv, one_row_program, store_one_row
from .triton_pdl import wait_for_previous_kernel

@triton.jit
def _q8_0_split_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                       stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr = 1,
                       PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    blk = tl.arange(0, 8)
    col = blk[:, None] * 32 + tl.arange(0, 32)[None, :]  # [8, 32]: a unit's columns
    values = (row[:, None, None] + col[None, :, :]).to(tl.pointer_type(tl.int8))  # [BLOCK_N, 8, 32]
    scales = (row[:, None] + n_units * 256 + blk[None, :] * 2).to(tl.pointer_type(tl.float16))  # [BLOCK_N, 8]
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES):
        q = tl.load(values + u * 256).to(tl.float32)
        xv = tl.load(x_ptr + u * 256 + col).to(tl.float32)  # [8, 32]
        d = tl.load(scales + u * 8).to(tl.float32)  # [BLOCK_N, 8]: 8 fp16 scales a unit
        acc += tl.sum(q * xv[None, :, :], axis=2) * d
    store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


@triton.jit
def _q6_k_split_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                       stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr = 1,
                       PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    n = tl.arange(0, 2)[:, None, None, None]
    a = tl.arange(0, 2)[None, :, None, None]
    g = tl.arange(0, 2)[None, None, :, None]
    i = tl.arange(0, 16)[None, None, None, :]
    ql_at = 64 * n + 32 * a + 16 * g + i  # [2, 2, 2, 16]: a super-block's low-nibble bytes, in order
    qh_at = 32 * n + 16 * g + i + 0 * a  # its high-pair bytes (the same byte for both runs a)
    x_at = 128 * n + 32 * a + 16 * g + i  # the low nibbles' columns (+64: the high nibbles')
    two = tl.arange(0, 2)
    sc_at = 8 * two[:, None, None] + 2 * two[None, :, None] + two[None, None, :]  # [2, 2, 2]: the low
    # nibbles' scale indices (+4: the high nibbles')
    qh_base = row + n_units * 128
    sc_base = row + n_units * 192
    d_base = row + n_units * 208
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES):
        ql = tl.load(row[:, None, None, None, None] + u * 128 + ql_at[None]).to(tl.int32)  # [BN, 2, 2, 2, 16]
        qh = tl.load(qh_base[:, None, None, None, None] + u * 64 + qh_at[None]).to(tl.int32)
        d = tl.load((d_base + u * 2).to(tl.pointer_type(tl.float16))).to(tl.float32)  # [BN]
        total = tl.zeros([BLOCK_N, 2, 2, 2], dtype=tl.float32)
        for h in tl.static_range(2):
            q = ((ql >> (4 * h)) & 15) | (((qh >> (4 * h + 2 * a[None])) & 3) << 4)
            x = tl.load(x_ptr + u * 256 + 64 * h + x_at).to(tl.float32)  # [2, 2, 2, 16]
            s = tl.sum(q.to(tl.float32) * x[None], axis=4) - 32.0 * tl.sum(x, axis=3)[None]
            sc = tl.load((sc_base[:, None, None, None] + u * 16 + 4 * h + sc_at[None]).to(tl.pointer_type(tl.int8)))
            total += sc.to(tl.float32) * s
        acc += d * tl.sum(tl.sum(tl.sum(total, axis=3), axis=2), axis=1)
    store_one_row(acc, rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


# ggml type -> (kernel, values a loop iteration consumes, default (BLOCK_N, warps, programs per SM
# the split-K aims at, fewest units a program)).
# scripts/bench_kernels.py --only quant --sweep, H200, qwen3-8b shapes, 2026-12-03
_GEMV = {Q.Q8_0: (_q8_0_split_kernel, 256, (16, 4, 8, 2)), Q.Q6_K: (_q6_k_split_kernel, 256, (64, 4, 16, 1))}


def gemv(x: torch.Tensor, split: torch.Tensor, qtype, in_features: int, bias: torch.Tensor | None = None, *,
         block_n: int | None = None, split_k: int | None = None, num_warps: int | None = None,
         stages: int = 1) -> torch.Tensor:
    """x [1, K] @ W.T (+ bias) for split rows [N, bytes] (kernels/split_rows.py) of Q8_0 or Q6_K; output in x.dtype.
    stages: see triton_one_row.one_row_gemv."""
    if qtype not in _GEMV:
        raise ValueError(f"split rows are a layout of {', '.join(t.name for t in _GEMV)}, not {Q(qtype).name}")
    kernel, unit, (default_block_n, default_warps, waves, min_units) = _GEMV[qtype]
    return one_row_gemv(kernel, x, split, in_features, unit, bias, f"split {Q(qtype).name}",
                        block_n=block_n or default_block_n, split_k=split_k,
                        num_warps=num_warps or default_warps, waves=waves, min_units=min_units, stages=stages)
