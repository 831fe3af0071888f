"""Activation rows rounded to int8, and the one-row (decode) GEMVs on integer dot products for Q4_K
rows and split-row Q8_0 and Q6_K (Triton, NVIDIA); triton_quant_int8 holds verify's kernels, and
routing.QUANT_ROUTES decides where a model takes them.

The float kernels spend several SASS instructions a Q4_K weight (sm_90: unpack, convert, scale,
multiply-add), which bounds them below the bandwidth. As in llama.cpp's MMVQ, the activation row is rounded to int8 per 32 values first (x ~ xd * qx; one
launch, `quantize_rows`, or by the kernel that makes x: `store_rounded`), and a weight word of
four nibbles meets four activation bytes in one `dp4a` (PTX through `tl.inline_asm_elementwise`):
a Q4_K super-block is 32 words of nibble pairs, `word & 0x0F0F0F0F` the low nibbles of four
consecutive values and `(word >> 4) & 0x0F0F0F0F` the high ones, the matching activations one
aligned int32 word each. Per 32-value sub-block j
    x' . w = d * sc_j * xd_j * sum(q * qx) - dmin * m_j * xd_j * sum(qx),
exactly the float product of the rounded activations x' = xd * qx with the weights. Q8_0 in split
rows (triton_split_rows) is simpler still: a word of four int8 weights meets four activation bytes,
and each 32-value block's integer sum is scaled once, d * xd. Q6_K in split rows assembles four
6-bit values in a word from a word of low nibbles and the matching bit pairs of a qh word (the
pairs of four consecutive values sit at one bit position of four consecutive bytes), and takes the
-32 offset per 16-value group from the activations alone: d * sc * xd * (sum(q*qx) - 32 sum(qx)).
The price is that rounding (~0.4% of a value; ~0.3-1% of the largest output on random weights),
which the float kernels do not have. Under Triton's interpreter (the CPU tests) dp4a is
spelt out in byte arithmetic, with the same integer result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from .dispatch import interpreting, pdl_launch
from .routing import DP4A_RUNS_TYPES
from .triton_one_row import f16, one_row_gemv, one_row_program, store_one_row
from .triton_pdl import wait_for_previous_kernel
from .triton_quant_units import scale_min

QK = 32  # values per activation scale (and per Q4_K sub-block)
SUPER = 256  # values per Q4_K super-block; the kernel spells both as literals
# PTX dp4a when compiled for NVIDIA; byte arithmetic under the interpreter and on AMD (no PTX there)
PTX_DP4A = not interpreting() and torch.version.hip is None


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
    """c + the dot product of the four signed bytes of a and of b (int32 tensors)."""
    if ASM:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = c
        for k in tl.static_range(4):
            out += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
    return out


@triton.jit
def scales_mins(w1, w2, w3, j):
    """scale_min of sub-blocks j (an int32 tile) of the super-blocks of words w1..w3 ([BLOCK_N]):
    tiles [BLOCK_N, len(j)]."""
    return scale_min(w1[:, None], w2[:, None], w3[:, None], j[None, :])


@triton.jit
def store_rounded(row, x, b, ok, n_blocks):
    """Round x [BLOCKS, 32] (float32: the values of 32-value blocks b of one row, ok where b exists)
    to int8 per block and store them into the row's packed form at byte pointer `row` (see
    quantize_rows): int8 values, float32 scales d and d * sum(q), rounding half away from zero.
    The one rounding of every producer (quantize_rows, and RMSNorm / silu * up emitting their
    output's rows), so all give the same bytes for the same values."""
    d = tl.max(tl.abs(x), axis=1) / 127.0
    scaled = x * (1.0 / tl.where(d > 0, d, 1.0))[:, None]  # an all-zero block stays zero
    q = tl.minimum(tl.maximum(tl.floor(tl.abs(scaled) + 0.5), 0.0), 127.0)
    q = tl.where(scaled < 0, -q, q).to(tl.int32)
    cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(row.to(tl.pointer_type(tl.int8)) + cols, q.to(tl.int8), mask=ok[:, None])
    scales = (row + n_blocks * 32).to(tl.pointer_type(tl.float32))
    tl.store(scales + b, d, mask=ok)
    tl.store(scales + n_blocks + b, d * tl.sum(q, axis=1).to(tl.float32), mask=ok)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, n_blocks, stride_xm, stride_qm, BLOCKS: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Row pid(1) of x [M, K] -> its packed row at q_ptr (see quantize_rows)."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    ok = b < n_blocks
    cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + tl.program_id(1) * stride_xm + cols, mask=ok[:, None], other=0.0).to(tl.float32)
    store_rounded(q_ptr + tl.program_id(1) * stride_qm, x, b, ok, n_blocks)


