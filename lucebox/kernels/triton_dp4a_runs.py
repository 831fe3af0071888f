"""One-row (decode) int8 GEMVs in runs (Triton, NVIDIA): the products of triton_dp4a's GEMVs with
nothing reduced across threads inside the loop over K.

Each thread owns runs of weight words that one vector load brings (16 bytes, or 8 where a format's
blocks are only 8-byte aligned) and keeps its run's float32 sums in an accumulator of its own until
the end; the headers and scales a run needs are loaded by it, in the same layout. Triton gives
triton_dp4a's kernels a layout that reduces within every super-block and moves the partial sums
through shared memory (a barrier) every unit of K. `python scripts/compile_kernels.py --kernels dp4a
--sass DIR` shows both kinds of loop. gemv(runs=True) launches these; routing.dp4a_runs decides
whether models do (LUCEBOX_DP4A_RUNS: opt-in until measured on a GPU).
"""
from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from .routing import DP4A_RUNS_TYPES
from .triton_dp4a import PTX_DP4A, dp4a
from .triton_one_row import one_row_program, store_one_row
from .triton_pdl import wait_for_previous_kernel
from .triton_quant_units import IQ4_TABLE_WORDS, iq4_byte, scale_min


@triton.jit
def _k_quant_runs(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog, stride_os,
                  BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr,
                  UNROLL: tl.constexpr, FIFTH_BIT: tl.constexpr):
    """_q4_k_dp4a_kernel's product with nothing reduced across threads inside the loop: a super-block
    row is 8 runs of 4 nibble words (16 bytes, one vector load), run t holding half of sub-blocks 2j and
    2j + 1 (j = t // 2), and each run's scaled sums stay in its own accumulator until the end; the
    16-byte header (d, dmin, 12 scale bytes) is one vector load too. FIFTH_BIT: Q5_K, whose 32 qh bytes
    after the header hold each value's fifth bit (bit s of byte k: value k of sub-block s). The kernels
    calling it have waited for the previous kernel (PDL) already."""
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    UNIT: tl.constexpr = 44 if FIFTH_BIT else 36  # words a super-block: 4 of header[, 8 of qh], 32 of nibbles
    words = row.to(tl.pointer_type(tl.int32))[:, None, None]
    xq = x_ptr.to(tl.pointer_type(tl.int32))  # quantize_rows' row: int8 values as words,
    xd = (x_ptr + n_units * 256).to(tl.pointer_type(tl.float32))  # then the scales,
    xs = xd + n_units * 8  # then the scaled sums
    t = tl.arange(0, 8)
    c = tl.arange(0, 4)
    run = 4 * t[:, None] + c[None, :]  # [8, 4]: nibble word 4t + c
    x_lo = 16 * (t // 2)[:, None] + 4 * (t % 2)[:, None] + c[None, :]  # its low nibbles' activation word; +8: high
    j = t // 2
    header = c[None, None, :] + 0 * t[None, :, None]  # [1, 8, 4]: each run reads its row's header words
    pick = c[None, None, :]
    even = (t % 2 == 0).to(tl.float32)[None, :]  # the even run of a pair adds its sub-blocks' min terms
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES, loop_unroll_factor=UNROLL):
        h = tl.load(words + u * UNIT + header)  # [BLOCK_N, 8, 4]
        q = tl.load(words + u * UNIT + UNIT - 32 + run[None])  # [BLOCK_N, 8, 4]
        q_lo = q & 0x0F0F0F0F
        q_hi = (q >> 4) & 0x0F0F0F0F
        if FIFTH_BIT:  # qh words 4 (t % 2) + c: bytes 16 (t % 2) + 4c.., bits 2j (low nibbles) and 2j + 1
            qh = tl.load(words + u * UNIT + 4 + (4 * (t % 2))[None, :, None] + c[None, None, :])
            shift = 2 * j[None, :, None]
            q_lo |= ((qh >> shift) & 0x01010101) << 4
            q_hi |= ((qh >> (shift + 1)) & 0x01010101) << 4
        zero = tl.zeros_like(q)
        lo = tl.sum(dp4a(q_lo, tl.load(xq + u * 64 + x_lo)[None], zero, ASM), axis=2)  # [BLOCK_N, 8]
        hi = tl.sum(dp4a(q_hi, tl.load(xq + u * 64 + 8 + x_lo)[None], zero, ASM), axis=2)
        w0 = tl.sum(tl.where(pick == 0, h, 0), axis=2)
        w1 = tl.sum(tl.where(pick == 1, h, 0), axis=2)
        w2 = tl.sum(tl.where(pick == 2, h, 0), axis=2)
        w3 = tl.sum(tl.where(pick == 3, h, 0), axis=2)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sc_lo, m_lo = scale_min(w1, w2, w3, 2 * j[None, :])
        sc_hi, m_hi = scale_min(w1, w2, w3, 2 * j[None, :] + 1)
        xd_lo, xd_hi = tl.load(xd + u * 8 + 2 * j)[None, :], tl.load(xd + u * 8 + 2 * j + 1)[None, :]
        xs_lo, xs_hi = tl.load(xs + u * 8 + 2 * j)[None, :], tl.load(xs + u * 8 + 2 * j + 1)[None, :]
        acc += d * (sc_lo * xd_lo * lo.to(tl.float32) + sc_hi * xd_hi * hi.to(tl.float32)) \
            - dmin * even * (m_lo * xs_lo + m_hi * xs_hi)
    store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


