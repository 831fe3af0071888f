"""Q8_0 decode GEMV over "split rows" (Triton): the layout Q8_0 linears take on the GPU.

ggml's Q8_0 block is 34 bytes (an fp16 scale, then 32 int8 values), so a block's values sit at
2-byte alignment: the fused kernel (triton_quant_matmul) loads them 2 bytes at a time and shuffles
bytes into place, ~10 instructions a weight, which holds it at ~2 T weights/s (46-55% of the
H200's bandwidth; BENCHMARKS, eleventh round). A split row holds the same bytes per output feature
in another order: the row's K int8 values first, then its K/32 fp16 scales. With rows 16-byte
aligned (K a multiple of 256, as every real model's), a program loads 16 values with one
instruction, multiplies a whole unit of 8 blocks as one [BLOCK_N, 8, 32] tile and applies each
block's scale once to the block's sum. (Turning int8 into float32 with an OR and a subtract
instead of the int-to-float instruction, which runs at a quarter of the FMA rate, was slower on
every qwen3-8b matrix on the H200: eleventh round.) Verify and prefill read split rows through
triton_quant_matmul (split_rows=True).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

QK = 32  # values per Q8_0 block
UNIT = 256  # values per loop iteration: 8 blocks (the kernel spells both as literals)


def split_rows(raw: torch.Tensor) -> torch.Tensor:
    """ggml Q8_0 rows [N, K/32*34] -> split rows of the same size: K int8 values, then K/32 fp16 scales."""
    n, row_bytes = raw.shape
    blocks = raw.view(n, row_bytes // 34, 34)
    return torch.cat([blocks[:, :, 2:].reshape(n, -1), blocks[:, :, :2].reshape(n, -1)], dim=1)


def join_rows(split: torch.Tensor) -> torch.Tensor:
    """split_rows' inverse: ggml Q8_0 rows."""
    n, row_bytes = split.shape
    k = row_bytes // 34 * QK
    values, scales = split[:, :k].reshape(n, -1, QK), split[:, k:].reshape(n, -1, 2)
    return torch.cat([scales, values], dim=2).reshape(n, row_bytes)


@triton.jit
def _q8_0_split_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog, stride_os,
                       BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N re-read row N-1; dropped at the store
    row = w_ptr + rows * row_bytes  # [BLOCK_N] byte pointers
    blk = tl.arange(0, 8)
    col = blk[:, None] * 32 + tl.arange(0, 32)[None, :]  # [8, 32]: a unit's columns
    values = (row[:, None, None] + col[None, :, :]).to(tl.pointer_type(tl.int8))  # [BLOCK_N, 8, 32]
    scales = (row[:, None] + n_units * 256 + blk[None, :] * 2).to(tl.pointer_type(tl.float16))  # [BLOCK_N, 8]
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
    u0 = pid_s * units_per_prog
    for u in range(u0, tl.minimum(u0 + units_per_prog, n_units)):
        q = tl.load(values + u * 256).to(tl.float32)
        xv = tl.load(x_ptr + u * 256 + col).to(tl.float32)  # [8, 32]
        d = tl.load(scales + u * 8).to(tl.float32)  # [BLOCK_N, 8]: 8 fp16 scales a unit
        acc += tl.sum(q * xv[None, :, :], axis=2) * d
    res = tl.sum(acc, axis=1)
    if HAS_BIAS:
        res += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(o_ptr + pid_s * stride_os + rn, res.to(o_ptr.dtype.element_ty), mask=rn < N)


def gemv(x: torch.Tensor, split: torch.Tensor, in_features: int, bias: torch.Tensor | None = None, *,
         block_n: int = 16, split_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x [1, K] @ W.T (+ bias) for split Q8_0 rows [N, K/32*34]; output in x.dtype."""
    from .triton_quant_matmul import one_row_gemv
    return one_row_gemv(_q8_0_split_kernel, x, split, in_features, UNIT, bias, "split Q8_0",
                        block_n=block_n, split_k=split_k, num_warps=num_warps)