def rounded_rows_like(x2: torch.Tensor) -> torch.Tensor:
    """An empty packed buffer for the rows of x2 [M, K] (see quantize_rows)."""
    m, k = x2.shape
    return torch.empty(m, k + k // 4, dtype=torch.uint8, device=x2.device)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Activation rows [M, K] (K a multiple of 256) -> uint8 [M, 1.25 K], each row packed as its K
    int8 values, then K/32 float32 scales xd, then K/32 float32 xd * sum(qx), with x ~ xd * qx per
    32 values. One launch; every row is rounded alike whatever M is, so a row's integer products are
    the same in a decode GEMV and in a verify product."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n_blocks = k // QK
    packed = rounded_rows_like(x2)
    blocks = 8
    _quantize_rows_kernel[(triton.cdiv(n_blocks, blocks), m)](
        x2, packed, n_blocks, x2.stride(0), packed.stride(0), BLOCKS=blocks, num_warps=1, **pdl_launch(x.device))
    return packed


@triton.jit
def _q4_k_dp4a_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                      stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    xq = x_ptr.to(tl.pointer_type(tl.int32))  # quantize_rows' row: int8 values as words,
    xd = (x_ptr + n_units * 256).to(tl.pointer_type(tl.float32))  # then the scales,
    xs = xd + n_units * 8  # then the scaled sums
    g = tl.arange(0, 4)
    word = 8 * g[:, None] + tl.arange(0, 8)[None, :]  # [4, 8]: nibble words of value pairs g
    x_word = word + 8 * g[:, None]  # their low nibbles' activation words (values 64g + 4w); +8: high
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES):
        base = row + u * 144  # d, dmin, 12 scale bytes, 128 nibble bytes
        d = f16(base)
        dmin = f16(base + 2)
        sw = (base + 4).to(tl.pointer_type(tl.int32))
        w1, w2, w3 = tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)
        q = tl.load((base + 16).to(tl.pointer_type(tl.int32))[:, None, None] + word[None])  # [BLOCK_N, 4, 8]
        zero = tl.zeros_like(q)
        lo = tl.sum(dp4a(q & 0x0F0F0F0F, tl.load(xq + u * 64 + x_word)[None], zero, ASM), axis=2)
        hi = tl.sum(dp4a((q >> 4) & 0x0F0F0F0F, tl.load(xq + u * 64 + 8 + x_word)[None], zero, ASM), axis=2)
        sc_lo, m_lo = scales_mins(w1, w2, w3, 2 * g)  # sub-blocks 2g (low nibbles) and 2g + 1
        sc_hi, m_hi = scales_mins(w1, w2, w3, 2 * g + 1)
        xd_lo, xd_hi = tl.load(xd + u * 8 + 2 * g)[None, :], tl.load(xd + u * 8 + 2 * g + 1)[None, :]
        xs_lo, xs_hi = tl.load(xs + u * 8 + 2 * g)[None, :], tl.load(xs + u * 8 + 2 * g + 1)[None, :]
        dots = sc_lo * xd_lo * lo.to(tl.float32) + sc_hi * xd_hi * hi.to(tl.float32)  # [BLOCK_N, 4]
        mins = m_lo * xs_lo + m_hi * xs_hi
        acc += d * tl.sum(dots, axis=1) - dmin * tl.sum(mins, axis=1)
    store_one_row(acc, rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


@triton.jit
def _q8_0_split_dp4a_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                            stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    # split rows: the K int8 values, then K/32 fp16 scales
    values = row.to(tl.pointer_type(tl.int32))
    scales = (row + n_units * 256).to(tl.pointer_type(tl.float16))
    xq = x_ptr.to(tl.pointer_type(tl.int32))
    xd = (x_ptr + n_units * 256).to(tl.pointer_type(tl.float32))
    blk = tl.arange(0, 8)
    word = 8 * blk[:, None] + tl.arange(0, 8)[None, :]  # [8, 8]: a unit's words, block by block
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES):
        q = tl.load(values[:, None, None] + u * 64 + word[None])  # [BLOCK_N, 8, 8]
        dots = tl.sum(dp4a(q, tl.load(xq + u * 64 + word)[None], tl.zeros_like(q), ASM), axis=2)  # [BLOCK_N, 8]
        d = tl.load(scales[:, None] + u * 8 + blk[None, :]).to(tl.float32)
        acc += dots.to(tl.float32) * d * tl.load(xd + u * 8 + blk)[None, :]
    store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


