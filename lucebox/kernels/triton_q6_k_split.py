"""Q6_K decode GEMV over split rows (Triton): an experiment, timed by scripts/bench_kernels.py
against the fused kernel before any model takes it (kernels/triton_q8_0_split.py is the Q8_0
layout models use on the GPU; this one would join it there).

A ggml Q6_K super-block is 210 bytes (128 bytes of low nibbles, 64 of 2-bit high pairs, 16 int8
scales, an fp16 d), so its fields sit at 2-byte alignment: the fused kernel loads them a byte or
two at a time, ~13 SASS instructions a weight (sm_90), and Q6_K ran at 19-32% of the H200's
bandwidth (BENCHMARKS, fourth round). Q4_K_M gives Q6_K to every down projection, attn_v and the
output head: ~40% of its bytes. A split row holds the same bytes per output feature as
[all low-nibble bytes | all high-pair bytes | all scales | all d], each field's run 16-byte
aligned when the row has a multiple of 8 super-blocks (K a multiple of 2048, as the 8B shape's
4096 and 12288). A super-block is then one [rows, 2, 2, 2, 16] tile per field (halves n, 32-value
runs a, 16-value scale groups g, values i), and value v = 128n + 64h + 32a + 16g + i (h: low or
high nibble) has scale index 8n + 4h + 2a + g. Per scale group the row's dot product is
d * sc * (sum(q*x) - 32 * sum(x)), sum(x) shared by every row of the program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

QK_K = 256  # values per super-block
BLOCK_BYTES = 210
FIELDS = ((0, 128), (128, 192), (192, 208), (208, 210))  # ql, qh, scales, d: byte ranges in a super-block


def split_rows(raw: torch.Tensor) -> torch.Tensor:
    """ggml Q6_K rows [N, K/256*210] -> split rows of the same size: each field's bytes for every
    super-block of the row, field after field."""
    n, row_bytes = raw.shape
    blocks = raw.view(n, row_bytes // BLOCK_BYTES, BLOCK_BYTES)
    return torch.cat([blocks[:, :, a:b].reshape(n, -1) for a, b in FIELDS], dim=1)


def join_rows(split: torch.Tensor) -> torch.Tensor:
    """split_rows' inverse: ggml Q6_K rows."""
    n, row_bytes = split.shape
    nb = row_bytes // BLOCK_BYTES
    fields, start = [], 0
    for a, b in FIELDS:
        fields.append(split[:, start:start + nb * (b - a)].reshape(n, nb, b - a))
        start += nb * (b - a)
    return torch.cat(fields, dim=2).reshape(n, row_bytes)


@triton.jit
def _q6_k_split_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog, stride_os,
                       BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N re-read row N-1; dropped at the store
    row = w_ptr + rows * row_bytes
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
    u0 = pid_s * units_per_prog
    for u in range(u0, tl.minimum(u0 + units_per_prog, n_units)):
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(o_ptr + pid_s * stride_os + rn, acc.to(o_ptr.dtype.element_ty), mask=rn < N)


def gemv(x: torch.Tensor, split: torch.Tensor, in_features: int, bias: torch.Tensor | None = None, *,
         block_n: int = 32, split_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x [1, K] @ W.T (+ bias) for split Q6_K rows [N, K/256*210]; output in x.dtype. 32 rows and 4
    warps a program: the fewest SASS instructions a weight for sm_90 (9.7 in the loop, against
    13.5-14.7 at 16 rows or 8 warps and 12.8 for the fused kernel on ggml rows), not yet timed."""
    from .triton_quant_matmul import one_row_gemv
    return one_row_gemv(_q6_k_split_kernel, x, split, in_features, QK_K, bias, "split Q6_K",
                        block_n=block_n, split_k=split_k, num_warps=num_warps)
