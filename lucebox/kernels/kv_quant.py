"""KV cache quantisation: plain-torch reference (vectorised, any device).

Formats (x is one row of head_dim values; blocks of 32 run along head_dim):

- q8_0 (llama.cpp): per block d = amax/127 stored as fp16, q = round(x/d) int8, x ~ d*q.
- q4_0 (llama.cpp): per block d = max/-8 where max is the signed value of largest magnitude, so
  that value lands exactly on q = 0 (x = -8d); q = trunc(x/d + 8.5) clipped to 0..15, x ~ d*(q-8).
  Two nibbles per byte in ggml's order: byte j holds value j (low nibble) and value j+16 (high).
- fp8: float8_e4m3fn values with one scale per row (token, head) = amax/448, so the row's
  largest value maps onto e4m3's largest finite value.

q8_0 / q4_0 reproduce ggml's reference quantiser bit for bit (and hence gguf-py's, which copies
it): scale computed in float32, the input multiplied by the float32 reciprocal 1/d (not divided
by d), round half *away from zero* for q8_0 (C's roundf, not torch.round's half-to-even), and
trunc(v + 8.5) for q4_0. The fp16 scale is what is stored and what dequantisation uses.
"""
from __future__ import annotations

import torch

from ..errors import RequestError

QK = 32  # llama.cpp's block size for q8_0 / q4_0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_block_dim(head_dim: int, cache_type: str) -> None:
    if head_dim % QK != 0:
        raise RequestError(
            f"KV cache type {cache_type} stores blocks of {QK} values along head_dim, but this model's "
            f"head_dim is {head_dim} (not a multiple of {QK}); use f16, bf16 or fp8 instead")


def _blocks(x: torch.Tensor, cache_type: str) -> torch.Tensor:
    """[..., D] -> float32 [..., D/32, 32]."""
    check_block_dim(x.shape[-1], cache_type)
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _true_div(a: torch.Tensor, b: float) -> torch.Tensor:
    # On CUDA, tensor / python-scalar is computed as a * (1/b), which is off by an ulp for some a
    # (amax/127 must match ggml's to the bit); dividing by a device tensor is a real IEEE division.
    # new_full fills the divisor on the device (torch.tensor would copy it from the host, which a
    # CUDA graph capture forbids).
    return a / a.new_full((), b)


def _reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    # ggml: id = d ? 1.0f/d : 0.0f -- an all-zero block quantises to zeros instead of NaN.
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    # C roundf. floor(|v| + 0.5) would be wrong for 0.49999997 (the add rounds up to 1.0); adding
    # floor(2 * frac) is exact in float32 for |v| < 2^23, as gguf-py's np_roundf does.
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


# ---------------------------------------------------------------- q8_0

def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q int8 [..., D], d float16 [..., D/32])."""
    b = _blocks(x, "q8_0")
    d = _true_div(b.abs().amax(dim=-1, keepdim=True), 127.0)
    q = _round_half_away(b * _reciprocal_or_zero(d)).clamp_(-127, 127)
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1).to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [..., D], d float16 [..., D/32]) -> [..., D]; computed in float32 (exact: 11x8 bits)."""
    b = q.float().reshape(*q.shape[:-1], d.shape[-1], QK) * d.float().unsqueeze(-1)
    return b.reshape(q.shape).to(dtype)


# ---------------------------------------------------------------- q4_0

def quantize_q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed uint8 [..., D/2], d float16 [..., D/32])."""
    b = _blocks(x, "q4_0")
    # argmax returns the first of equal magnitudes, as numpy's does, so ties pick the same sign.
    imax = b.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(b, -1, imax) / -8  # a power of two: exact either way
    q = torch.trunc(b * _reciprocal_or_zero(d) + 8.5).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :QK // 2] | (q[..., QK // 2:] << 4)
    return packed.reshape(*x.shape[:-1], x.shape[-1] // 2), d.squeeze(-1).to(torch.float16)


def dequantize_q4_0(packed: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed uint8 [..., D/2], d float16 [..., D/32]) -> [..., D]."""
    p = packed.reshape(*packed.shape[:-1], d.shape[-1], QK // 2)
    q = torch.cat([p & 0x0F, p >> 4], dim=-1).float() - 8
    x = q * d.float().unsqueeze(-1)
    return x.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)


# ---------------------------------------------------------------- fp8

def quantize_fp8(x: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], scale [..., 1]) with scale = row amax / 448."""
    xf = x.float()
    scale = _true_div(xf.abs().amax(dim=-1, keepdim=True), FP8_MAX).to(scale_dtype)
    s = scale.float()  # divide by the stored (possibly fp16-rounded) scale so dequant is consistent
    s = torch.where(s == 0, torch.ones_like(s), s)
    # Clamp: rounding can push the largest value a hair past 448, and the CUDA cast does not saturate.
    v = (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return v, scale


def dequantize_fp8(v: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (v.float() * scale.float()).to(dtype)


# ---------------------------------------------------------------- Walsh-Hadamard rotation

def hadamard_block_size(n: int) -> int:
    """Largest power of two dividing n (n itself when n is a power of two)."""
    return n & -n


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                    ) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard matrix [n, n] (Sylvester: H_2m = [[H, H], [H, -H]] / sqrt 2).

    For n not a power of two (head_dim 80, 96, ...) the result is block-diagonal with Sylvester
    blocks of the largest power of two dividing n: still orthonormal and symmetric, it just spreads
    an outlier over its own block rather than the whole row. For q8_0/q4_0 (n a multiple of 32)
    each Hadamard block covers whole quantisation blocks, so every quant block still gets mixed.
    Symmetric and orthonormal means H @ H = I: the same matrix rotates and un-rotates.
    """
    if n < 1:
        raise ValueError(f"hadamard_matrix needs n >= 1, got {n}")
    b = hadamard_block_size(n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / h.shape[0] ** 0.5
    if b != n:
        h = torch.block_diag(*([h] * (n // b)))
    return h.to(dtype=dtype, device=device)
