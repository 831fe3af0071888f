"""Fused dequantise-and-multiply for GGUF weights (Triton), and a Triton dequantiser for prefill.

Decode and verify multiply a few rows of activations (M = 1..64) by every weight once per step,
so they are bound by memory bandwidth: the kernel reads each packed weight byte once, unpacks it
in registers and multiplies it straight away, accumulating in float32. One program owns
BLOCK_N output features (rows of W) and a range of K; when there are too few programs to fill the
GPU the K range is split (split-K) and the float32 partials are summed afterwards by one small
kernel that also adds the bias and casts (in a fixed order, so results stay deterministic): that
kernel and the one-row GEMV helpers the other quantised kernels share are in triton_one_row.

Every format is consumed as "planes": a [BLOCK_N, P] tile of weights that share the shape of one
ggml sub-block loop, together with the P column indices (within the current unit of K) they
multiply. A plane is dequantised to float32 and then, by MODE,
  0  (M == 1)    multiplied elementwise into a [BLOCK_N, P] accumulator, reduced once at the end;
  1  (M > 1)     fed to tl.dot against the matching x columns (fp32 accumulation);
  2  (dequant)   stored as a row tile of the dequantised matrix, for prefill, where cuBLAS on the
                 bf16 tile beats any fused kernel.
In mode 2 the arithmetic is done without FMA contraction, so it is bit-exact with
`dequant.dequantize` (and so with gguf-py).

Byte layouts are ggml's (see dequant.py). Fields are read through byte pointers; Triton widens
those loads itself as far as it can prove alignment (vector loads for the 16-byte aligned
K-quant fields, 2-byte loads inside the 34/210-byte Q8_0/Q6_K blocks).

Large M (prefill): `quant_matmul` below is only the fused path; kernels/linear.py dequantises row
chunks with `dequantize` here and multiplies with torch.matmul (cuBLAS) when M > MAX_FUSED_M.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .dispatch import next_pow2, num_sms, pdl_launch
from .routing import ACTIVATION_DTYPES, MAX_FUSED_M
from .triton_one_row import f16, reduce_splits, store_one_row
from .triton_pdl import wait_for_previous_kernel

_F_Q8_0, _F_Q4_0, _F_Q4_K, _F_Q5_K, _F_Q6_K, _F_IQ4_XS = range(6)
# ggml type -> (format id, bytes per unit, values per unit, plane width) where a unit is what one
# loop iteration consumes: one 256-value super-block, or BPU 32-value blocks for Q8_0/Q4_0.
_FORMATS = {
    Q.Q8_0: (_F_Q8_0, 34, 32, 32),
    Q.Q4_0: (_F_Q4_0, 18, 32, 16),
    Q.Q4_K: (_F_Q4_K, 144, 256, 32),
    Q.Q5_K: (_F_Q5_K, 176, 256, 32),
    Q.Q6_K: (_F_Q6_K, 210, 256, 32),
    Q.IQ4_XS: (_F_IQ4_XS, 136, 256, 32),
}
SUPPORTED_TYPES = frozenset(_FORMATS)
# Decode (M = 1) launch: (BLOCK_N, warps) per format; formats not swept keep (32, 4).
# scripts/bench_kernels.py --only quant --sweep, H200, qwen3-8b shapes in CUDA graphs, 2026-12-03
DECODE_LAUNCH = {_F_Q8_0: (32, 8), _F_Q6_K: (32, 8), _F_Q4_K: (64, 4)}

# IQ4_NL/IQ4_XS codebook packed four int8 entries per int32 (little-endian), so a lookup is two
# selects and a shift instead of a gather.
_IQ4 = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _pack4(vals) -> int:
    word = sum((v & 0xFF) << (8 * i) for i, v in enumerate(vals))
    return word - (1 << 32) if word >= 1 << 31 else word


_IQ4_T0, _IQ4_T1, _IQ4_T2, _IQ4_T3 = (tl.constexpr(_pack4(_IQ4[i:i + 4])) for i in range(0, 16, 4))


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _use(acc, w, cols, xk, stride_xm, M, ok, n_mask,
         MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """Consume one dequantised plane w [BLOCK_N, P] (float32) whose columns are `cols` [P]."""
    if MODE == 0:
        xv = tl.load(xk + cols).to(tl.float32)
        acc += w * xv[None, :]
    elif MODE == 1:
        rm = tl.arange(0, BLOCK_M)
        xt = tl.load(xk + cols[:, None] + rm[None, :] * stride_xm, mask=rm[None, :] < M, other=0.0)
        if DOT_IEEE:
            acc = tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(xt.dtype), xt, acc)
    else:
        tl.store(ok + cols[None, :], w.to(ok.dtype.element_ty), mask=n_mask[:, None])
    return acc


@triton.jit
def _k_scale_min(w1, w2, w3, J: tl.constexpr):
    """6-bit (scale, min) of sub-block J of a Q4_K/Q5_K super-block; w1..w3 are the 12 scale
    bytes as three little-endian int32 words."""
    if J < 4:
        sc = (w1 >> (8 * J)) & 63
        mn = (w2 >> (8 * J)) & 63
    else:
        sc = ((w3 >> (8 * (J - 4))) & 15) | (((w1 >> (8 * (J - 4) + 6)) & 3) << 4)
        mn = ((w3 >> (8 * (J - 4) + 4)) & 15) | (((w2 >> (8 * (J - 4) + 6)) & 3) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _iq4_value(q):
    t = tl.where(q < 8, tl.where(q < 4, _IQ4_T0, _IQ4_T1), tl.where(q < 12, _IQ4_T2, _IQ4_T3))
    b = (t >> ((q & 3) * 8)) & 0xFF
    return ((b ^ 0x80) - 0x80).to(tl.float32)


@triton.jit
def _unit_q8_0(acc, ub, sb, xk, stride_xm, M, ok, n_mask, BPU: tl.constexpr, SPLIT: tl.constexpr,
               MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """ggml's 34-byte blocks, or split rows (triton_split_rows.py): values at ub, scales at sb."""
    i = tl.arange(0, 32)
    for b in tl.static_range(BPU):
        if SPLIT:
            d = f16(sb + 2 * b)
            q = tl.load((ub + b * 32 + i[None, :]).to(tl.pointer_type(tl.int8))).to(tl.float32)
        else:
            bp = ub + b * 34
            d = f16(bp)
            q = tl.load((bp + 2 + i[None, :]).to(tl.pointer_type(tl.int8))).to(tl.float32)
        acc = _use(acc, q * d, b * 32 + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def _unit_q4_0(acc, ub, xk, stride_xm, M, ok, n_mask,
               BPU: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    i = tl.arange(0, 16)
    for b in tl.static_range(BPU):
        bp = ub + b * 18
        d = f16(bp)
        qs = tl.load(bp + 2 + i[None, :]).to(tl.int32)
        lo = d * ((qs & 15).to(tl.float32) - 8.0)
        hi = d * ((qs >> 4).to(tl.float32) - 8.0)
        acc = _use(acc, lo, b * 32 + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
        acc = _use(acc, hi, b * 32 + 16 + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def _unit_q45_k(acc, ub, xk, stride_xm, M, ok, n_mask, FIVE: tl.constexpr,
                MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 nibble bytes) and Q5_K (176 bytes: the same
    with 32 bytes of fifth bits before the nibbles). value = (d*sc)*q - (dmin*m) per 32 values."""
    i = tl.arange(0, 32)
    d = f16(ub)
    dmin = f16(ub + 2)
    wp = (ub + 4).to(tl.pointer_type(tl.int32))
    w1 = tl.load(wp)
    w2 = tl.load(wp + 1)
    w3 = tl.load(wp + 2)
    if FIVE:
        qh = tl.load(ub + 16 + i[None, :]).to(tl.int32)
    for g in tl.static_range(4):
        qs = tl.load(ub + (48 if FIVE else 16) + 32 * g + i[None, :]).to(tl.int32)
        lo = qs & 15
        hi = qs >> 4
        if FIVE:
            lo = lo | (((qh >> (2 * g)) & 1) << 4)
            hi = hi | (((qh >> (2 * g + 1)) & 1) << 4)
        sc, mn = _k_scale_min(w1, w2, w3, 2 * g)
        w = (d * sc) * lo.to(tl.float32) - dmin * mn
        acc = _use(acc, w, 64 * g + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
        sc, mn = _k_scale_min(w1, w2, w3, 2 * g + 1)
        w = (d * sc) * hi.to(tl.float32) - dmin * mn
        acc = _use(acc, w, 64 * g + 32 + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def _unit_q6_k(acc, qlb, qhb, scb, db, xk, stride_xm, M, ok, n_mask,
               MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """Q6_K (210 bytes: 128 low-nibble bytes at qlb, 64 bytes of 2-bit pairs at qhb, 16 int8 scales
    at scb, fp16 d at db: one block in ggml's layout, or a unit of split rows).
    Per half n of 128 values: ql byte 64n + l (l < 64) holds values 128n + l (low nibble) and
    128n + 64 + l (high); qh byte 32n + l' holds the top bits of the four values 128n + l' + 32k
    as bit pairs k = 0..3; each run of 16 values has its own scale."""
    i = tl.arange(0, 32)
    first = i[None, :] < 16
    d = f16(db)
    for n in tl.static_range(2):
        qh = tl.load(qhb + 32 * n + i[None, :]).to(tl.int32)
        for a in tl.static_range(2):
            ql = tl.load(qlb + 64 * n + 32 * a + i[None, :]).to(tl.int32)
            for nib in tl.static_range(2):
                q = ((ql >> (4 * nib)) & 15) | (((qh >> (2 * a + 4 * nib)) & 3) << 4)
                v0 = 128 * n + 64 * nib + 32 * a
                # The plane's two int8 scales are adjacent (v0 // 16 is even): one 2-byte load.
                pair = tl.load((scb + v0 // 16).to(tl.pointer_type(tl.int16))).to(tl.int32)
                s_lo = d * (((pair & 0xFF) ^ 0x80) - 0x80).to(tl.float32)
                s_hi = d * (pair >> 8).to(tl.float32)
                w = tl.where(first, s_lo, s_hi) * (q.to(tl.float32) - 32.0)
                acc = _use(acc, w, v0 + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def _unit_iq4_xs(acc, ub, xk, stride_xm, M, ok, n_mask,
                 MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """IQ4_XS (136 bytes: fp16 d, uint16 high scale bits, 4 bytes of low scale nibbles, 128 bytes
    of codebook indices; 16 bytes per 32-value sub-block, low nibbles first). Each plane covers
    the 32 bytes of sub-blocks 2p and 2p+1."""
    i = tl.arange(0, 32)
    first = i[None, :] < 16
    d = f16(ub)
    sh = tl.load((ub + 2).to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF
    sl = tl.load((ub + 4).to(tl.pointer_type(tl.int32)))
    for p in tl.static_range(4):
        qs = tl.load(ub + 8 + 32 * p + i[None, :]).to(tl.int32)
        ls0 = (((sl >> (8 * p)) & 15) | (((sh >> (4 * p)) & 3) << 4)) - 32
        ls1 = (((sl >> (8 * p + 4)) & 15) | (((sh >> (4 * p + 2)) & 3) << 4)) - 32
        dl = tl.where(first, d * ls0.to(tl.float32), d * ls1.to(tl.float32))
        second = (i >= 16).to(tl.int32) * 16
        acc = _use(acc, dl * _iq4_value(qs & 15), 64 * p + i + second,
                   xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
        acc = _use(acc, dl * _iq4_value(qs >> 4), 64 * p + 16 + i + second,
                   xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def unit_product(acc, w_row, u, n_units, xk, stride_xm, M, ok, n_mask,
                 FMT: tl.constexpr, UNIT_BYTES: tl.constexpr, UNIT_VALUES: tl.constexpr, BPU: tl.constexpr,
                 SPLIT: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """Consume unit u of K of the rows at byte pointers w_row [BLOCK_N, 1] (MODE as _use; xk and ok:
    x's and the output's pointers at the unit's first column). Also read by triton_moe, whose
    experts' rows are found through an expert id."""
    ub = w_row + u * UNIT_BYTES
    if FMT == 0:  # split rows: a unit's values are UNIT_BYTES = UNIT_VALUES bytes, its scales after all values
        sb = w_row + n_units * UNIT_VALUES + u * (2 * BPU)
        acc = _unit_q8_0(acc, ub, sb, xk, stride_xm, M, ok, n_mask, BPU, SPLIT, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 1:
        acc = _unit_q4_0(acc, ub, xk, stride_xm, M, ok, n_mask, BPU, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 2:
        acc = _unit_q45_k(acc, ub, xk, stride_xm, M, ok, n_mask, False, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 3:
        acc = _unit_q45_k(acc, ub, xk, stride_xm, M, ok, n_mask, True, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 4:
        if SPLIT:  # split rows: every unit's ql, then every qh, every scale run, every d
            acc = _unit_q6_k(acc, w_row + u * 128, w_row + n_units * 128 + u * 64,
                             w_row + n_units * 192 + u * 16, w_row + n_units * 208 + u * 2,
                             xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
        else:
            acc = _unit_q6_k(acc, ub, ub + 128, ub + 192, ub + 208, xk, stride_xm, M, ok, n_mask,
                             MODE, BLOCK_M, DOT_IEEE)
    else:
        acc = _unit_iq4_xs(acc, ub, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def _qmm_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, row_bytes, n_units, units_per_prog,
                stride_xm, stride_om, stride_os,
                FMT: tl.constexpr, UNIT_BYTES: tl.constexpr, UNIT_VALUES: tl.constexpr, BPU: tl.constexpr,
                P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr,
                HAS_BIAS: tl.constexpr, DOT_IEEE: tl.constexpr, SPLIT: tl.constexpr = False,
                PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    # Rows past N re-read row N-1 (always in bounds) so weight loads need no mask; their results
    # are dropped at the store.
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    w_row = w_ptr + rows[:, None] * row_bytes  # [BLOCK_N, 1] byte pointers
    o_row = o_ptr + rn.to(tl.int64)[:, None] * stride_om  # mode 2: row starts of the output
    if MODE == 0:
        acc = tl.zeros([BLOCK_N, P], dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)
    u0 = pid_s * units_per_prog
    u1 = tl.minimum(u0 + units_per_prog, n_units)
    for u in range(u0, u1):
        acc = unit_product(acc, w_row, u, n_units, x_ptr + u * UNIT_VALUES, stride_xm, M, o_row + u * UNIT_VALUES,
                           n_mask, FMT, UNIT_BYTES, UNIT_VALUES, BPU, SPLIT, MODE, BLOCK_M, DOT_IEEE)
    if MODE == 0:
        store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)
    elif MODE == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        rm = tl.arange(0, BLOCK_M)
        ptrs = o_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
        tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=n_mask[:, None] & (rm[None, :] < M))


# ----------------------------------------------------------------------------- host side

def supports(qweight: torch.Tensor, qtype) -> bool:
    """Whether the kernels can read these bytes in place: a known format, contiguous rows and a
    start aligned for the widest header field read (fp16 for Q8_0/Q4_0, int32 words otherwise)."""
    if qtype not in _FORMATS or qweight.dtype != torch.uint8 or qweight.dim() != 2:
        return False
    align = 2 if _FORMATS[qtype][0] in (_F_Q8_0, _F_Q4_0) else 4
    return qweight.is_contiguous() and qweight.data_ptr() % align == 0


def unit_layout(qtype, in_features: int, split_rows: bool = False) -> tuple[int, int, int, int, int, int]:
    """(format id, bytes a unit, values a unit, blocks a unit, plane width, units a row) of rows of
    `in_features` values: the compile-time constants of unit_product."""
    if split_rows and qtype not in (Q.Q8_0, Q.Q6_K):
        raise ValueError(f"split rows are a layout of Q8_0 and Q6_K, not {qtype.name}")
    fmt, unit_bytes, unit_values, plane = _FORMATS[qtype]
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if in_features % block_values:
        raise ValueError(f"{qtype.name}: in_features {in_features} is not a multiple of {block_values}")
    bpu = 1
    if fmt in (_F_Q8_0, _F_Q4_0):  # group up to 8 blocks per loop iteration
        blocks = in_features // block_values
        bpu = next(b for b in (8, 4, 2, 1) if blocks % b == 0)
        unit_bytes, unit_values = block_bytes * bpu, block_values * bpu
        if split_rows:
            unit_bytes = unit_values
    return fmt, unit_bytes, unit_values, bpu, plane, in_features // unit_values


def _is_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype, in_features: int,
                 bias: torch.Tensor | None = None, *, block_n: int | None = None,
                 split_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, tensor_cores: bool | None = None,
                 split_rows: bool = False) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for raw GGUF rows `qweight` [N, bytes_per_row]; fused for
    M = prod(x.shape[:-1]) <= MAX_FUSED_M. Output in x.dtype, accumulated in float32.
    tensor_cores: multiply dequantised tiles with tl.dot (mode 1, x padded to 16 rows) rather
    than elementwise (mode 0); default: only for M > 1. At M = 1 the kernel is bound by the
    instructions per weight, which the tensor-core path changes: a launch option to measure.
    split_rows: Q8_0 or Q6_K rows in the split layout (kernels/triton_split_rows.py)."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quant_matmul: unsupported activation dtype {x.dtype}")
    fmt, unit_bytes, unit_values, bpu, plane, n_units = unit_layout(qtype, in_features, split_rows)
    n = qweight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > MAX_FUSED_M:
        raise ValueError(f"quant_matmul (fused) handles at most {MAX_FUSED_M} rows, got {m}")
    out = x2.new_empty(m, n)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    mode = 1 if (tensor_cores if tensor_cores is not None else m > 1) else 0
    if mode == 0 and m != 1:
        raise ValueError(f"quant_matmul: the elementwise path multiplies one row, got {m}")
    block_m = 1 if mode == 0 else max(16, next_pow2(m))
    decode_block_n, decode_warps = DECODE_LAUNCH.get(fmt, (32, 4))
    if block_n is None:
        block_n = decode_block_n if mode == 0 else 64
    programs_n = triton.cdiv(n, block_n)
    if split_k is None:
        # Loads are not software-pipelined across loop iterations here, so latency is hidden by
        # many resident programs: aim for several per SM, each keeping at least two units of K.
        waves = 8 if mode == 0 else 4
        split_k = max(1, min(waves * num_sms(x.device) // programs_n, n_units // 2))
    split_k = max(1, min(split_k, n_units))
    per = triton.cdiv(n_units, split_k)
    split_k = triton.cdiv(n_units, per)
    if split_k > 1:
        target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        stride_os = m * n
    else:
        target, stride_os = out, 0
    has_bias = bias is not None and split_k == 1
    # 8 warps for the widest tiles keep the unrolled planes in registers (no local-memory spills)
    kwargs = {"num_warps": num_warps or (decode_warps if mode == 0 else 8 if block_m >= 64 else 4)}
    if num_stages is not None:
        kwargs["num_stages"] = num_stages
    _qmm_kernel[(programs_n, split_k)](
        x2, qweight, bias if has_bias else x2, target,
        m, n, qweight.shape[1], n_units, per, x2.stride(0), n, stride_os,
        FMT=fmt, UNIT_BYTES=unit_bytes, UNIT_VALUES=unit_values, BPU=bpu, P=plane,
        BLOCK_N=block_n, BLOCK_M=block_m, MODE=mode, HAS_BIAS=has_bias,
        DOT_IEEE=_is_fp32(x.dtype), SPLIT=split_rows, **kwargs, **pdl_launch(x.device, tiles=mode == 1))
    if split_k > 1:
        reduce_splits(target, bias, out)
    return out.reshape(*lead, n)


def dequantize(qweight: torch.Tensor, qtype, in_features: int,
               out_dtype: torch.dtype = torch.float32, *, block_n: int = 16,
               num_warps: int = 4, split_rows: bool = False) -> torch.Tensor:
    """Raw GGUF rows [N, bytes_per_row] (or split rows) -> [N, in_features] in out_dtype; bit-exact
    with `lucebox.kernels.dequant.dequantize` (float32 arithmetic, no FMA contraction, then a cast)."""
    fmt, unit_bytes, unit_values, bpu, plane, n_units = unit_layout(qtype, in_features, split_rows)
    n = qweight.shape[0]
    out = torch.empty(n, in_features, dtype=out_dtype, device=qweight.device)
    if n == 0:
        return out
    programs_n = triton.cdiv(n, block_n)
    per = max(1, min(n_units, triton.cdiv(n_units * programs_n, 8 * num_sms(qweight.device))))
    split = triton.cdiv(n_units, per)
    _qmm_kernel[(programs_n, split)](
        qweight, qweight, qweight, out, 1, n, qweight.shape[1], n_units, per,
        0, in_features, 0,
        FMT=fmt, UNIT_BYTES=unit_bytes, UNIT_VALUES=unit_values, BPU=bpu, P=plane,
        BLOCK_N=block_n, BLOCK_M=1, MODE=2, HAS_BIAS=False, DOT_IEEE=False, SPLIT=split_rows,
        num_warps=num_warps, enable_fp_fusion=False, **pdl_launch(out.device))
    return out
