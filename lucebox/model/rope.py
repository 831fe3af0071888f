"""RoPE frequency tables: default, linear, llama3 and yarn scaling (the formulas of their papers,
in the same float32 arithmetic as the HF reference so logits agree to the last bits)."""
from __future__ import annotations

import math

import torch

from .config import RopeConfig


def rotary_dim(head_dim: int, factor: float) -> int:
    """transformers' int(head_dim * partial_rotary_factor), rounded down to whole pairs."""
    dim = int(head_dim * factor)
    return dim - dim % 2


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, attention scaling applied to cos and sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.type == "default":
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.type == "yarn":
        return _yarn(rope, head_dim)
    raise ValueError(rope.type)  # ModelConfig.validate rejects unknown types first


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attention = mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention


class RopeTable:
    """cos/sin for every position up to a length, grown on demand, float32 on the model's device.

    Tensors are made on the CPU explicitly: the model is built under torch.device("meta")."""

    def __init__(self, rope: RopeConfig, head_dim: int, freq_factors: torch.Tensor | None = None):
        inv_freq, self.scaling = inverse_frequencies(rope, head_dim)
        if freq_factors is not None:  # GGUF llama3 files ship the scaling as a `rope_freqs` tensor
            inv_freq = inv_freq / freq_factors.float()
        self.inv_freq = inv_freq
        self.cos = self.sin = torch.empty(0, head_dim, device="cpu")

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of `positions`. `bound` (every position is below it), when the caller knows
        it on the host, spares a device sync; a CUDA-graph capture must have reserved the table."""
        if bound is None:
            bound = int(positions.max()) + 1 if positions.numel() else 0
        if bound > self.cos.shape[0] or self.cos.device != positions.device:
            if positions.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("RoPE table too short inside a CUDA-graph capture: reserve() it first")
            self._grow(max(bound, 2 * self.cos.shape[0], 4096), positions.device)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def reserve(self, length: int, device) -> None:
        """Cover positions < length now: a captured graph keeps reading the tables it saw, so they
        must never be regrown (reallocated) after capture."""
        if length > self.cos.shape[0] or self.cos.device != torch.device(device):
            self._grow(max(length, 4096), device)

    def _grow(self, length: int, device):
        pos = torch.arange(length, dtype=torch.float32, device=device)
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * self.scaling, emb.sin() * self.scaling