@triton.jit
def _q6_k_split_dp4a_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                            stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    # split rows (triton_split_rows): every unit's 128 ql bytes, then 64 qh bytes, 16 scales, d
    ql_words = row.to(tl.pointer_type(tl.int32))
    qh_words = (row + n_units * 128).to(tl.pointer_type(tl.int32))
    scales = (row + n_units * 192).to(tl.pointer_type(tl.int8))
    d_base = (row + n_units * 208).to(tl.pointer_type(tl.float16))
    xq = x_ptr.to(tl.pointer_type(tl.int32))
    xd = (x_ptr + n_units * 256).to(tl.pointer_type(tl.float32))
    n = tl.arange(0, 2)[:, None, None, None]  # [2, 2, 2, 4] tiles: halves n, 32-value runs a,
    a = tl.arange(0, 2)[None, :, None, None]  # 16-value scale groups g, words w; value
    g = tl.arange(0, 2)[None, None, :, None]  # 128n + 64h + 32a + 16g + 4w + byte
    w = tl.arange(0, 4)[None, None, None, :]
    ql_at = 16 * n + 8 * a + 4 * g + w  # the low-nibble word (nibble h) of those four values
    qh_at = 8 * n + 4 * g + w + 0 * a  # their bit pairs' word (pair 2h + a of each byte)
    x_at = 32 * n + 8 * a + 4 * g + w  # their activation word (+16h)
    group = tl.arange(0, 2)
    sc_at = 8 * group[:, None, None] + 2 * group[None, :, None] + group[None, None, :]  # [2, 2, 2]: (n, a, g)'s
    xd_at = 4 * group[:, None, None] + group[None, :, None] + 0 * group[None, None, :]  # scale (+4h); x block (+2h)
    ones = tl.full([2, 2, 2, 4], 0x01010101, tl.int32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES):
        ql = tl.load(ql_words[:, None, None, None, None] + u * 32 + ql_at[None])  # [BLOCK_N, 2, 2, 2, 4]
        qh = tl.load(qh_words[:, None, None, None, None] + u * 16 + qh_at[None])
        total = tl.zeros([BLOCK_N, 2, 2, 2], dtype=tl.float32)
        for h in tl.static_range(2):
            q = ((ql >> (4 * h)) & 0x0F0F0F0F) | (((qh >> (4 * h + 2 * a[None])) & 0x03030303) << 4)
            xw = tl.load(xq + u * 64 + 16 * h + x_at)  # [2, 2, 2, 4]
            dots = tl.sum(dp4a(q, xw[None], tl.zeros_like(q), ASM), axis=4)  # [BLOCK_N, 2, 2, 2]
            sums = tl.sum(dp4a(ones, xw, tl.zeros_like(xw), ASM), axis=3)  # [2, 2, 2]: sum(qx) a group
            sc = tl.load(scales[:, None, None, None] + u * 16 + 4 * h + sc_at[None]).to(tl.float32)
            xds = tl.load(xd + u * 8 + 2 * h + xd_at)  # [2, 2, 2]
            total += sc * (xds[None] * (dots - 32 * sums[None]).to(tl.float32))
        d = tl.load(d_base + u).to(tl.float32)
        acc += d * tl.sum(tl.sum(tl.sum(total, axis=3), axis=2), axis=1)
    store_one_row(acc, rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


# (ggml type, split rows) -> kernel. Launch: 64 rows x 4 warps, at most 4 units of K a program.
# scripts/bench_kernels.py --only quant --ms 1 --sweep, H200, qwen3-8b shapes in CUDA graphs, 2026-12-04
_KERNELS = {(Q.Q4_K, False): _q4_k_dp4a_kernel, (Q.Q8_0, True): _q8_0_split_dp4a_kernel,
            (Q.Q6_K, True): _q6_k_split_dp4a_kernel}
BLOCK_N, MAX_UNITS = 64, 4


def serves(qtype, split_rows: bool, runs: bool = False) -> bool:
    """Whether a dp4a GEMV reads these rows: Q4_K in ggml's layout, Q8_0 / Q6_K in split rows; with
    runs, also the formats only a runs kernel reads (routing.DP4A_RUNS_TYPES) (NVIDIA: the PTX
    instruction; the interpreter spells it out)."""
    return torch.version.hip is None and ((qtype, split_rows) in _KERNELS
                                          or runs and (qtype, split_rows) in DP4A_RUNS_TYPES)


def gemv(x: torch.Tensor, weights: torch.Tensor, qtype, split_rows: bool, in_features: int,
         bias: torch.Tensor | None = None, *, quantized: torch.Tensor | None = None, block_n: int = BLOCK_N,
         split_k: int | None = None, num_warps: int = 4, stages: int = 1, runs: bool = False,
         unroll: int = 1) -> torch.Tensor:
    """x [1, K] @ W.T (+ bias) for rows that serves() accepts, x rounded to int8 per 32 values
    (quantize_rows, unless given as `quantized`), then the GEMV through one_row_gemv; output in
    x.dtype. stages: see triton_one_row.one_row_gemv; runs: the kernels that keep each thread's sums
    apart until the end (triton_dp4a_runs), with `unroll` units an iteration."""
    if not serves(qtype, split_rows, runs):
        raise ValueError(f"no dp4a GEMV reads {Q(qtype).name} rows{' (split)' if split_rows else ''}")
    what = f"{Q(qtype).name} dp4a"
    if in_features % SUPER:
        raise ValueError(f"the {what} GEMV needs in_features a multiple of {SUPER}, got {in_features}")
    if x.numel() != in_features:
        raise ValueError(f"the {what} GEMV multiplies one row of {in_features}, got {tuple(x.shape)}")
    if split_rows and weights.stride(0) % 4:  # the kernels load each field in 4-byte words
        raise ValueError(f"split {Q(qtype).name} rows of {in_features} values are not 4-byte aligned")
    if unroll > 1 and not runs:
        raise ValueError("unroll applies to the runs kernels (runs=True) only")
    if runs:
        from .triton_dp4a_runs import RUNS_KERNELS
        kernel = RUNS_KERNELS[(qtype, split_rows)]
    else:
        kernel = _KERNELS[(qtype, split_rows)]
    return one_row_gemv(kernel, x, weights, in_features, SUPER, bias, what,
                        block_n=block_n, split_k=split_k, num_warps=num_warps, max_units=MAX_UNITS, stages=stages,
                        operand=quantize_rows(x) if quantized is None else quantized, unroll=unroll)
