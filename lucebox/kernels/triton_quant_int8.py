"""Q8_0 weights times int8-quantised activations on integer tensor cores (Triton): an option of
`triton_quant_matmul.quant_matmul` (`int8_activations=True`) to measure against the float paths.

The float decode path spends ~5 instructions per weight (load, convert, scale, multiply-add), which
keeps it at a third to a half of the memory bandwidth (BENCHMARKS.md, 2026-12-03). Here, as in
llama.cpp's mmvq, the activations are quantised per 32 values to int8 with one float scale
(x ~ sx * qx), so each Q8_0 block's contribution is d_w * sx * (qw . qx): the 32-term integer dot
runs on tensor cores (x padded to 16 rows) and the float work is one multiply-add per block and
output instead of per weight. The price is the activations' rounding to 8 bits (relative error
~0.5% per value), which the float paths do not have: not the default until measured for speed and
for its effect on outputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2, pdl_launch
from .triton_pdl import wait_for_previous_kernel
from .triton_quant_matmul import _f16

QK = 32  # values per Q8_0 block, and per activation scale (the kernel spells it as a literal)


def quantize_activations(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, K / 32]) with x ~ scale * q per 32 values."""
    m, k = x2.shape
    blocks = x2.float().view(m, k // QK, QK)
    scales = blocks.abs().amax(-1) / 127.0
    q = (blocks / torch.where(scales > 0, scales, 1.0)[..., None]).round_().clamp_(-127, 127)
    return q.to(torch.int8).view(m, k), scales


@triton.jit
def _q8_0_int8_kernel(xq_ptr, xs_ptr, w_ptr, b_ptr, o_ptr, M, N, row_bytes, n_blocks, blocks_per_prog,
                      stride_xm, stride_sm, stride_om, stride_os,
                      BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N re-read row N-1; dropped at the store
    w_row = w_ptr + rows[:, None] * row_bytes
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    b0 = pid_s * blocks_per_prog
    for b in range(b0, tl.minimum(b0 + blocks_per_prog, n_blocks)):
        bp = w_row + b * 34
        d = _f16(bp)  # [BLOCK_N, 1]
        qw = tl.load((bp + 2 + i[None, :]).to(tl.pointer_type(tl.int8)))  # [BLOCK_N, 32]
        qx = tl.load(xq_ptr + rm[None, :] * stride_xm + (b * 32 + i)[:, None], mask=m_ok[None, :], other=0)
        sx = tl.load(xs_ptr + rm * stride_sm + b, mask=m_ok, other=0.0)
        dots = tl.dot(qw, qx, out_dtype=tl.int32)  # [BLOCK_N, BLOCK_M]
        acc += dots.to(tl.float32) * d * sx[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    ptrs = o_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
    tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=n_mask[:, None] & m_ok[None, :])


def q8_0_int8_matmul(x2: torch.Tensor, qweight: torch.Tensor, in_features: int, bias: torch.Tensor | None,
                     out: torch.Tensor, *, block_n: int = 64, split_k: int | None = None,
                     num_warps: int = 4, sms: int = 132) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W.T (+ bias) for Q8_0 rows `qweight`, x2 rounded to int8 per 32
    values. Returns the float32 split-K partials [splits, M, N] when split, else None (out filled)."""
    m = x2.shape[0]
    n = qweight.shape[0]
    n_blocks = in_features // QK
    xq, xs = quantize_activations(x2)
    programs_n = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = max(1, min(4 * sms // programs_n, n_blocks // 8))
    per = triton.cdiv(n_blocks, max(1, min(split_k, n_blocks)))
    split_k = triton.cdiv(n_blocks, per)
    target, stride_os = (out, 0) if split_k == 1 else (
        torch.empty(split_k, m, n, dtype=torch.float32, device=x2.device), m * n)
    has_bias = bias is not None and split_k == 1
    _q8_0_int8_kernel[(programs_n, split_k)](
        xq, xs, qweight, bias if has_bias else xs, target, m, n, qweight.shape[1], n_blocks, per,
        xq.stride(0), xs.stride(0), n, stride_os,
        BLOCK_N=block_n, BLOCK_M=max(16, next_pow2(m)), HAS_BIAS=has_bias, num_warps=num_warps,
        **pdl_launch(xq.device))
    return target if split_k > 1 else None