@triton.jit
def _q4_k_dp4a_runs_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                           stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                           ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
                           UNROLL: tl.constexpr = 1):
    wait_for_previous_kernel(PDL)
    _k_quant_runs(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog, stride_os,
                  BLOCK_N, HAS_BIAS, ASM, STAGES, UNROLL, False)


@triton.jit
def _q5_k_dp4a_runs_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                           stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                           ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
                           UNROLL: tl.constexpr = 1):
    wait_for_previous_kernel(PDL)
    _k_quant_runs(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog, stride_os,
                  BLOCK_N, HAS_BIAS, ASM, STAGES, UNROLL, True)


@triton.jit
def _q8_0_split_dp4a_runs_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                                 stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
                                 UNROLL: tl.constexpr = 1):
    """_q8_0_split_dp4a_kernel's product in runs (see _q4_k_dp4a_runs_kernel): a unit's 64 value words
    are 16 runs of 4, run t half of block t // 2, each with its own accumulator until the end."""
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    values = row.to(tl.pointer_type(tl.int32))[:, None, None]  # split rows: the K int8 values,
    scales = (row + n_units * 256).to(tl.pointer_type(tl.float16))[:, None]  # then K/32 fp16 scales
    xq = x_ptr.to(tl.pointer_type(tl.int32))
    xd = (x_ptr + n_units * 256).to(tl.pointer_type(tl.float32))
    t = tl.arange(0, 16)
    run = 4 * t[:, None] + tl.arange(0, 4)[None, :]  # [16, 4]: value word 4t + c
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES, loop_unroll_factor=UNROLL):
        q = tl.load(values + u * 64 + run[None])  # [BLOCK_N, 16, 4]
        dots = tl.sum(dp4a(q, tl.load(xq + u * 64 + run)[None], tl.zeros_like(q), ASM), axis=2)  # [BLOCK_N, 16]
        d = tl.load(scales + u * 8 + (t // 2)[None, :]).to(tl.float32)
        acc += dots.to(tl.float32) * d * tl.load(xd + u * 8 + t // 2)[None, :]
    store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


@triton.jit
def _q6_k_run_half(ql, qh, a, scale_words, xq, x_at, xd, xd_at, H: tl.constexpr, ASM: tl.constexpr):
    """Nibble H of every run of a Q6_K unit (see _q6_k_split_dp4a_runs_kernel): its [BLOCK_N, 8] scaled
    sums, computed in the layout of the runs' words so that nothing moves between threads. The unit's
    16 scale bytes come as 4 words [BLOCK_N, 8, 4]: run r = 4n + 2a + g takes byte 2a + g of word 2n + H."""
    q = ((ql >> (4 * H)) & 0x0F0F0F0F) | (((qh >> (4 * H + 2 * a[None])) & 0x03030303) << 4)
    xw = tl.load(xq + 16 * H + x_at)[None]  # [1, 8, 4]
    dots = tl.sum(dp4a(q, xw, tl.zeros_like(q), ASM), axis=2)  # [BLOCK_N, 8]
    sums = tl.sum(dp4a(tl.full(xw.shape, 0x01010101, tl.int32), xw, tl.zeros_like(xw), ASM), axis=2)  # sum(qx)
    r = tl.arange(0, 8)[None, :]
    c = tl.arange(0, 4)[None, None, :]
    word = tl.sum(tl.where(c == 2 * (r // 4)[:, :, None] + H, scale_words, 0), axis=2)
    sc = ((word << (24 - 8 * (r % 4))) >> 24).to(tl.float32)  # the signed byte
    return sc * tl.load(xd + 2 * H + xd_at)[None, :] * (dots - 32 * sums).to(tl.float32)


@triton.jit
def _q6_k_split_dp4a_runs_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                                 stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
                                 UNROLL: tl.constexpr = 1):
    """_q6_k_split_dp4a_kernel's product in runs (see _q4_k_dp4a_runs_kernel): run r = 4n + 2a + g of a
    unit is the 4 low-nibble words 16n + 8a + 4g + w, which with the bit pairs of qh words 8n + 4g + w
    hold values 128n + 64h + 32a + 16g + 4w + byte for both nibbles h (as in that kernel), a 16-value
    scale group each; each run keeps its sums in its own accumulator until the end."""
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    # split rows (triton_split_rows): every unit's 128 ql bytes, then 64 qh bytes, 16 scales, d
    ql_words = row.to(tl.pointer_type(tl.int32))[:, None, None]
    qh_words = (row + n_units * 128).to(tl.pointer_type(tl.int32))[:, None, None]
    scale_words = (row + n_units * 192).to(tl.pointer_type(tl.int32))[:, None, None]
    xq = x_ptr.to(tl.pointer_type(tl.int32))
    xd = (x_ptr + n_units * 256).to(tl.pointer_type(tl.float32))
    r = tl.arange(0, 8)
    d_base = (row + n_units * 208).to(tl.pointer_type(tl.float16))[:, None] + 0 * r[None, :]  # every run reads d
    w = tl.arange(0, 4)[None, :]
    n, a, g = r // 4, (r // 2) % 2, r % 2
    ql_at = (16 * n + 8 * a + 4 * g)[:, None] + w  # [8, 4]
    qh_at = (8 * n + 4 * g)[:, None] + w
    x_at = (32 * n + 8 * a + 4 * g)[:, None] + w  # +16h
    xd_at = 4 * n + a  # [8]: +2h
    a = a[:, None]
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES, loop_unroll_factor=UNROLL):
        ql = tl.load(ql_words + u * 32 + ql_at[None])  # [BLOCK_N, 8, 4]
        qh = tl.load(qh_words + u * 16 + qh_at[None])
        sw = tl.load(scale_words + u * 4 + tl.arange(0, 4)[None, None, :] + 0 * ql_at[None])  # [BLOCK_N, 8, 4]
        total = _q6_k_run_half(ql, qh, a, sw, xq + u * 64, x_at, xd + u * 8, xd_at, 0, ASM) \
            + _q6_k_run_half(ql, qh, a, sw, xq + u * 64, x_at, xd + u * 8, xd_at, 1, ASM)
        acc += tl.load(d_base + u).to(tl.float32) * total
    store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


# The IQ4 codebook lookup of 8 indices (the nibbles of a word) in PTX: prmt picks bytes of a table's
# half by the low 3 bits of each index, a third prmt takes each byte from the half its bit 3 names
# (as llama.cpp's get_int_from_table_16), two more sort the low nibbles' values from the high ones'.
_IQ4_LOOKUP = tl.constexpr("\n".join([
    "{", ".reg .b32 k0, k1, k2, k3, s, sel, l, h, t0, t1;",
    *(f"mov.b32 k{i}, {word & 0xFFFFFFFF:#010x};" for i, word in enumerate(IQ4_TABLE_WORDS)),
    "and.b32 s, $2, 0x77777777;", "and.b32 sel, $2, 0x88888888;", "shr.b32 sel, sel, 1;",
    "or.b32 sel, sel, 0x32103210;",
    "prmt.b32 l, k0, k1, s;", "prmt.b32 h, k2, k3, s;", "prmt.b32 t0, l, h, sel;",
    "shr.b32 s, s, 16;", "shr.b32 sel, sel, 16;",
    "prmt.b32 l, k0, k1, s;", "prmt.b32 h, k2, k3, s;", "prmt.b32 t1, l, h, sel;",
    "prmt.b32 $0, t0, t1, 0x6420;", "prmt.b32 $1, t0, t1, 0x7531;", "}"]))


@triton.jit
def _iq4_words(q, ASM: tl.constexpr):
    """The codebook values of the indices in q's nibbles (int32 words): the low nibbles' 4 int8 values
    as one word, the high nibbles' as another, byte k from byte k of q."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_IQ4_LOOKUP, "=r,=r,r", [q], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)
    else:  # the interpreter (and AMD): byte by byte
        lo = tl.zeros_like(q)
        hi = tl.zeros_like(q)
        for k in tl.static_range(4):
            lo |= iq4_byte((q >> (8 * k)) & 15) << (8 * k)
            hi |= iq4_byte((q >> (8 * k + 4)) & 15) << (8 * k)
    return lo, hi


@triton.jit
def _iq4_xs_dp4a_runs_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, row_bytes, n_units, units_per_prog,
                             stride_os, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                             ASM: tl.constexpr = PTX_DP4A, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
                             UNROLL: tl.constexpr = 1):
    """IQ4_XS rows (136 bytes a super-block: fp16 d, 16 high scale bits, 4 bytes of low scale nibbles,
    128 bytes of codebook indices, 16 a 32-value sub-block, low nibbles first) in runs of 2 words (the
    super-blocks are only 8-byte aligned): run r is half r % 2 of sub-block r // 2, its 8-byte header
    read by each run; indices become int8 values 4 at a time (_iq4_words), and the sub-block's scale
    d (ls - 32) applies once per run."""
    wait_for_previous_kernel(PDL)
    rn, row, u0, u1 = one_row_program(w_ptr, N, row_bytes, n_units, units_per_prog, BLOCK_N)
    words = row.to(tl.pointer_type(tl.int32))[:, None, None]  # 34 words a super-block: 2 of header
    xq = x_ptr.to(tl.pointer_type(tl.int32))  # quantize_rows' row: int8 values as words,
    xd = (x_ptr + n_units * 256).to(tl.pointer_type(tl.float32))  # then the scales
    r = tl.arange(0, 16)
    c = tl.arange(0, 2)
    sub = r // 2
    run = 2 + 2 * r[:, None] + c[None, :]  # [16, 2]: index words
    x_lo = (8 * sub + 2 * (r % 2))[:, None] + c[None, :]  # their low nibbles' activation words; +4: high
    header = c[None, None, :] + 0 * r[None, :, None]  # [1, 16, 2]
    pick = c[None, None, :]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for u in tl.range(u0, u1, num_stages=STAGES, loop_unroll_factor=UNROLL):
        h = tl.load(words + u * 34 + header)  # [BLOCK_N, 16, 2]: d | high scale bits << 16, low scale nibbles
        lo, hi = _iq4_words(tl.load(words + u * 34 + run[None]), ASM)  # [BLOCK_N, 16, 2]
        dots = dp4a(lo, tl.load(xq + u * 64 + x_lo)[None], tl.zeros_like(lo), ASM)
        dots = tl.sum(dp4a(hi, tl.load(xq + u * 64 + 4 + x_lo)[None], dots, ASM), axis=2)  # [BLOCK_N, 16]
        w0 = tl.sum(tl.where(pick == 0, h, 0), axis=2)
        w1 = tl.sum(tl.where(pick == 1, h, 0), axis=2)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        ls = ((w1 >> (4 * sub[None, :])) & 15) | (((w0 >> (16 + 2 * sub[None, :])) & 3) << 4)
        acc += d * (ls - 32).to(tl.float32) * tl.load(xd + u * 8 + sub)[None, :] * dots.to(tl.float32)
    store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)


RUNS_KERNELS = {(Q.Q4_K, False): _q4_k_dp4a_runs_kernel, (Q.Q8_0, True): _q8_0_split_dp4a_runs_kernel,
                (Q.Q6_K, True): _q6_k_split_dp4a_runs_kernel, (Q.IQ4_XS, False): _iq4_xs_dp4a_runs_kernel,
                (Q.Q5_K, False): _q5_k_dp4a_runs_kernel}
assert RUNS_KERNELS.keys() == DP4A_RUNS_TYPES
