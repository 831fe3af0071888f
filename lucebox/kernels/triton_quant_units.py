"""The GGUF weight formats the fused quantised kernels read, as "planes" (Triton device code).

Every format is consumed as planes: a [BLOCK_N, P] tile of weights that share the shape of one ggml
sub-block loop, together with the P column indices (within the current unit of K) they multiply.
A unit is what one loop iteration over K consumes: one 256-value super-block (K-quants, IQ4_XS), or
BPU 32-value blocks (Q8_0 and the 4-bit block formats Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL, whose rows are
only a multiple of 32 long: llama.cpp falls back to them where a row is not a multiple of 256).
`unit_product` decodes one unit plane by plane into float32 and hands each plane to `_use`, which,
by MODE,
  0  (M == 1)    multiplies it elementwise into a [BLOCK_N, P] accumulator, reduced once at the end;
  1  (M > 1)     feeds it to tl.dot against the matching x columns (fp32 accumulation);
  2  (dequant)   stores it as a row tile of the dequantised matrix.
The dense kernels (triton_quant_matmul) and the MoE expert kernels (triton_moe) call unit_product;
`unit_layout` gives its compile-time constants and `supports` says which weights it reads in place.

Byte layouts are ggml's (see dequant.py, the torch reference). Fields are read through byte
pointers; Triton widens those loads itself as far as it can prove alignment (vector loads for the
16-byte aligned K-quant fields, 2-byte loads inside the 18..34-byte blocks and Q6_K's 210 bytes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .dequant import IQ4_KVALUES
from .dispatch import interpreting
from .triton_one_row import f16

_F_Q8_0, _F_Q4_0, _F_Q4_K, _F_Q5_K, _F_Q6_K, _F_IQ4_XS, _F_Q4_1, _F_Q5_0, _F_Q5_1, _F_IQ4_NL = range(10)
# ggml type -> (format id, bytes per unit, values per unit, plane width) where a unit is what one
# loop iteration consumes: one 256-value super-block, or BPU 32-value blocks (unit_layout).
_FORMATS = {
    Q.Q8_0: (_F_Q8_0, 34, 32, 32),
    Q.Q4_0: (_F_Q4_0, 18, 32, 16),
    Q.Q4_1: (_F_Q4_1, 20, 32, 16),
    Q.Q5_0: (_F_Q5_0, 22, 32, 16),
    Q.Q5_1: (_F_Q5_1, 24, 32, 16),
    Q.IQ4_NL: (_F_IQ4_NL, 18, 32, 16),
    Q.Q4_K: (_F_Q4_K, 144, 256, 32),
    Q.Q5_K: (_F_Q5_K, 176, 256, 32),
    Q.Q6_K: (_F_Q6_K, 210, 256, 32),
    Q.IQ4_XS: (_F_IQ4_XS, 136, 256, 32),
}
SUPPORTED_TYPES = frozenset(_FORMATS)
# Formats of 32-value blocks: BPU of them a unit; their fields need only 2-byte alignment.
_BLOCK32 = frozenset(fmt for fmt, _, values, _ in _FORMATS.values() if values == 32)


def format_id(qtype) -> int:
    """The FMT constant of unit_product for a ggml type."""
    return _FORMATS[qtype][0]


# IQ4_NL/IQ4_XS codebook packed four int8 entries per int32 (little-endian), so a lookup is two
# selects and a shift instead of a gather.
def _pack4(vals) -> int:
    word = sum((v & 0xFF) << (8 * i) for i, v in enumerate(vals))
    return word - (1 << 32) if word >= 1 << 31 else word


IQ4_TABLE_WORDS = tuple(_pack4(IQ4_KVALUES[i:i + 4]) for i in range(0, 16, 4))
_IQ4_T0, _IQ4_T1, _IQ4_T2, _IQ4_T3 = (tl.constexpr(word) for word in IQ4_TABLE_WORDS)


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
def scale_min(w1, w2, w3, j):
    """6-bit (scale, min) of sub-blocks j (an int32 tile, or one constant) of the Q4_K/Q5_K super-blocks whose
    12 scale bytes are the words w1..w3 (int32, broadcastable against j): float32 tiles of their broadcast shape."""
    s = 8 * (j % 4)
    low = j < 4
    sc = tl.where(low, (w1 >> s) & 63, ((w3 >> s) & 15) | (((w1 >> (s + 6)) & 3) << 4))
    mn = tl.where(low, (w2 >> s) & 63, ((w3 >> (s + 4)) & 15) | (((w2 >> (s + 6)) & 3) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def iq4_byte(q):
    """The codebook entries of indices q (an int32 tile of 0..15) as bytes (0..255, two's complement)."""
    t = tl.where(q < 8, tl.where(q < 4, _IQ4_T0, _IQ4_T1), tl.where(q < 12, _IQ4_T2, _IQ4_T3))
    return (t >> ((q & 3) * 8)) & 0xFF


@triton.jit
def _iq4_value(q):
    return ((iq4_byte(q) ^ 0x80) - 0x80).to(tl.float32)


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
def _unit_4bit_blocks(acc, ub, xk, stride_xm, M, ok, n_mask, BPU: tl.constexpr, HAS_MIN: tl.constexpr,
                      FIVE: tl.constexpr, CODEBOOK: tl.constexpr,
                      MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """BPU of ggml's 32-value blocks of 4-bit codes: fp16 d, (HAS_MIN) an fp16 min m, (FIVE) the 32
    fifth bits as a little-endian uint32 (its low half for values 0-15, its high half for 16-31),
    then 16 bytes: value j's code in the low nibble of byte j, value 16 + j's in the high one. Each
    half is a plane of 16; a value is d * q + m (Q4_1, Q5_1), d * codebook[q] (IQ4_NL) or d * (q - 8)
    (Q4_0), d * (q - 16) (Q5_0)."""
    i = tl.arange(0, 16)
    for b in tl.static_range(BPU):
        bp = ub + b * (18 + 2 * HAS_MIN + 4 * FIVE)
        d = f16(bp)
        qs = tl.load(bp + 2 + 2 * HAS_MIN + 4 * FIVE + i[None, :]).to(tl.int32)
        if HAS_MIN:
            m = f16(bp + 2)
        for half in tl.static_range(2):
            q = (qs >> (4 * half)) & 15
            if FIVE:  # 2-byte loads: a Q5_0 block's uint32 is only 2-byte aligned
                qh = tl.load((bp + 2 + 2 * HAS_MIN + 2 * half).to(tl.pointer_type(tl.int16))).to(tl.int32)
                q = q | (((qh >> i[None, :]) & 1) << 4)
            if CODEBOOK:
                w = d * _iq4_value(q)
            elif HAS_MIN:
                w = d * q.to(tl.float32) + m
            else:
                w = d * (q.to(tl.float32) - (16.0 if FIVE else 8.0))
            acc = _use(acc, w, b * 32 + 16 * half + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


# PTX when compiled for NVIDIA; the interpreter (and AMD) spell the same arithmetic out
PTX_BF16X2 = tl.constexpr(not interpreting() and torch.version.hip is None)


@triton.jit
def nibbles_bf16(qs, scale, neg_offset, HIGH: tl.constexpr, ASM: tl.constexpr):
    """bf16 weights q * scale + neg_offset of the low (HIGH: high) nibbles q of the uint8 tile qs, scale
    and neg_offset bf16 tiles of its shape, each weight rounded once. ASM: packed bf16x2 PTX, two weights
    an instruction (128 + q's bits placed under bf16's exponent of 128, 128 taken off exactly, one FMA)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{\n.reg .b32 z, t0, t1, one, bias;\nmov.b32 z, 0;\nmov.b32 one, 0x3F803F80;\n"
            "mov.b32 bias, 0xC300C300;\nprmt.b32 t0, $2, z, 0x4140;\nprmt.b32 t1, $2, z, 0x4342;\n"
            + ("shr.b32 t0, t0, 4;\nshr.b32 t1, t1, 4;\n" if HIGH else "")
            + "lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
            "fma.rn.bf16x2 t0, t0, one, bias;\nfma.rn.bf16x2 t1, t1, one, bias;\n"
            "fma.rn.bf16x2 $0, t0, $3, $5;\nfma.rn.bf16x2 $1, t1, $4, $6;\n}",
            "=r,=r,r,r,r,r,r", [qs, scale, neg_offset], dtype=tl.bfloat16, is_pure=True, pack=4)
    q = (qs.to(tl.int32) >> (4 if HIGH else 0)) & 15
    return (q.to(tl.float32) * scale.to(tl.float32) + neg_offset.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def six_bits_bf16(ql, qh, scale, neg_offset, HIGH: tl.constexpr, SH: tl.constexpr, ASM: tl.constexpr):
    """nibbles_bf16 for Q6_K: q = the low (HIGH: high) nibbles of the uint8 tile ql with bits SH, SH + 1 of
    the uint8 tile qh above them (SH in 0, 2, 4, 6), as bf16 weights q * scale + neg_offset."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{\n.reg .b32 z, t0, t1, h0, h1, one, bias;\nmov.b32 z, 0;\nmov.b32 one, 0x3F803F80;\n"
            "mov.b32 bias, 0xC300C300;\nprmt.b32 t0, $2, z, 0x4140;\nprmt.b32 t1, $2, z, 0x4342;\n"
            "prmt.b32 h0, $3, z, 0x4140;\nprmt.b32 h1, $3, z, 0x4342;\n"
            + ("shr.b32 t0, t0, 4;\nshr.b32 t1, t1, 4;\n" if HIGH else "")
            + ("shl.b32 h0, h0, 4;\nshl.b32 h1, h1, 4;\n" if SH == 0 else
               "shl.b32 h0, h0, 2;\nshl.b32 h1, h1, 2;\n" if SH == 2 else
               "" if SH == 4 else "shr.b32 h0, h0, 2;\nshr.b32 h1, h1, 2;\n")
            + "lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
            "lop3.b32 t0, t0, h0, 0x00300030, 0xF8;\nlop3.b32 t1, t1, h1, 0x00300030, 0xF8;\n"
            "fma.rn.bf16x2 t0, t0, one, bias;\nfma.rn.bf16x2 t1, t1, one, bias;\n"
            "fma.rn.bf16x2 $0, t0, $4, $6;\nfma.rn.bf16x2 $1, t1, $5, $7;\n}",
            "=r,=r,r,r,r,r,r,r", [ql, qh, scale, neg_offset], dtype=tl.bfloat16, is_pure=True, pack=4)
    q = ((ql.to(tl.int32) >> (4 if HIGH else 0)) & 15) | (((qh.to(tl.int32) >> SH) & 3) << 4)
    return (q.to(tl.float32) * scale.to(tl.float32) + neg_offset.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _unit_q45_k(acc, ub, xk, stride_xm, M, ok, n_mask, FIVE: tl.constexpr,
                MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr, BF16: tl.constexpr = False):
    """Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 nibble bytes) and Q5_K (176 bytes: the same
    with 32 bytes of fifth bits before the nibbles). value = (d*sc)*q - (dmin*m) per 32 values.
    BF16 (bf16 x): Q4_K tiles' weights from bf16 scales, two an instruction (nibbles_bf16)."""
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
        if BF16 and MODE == 1 and not FIVE:  # bf16 weights from packed nibbles (nibbles_bf16)
            qb = tl.load(ub + 16 + 32 * g + i[None, :])
            for h in tl.static_range(2):
                sc, mn = scale_min(w1, w2, w3, 2 * g + h)
                w = nibbles_bf16(qb, tl.broadcast_to((d * sc).to(tl.bfloat16), qb.shape),
                                 tl.broadcast_to((-(dmin * mn)).to(tl.bfloat16), qb.shape), h == 1, PTX_BF16X2)
                acc = _use(acc, w, 64 * g + 32 * h + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
        else:
            qs = tl.load(ub + (48 if FIVE else 16) + 32 * g + i[None, :]).to(tl.int32)
            lo = qs & 15
            hi = qs >> 4
            if FIVE:
                lo = lo | (((qh >> (2 * g)) & 1) << 4)
                hi = hi | (((qh >> (2 * g + 1)) & 1) << 4)
            sc, mn = scale_min(w1, w2, w3, 2 * g)
            w = (d * sc) * lo.to(tl.float32) - dmin * mn
            acc = _use(acc, w, 64 * g + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
            sc, mn = scale_min(w1, w2, w3, 2 * g + 1)
            w = (d * sc) * hi.to(tl.float32) - dmin * mn
            acc = _use(acc, w, 64 * g + 32 + i, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def _q6_k_run_scales(pair_ptr, d):
    """d times the two int8 scales of a 32-value Q6_K run (adjacent: the run's first value // 16 is even),
    read in one 2-byte load at pair_ptr: (first 16 values', last 16 values') float32."""
    pair = tl.load(pair_ptr.to(tl.pointer_type(tl.int16))).to(tl.int32)
    return d * (((pair & 0xFF) ^ 0x80) - 0x80).to(tl.float32), d * (pair >> 8).to(tl.float32)


@triton.jit
def _unit_q6_k(acc, qlb, qhb, scb, db, xk, stride_xm, M, ok, n_mask,
               MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr, BF16: tl.constexpr = False):
    """Q6_K (210 bytes: 128 low-nibble bytes at qlb, 64 bytes of 2-bit pairs at qhb, 16 int8 scales
    at scb, fp16 d at db: one block in ggml's layout, or a unit of split rows).
    Per half n of 128 values: ql byte 64n + l (l < 64) holds values 128n + l (low nibble) and
    128n + 64 + l (high); qh byte 32n + l' holds the top bits of the four values 128n + l' + 32k
    as bit pairs k = 0..3; each run of 16 values has its own scale."""
    i = tl.arange(0, 32)
    first = i[None, :] < 16
    d = f16(db)
    for n in tl.static_range(2):
        qh = tl.load(qhb + 32 * n + i[None, :])
        for a in tl.static_range(2):
            ql = tl.load(qlb + 64 * n + 32 * a + i[None, :])
            for nib in tl.static_range(2):
                v0 = 128 * n + 64 * nib + 32 * a
                s_lo, s_hi = _q6_k_run_scales(scb + v0 // 16, d)
                scale = tl.where(first, s_lo, s_hi)
                if BF16 and MODE == 1:  # bf16 weights two at a time (six_bits_bf16); -32 * scale is exact
                    w = six_bits_bf16(ql, qh, tl.broadcast_to(scale.to(tl.bfloat16), ql.shape),
                                      tl.broadcast_to((-32.0 * scale).to(tl.bfloat16), ql.shape),
                                      nib == 1, 2 * a + 4 * nib, PTX_BF16X2)
                else:
                    q = ((ql.to(tl.int32) >> (4 * nib)) & 15) | (((qh.to(tl.int32) >> (2 * a + 4 * nib)) & 3) << 4)
                    w = scale * (q.to(tl.float32) - 32.0)
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
    experts' rows are found through an expert id. Q4_K and Q6_K tiles of bf16 x (MODE 1) build their bf16
    weights two an instruction (nibbles_bf16, six_bits_bf16)."""
    ub = w_row + u * UNIT_BYTES
    if FMT == 0:  # split rows: a unit's values are UNIT_BYTES = UNIT_VALUES bytes, its scales after all values
        sb = w_row + n_units * UNIT_VALUES + u * (2 * BPU)
        acc = _unit_q8_0(acc, ub, sb, xk, stride_xm, M, ok, n_mask, BPU, SPLIT, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 1:  # the 4-bit blocks (arguments: min?, fifth bits?, codebook?): Q4_0
        acc = _unit_4bit_blocks(acc, ub, xk, stride_xm, M, ok, n_mask, BPU,
                                False, False, False, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 6:  # Q4_1
        acc = _unit_4bit_blocks(acc, ub, xk, stride_xm, M, ok, n_mask, BPU,
                                True, False, False, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 7:  # Q5_0
        acc = _unit_4bit_blocks(acc, ub, xk, stride_xm, M, ok, n_mask, BPU,
                                False, True, False, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 8:  # Q5_1
        acc = _unit_4bit_blocks(acc, ub, xk, stride_xm, M, ok, n_mask, BPU,
                                True, True, False, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 9:  # IQ4_NL
        acc = _unit_4bit_blocks(acc, ub, xk, stride_xm, M, ok, n_mask, BPU,
                                False, False, True, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 2:
        acc = _unit_q45_k(acc, ub, xk, stride_xm, M, ok, n_mask, False, MODE, BLOCK_M, DOT_IEEE,
                          xk.dtype.element_ty == tl.bfloat16)
    elif FMT == 3:
        acc = _unit_q45_k(acc, ub, xk, stride_xm, M, ok, n_mask, True, MODE, BLOCK_M, DOT_IEEE)
    elif FMT == 4:
        if SPLIT:  # split rows: every unit's ql, then every qh, every scale run, every d
            ql, qh, sc, d = (w_row + u * 128, w_row + n_units * 128 + u * 64, w_row + n_units * 192 + u * 16,
                             w_row + n_units * 208 + u * 2)
        else:
            ql, qh, sc, d = ub, ub + 128, ub + 192, ub + 208
        acc = _unit_q6_k(acc, ql, qh, sc, d, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE,
                         xk.dtype.element_ty == tl.bfloat16)
    else:
        acc = _unit_iq4_xs(acc, ub, xk, stride_xm, M, ok, n_mask, MODE, BLOCK_M, DOT_IEEE)
    return acc


def supports(qweight: torch.Tensor, qtype) -> bool:
    """Whether the kernels can read these bytes in place: a known format, contiguous rows and a
    start aligned for the widest header field read (fp16 for the 32-value blocks, int32 words otherwise)."""
    if qtype not in _FORMATS or qweight.dtype != torch.uint8 or qweight.dim() != 2:
        return False
    align = 2 if _FORMATS[qtype][0] in _BLOCK32 else 4
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
    if fmt in _BLOCK32:  # group up to 8 blocks per loop iteration
        blocks = in_features // block_values
        bpu = next(b for b in (8, 4, 2, 1) if blocks % b == 0)
        unit_bytes, unit_values = block_bytes * bpu, block_values * bpu
        if split_rows:
            unit_bytes = unit_values
    return fmt, unit_bytes, unit_values, bpu, plane, in_features // unit_values
