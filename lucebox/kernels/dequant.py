"""GGUF block dequantisation: the plain-torch reference (CPU and CUDA).

Every function here reproduces gguf-py's numpy reference (`gguf/quants.py`) bit for bit in float32:
scales are widened from fp16 to fp32 first, and products/sums happen in the same order, one rounding
each (`d * q - m`, never a fused multiply-add). A Triton kernel can later be dispatched from
`dequantize` without callers changing.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from lucebox.errors import UnsupportedError

# IQ4_NL / IQ4_XS map each 4-bit index through this non-linear codebook.
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian fp16 bytes -> [n, 1] float32 (the copy makes the dtype view legal)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, dim: int) -> torch.Tensor:
    """Split bytes into (low, high) nibbles stacked along `dim`: ggml stores all low nibbles of a
    group first, then all high nibbles."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=dim)


def _bits(qh: torch.Tensor, dim: int) -> torch.Tensor:
    """Bit i (i = 0..7) of every byte, stacked along `dim`."""
    return torch.stack([(qh >> i) & 1 for i in range(8)], dim=dim)


def _float(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bfloat(b: torch.Tensor) -> torch.Tensor:
    # bf16 -> f32 is a 16-bit left shift, so this is exact (the numpy reference shifts int bits).
    return b.contiguous().view(torch.bfloat16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], dim=1).reshape(b.shape[0], 32)
    return _f16(b[:, :2]) * (q.float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], dim=1).reshape(b.shape[0], 32)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # qh is a little-endian uint32 whose bit i is the 5th bit of value i: byte i // 8, bit i % 8.
    n = qs.shape[0]
    high = _bits(qh, dim=-1).reshape(n, 32)
    return _nibbles(qs, dim=1).reshape(n, 32) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b[:, 2:6], b[:, 6:]).float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b[:, 4:8], b[:, 8:]).float() + _f16(b[:, 2:4])


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte block of eight 6-bit (scale, min) pairs shared by Q4_K and Q5_K.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales/mins 4-7 and borrow their top 2 bits from the spare high bits of bytes 0-7.
    """
    sc, mn, both = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([sc & 0x3F, (both & 0x0F) | ((sc >> 2) & 0x30)], dim=1)
    minimum = torch.cat([mn & 0x3F, (both >> 4) | ((mn >> 2) & 0x30)], dim=1)
    return scale, minimum


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: value = (d * scale) * q - (dmin * min) per 32-value sub-block."""
    n = b.shape[0]
    scale, minimum = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * scale.float()).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * minimum.float()).reshape(n, 8, 1)
    return (d * q.float() - dm).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # 128 quant bytes in 4 groups of 32: sub-block 2g is the low nibbles of group g, 2g+1 the high.
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32), dim=2).reshape(-1, 8, 32)
    return _k_affine(b, q)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # The 32 qh bytes are shared by all sub-blocks: bit j of byte k is the 5th bit of value k of
    # sub-block j.
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32), dim=2).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], dim=1)
    return _k_affine(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    # Two halves of 128 values; per half, 64 ql bytes (low then high nibbles) and 32 qh bytes
    # (bit pairs 0-1, 2-3, 4-5, 6-7) give four 32-value rows each.
    low = _nibbles(b[:, :128].reshape(n, 2, 64), dim=2).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 32)
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
    q = ((low | (high << 4)).float() - 32).reshape(n, 16, 16)
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    return (d * q).reshape(n, 256)


_IQ4_TABLES: dict[torch.device, torch.Tensor] = {}


def _iq4_lookup(q: torch.Tensor) -> torch.Tensor:
    table = _IQ4_TABLES.get(q.device)
    if table is None:  # made once per device: a host copy cannot run inside CUDA-graph capture
        table = _IQ4_TABLES[q.device] = torch.tensor(IQ4_KVALUES, dtype=torch.float32, device=q.device)
    return table[q.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], dim=1).reshape(b.shape[0], 32)
    return _f16(b[:, :2]) * _iq4_lookup(q)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    # Eight 6-bit sub-block scales: low 4 bits in bytes 4-7 (nibble pairs), top 2 bits packed into
    # the little-endian uint16 at bytes 2-3 (bits 2j, 2j+1 for sub-block j).
    low = _nibbles(b[:, 4:8], dim=2).reshape(n, 8)
    packed = b[:, 2].int() | (b[:, 3].int() << 8)
    high = torch.stack([(packed >> (2 * j)) & 3 for j in range(8)], dim=1)
    scale = (low.int() | (high << 4)) - 32
    dl = (_f16(b[:, :2]) * scale.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:].reshape(n, 8, 16), dim=2).reshape(n, 8, 32)
    return (dl * _iq4_lookup(q)).reshape(n, 256)


_DEQUANT = {
    Q.F32: _float, Q.F16: _half, Q.BF16: _bfloat,
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
}

SUPPORTED_TYPES: frozenset[Q] = frozenset(_DEQUANT)


def qtype_name(qtype) -> str:
    return getattr(qtype, "name", str(qtype))


def dequantize(data: torch.Tensor, qtype: Q, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw GGUF bytes [..., n_bytes] (uint8) -> values [..., n_values] in `out_dtype`.

    The last dimension must hold whole blocks; values come out in float32 and are then cast.
    """
    fn = _DEQUANT.get(qtype)
    if fn is None:
        raise UnsupportedError(f"GGUF tensor type {qtype_name(qtype)} is not supported; "
                               f"supported: {', '.join(sorted(t.name for t in _DEQUANT))}")
    if data.dtype != torch.uint8:
        raise TypeError(f"dequantize expects uint8 bytes, got {data.dtype}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if data.dim() == 0 or data.shape[-1] % type_size:
        raise ValueError(f"{qtype.name}: last dimension {tuple(data.shape)[-1:]} "
                         f"is not a whole number of {type_size}-byte blocks")
    lead = data.shape[:-1]
    n_values = data.shape[-1] // type_size * block_size
    blocks = data.reshape(-1, type_size)
    return fn(blocks).reshape(*lead, n_values).to(out_dtype)
