"""The gated activation of the MLP, silu(gate) * up, and the sigmoid output gate of gated attention.

    h = silu_and_mul(gate, up)   # == F.silu(gate) * up
    h, rows = silu_and_mul_rounded(gate, up)   # also h's rows rounded to int8, from the same launch
    h, rows = sigmoid_gate(gate, x, rounded)   # == sigmoid(gate) * x, gate [T, heads, head_dim]

GPU tensors go to the Triton kernel in kernels/triton_activation.py (one pass, where torch runs
two kernels and writes silu(gate) in between) through kernels/dispatch.py; CPU tensors, and
anything autograd records, take the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton
from .norm import needs_grad


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) (tanh approximation, Gemma's GeGLU) * up; torch on every device."""
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate and up [..., n] of one dtype, each with unit stride along n (column slices of one fused
    gate/up projection are fine)."""
    if use_triton(gate, up) and not needs_grad(gate, up) and gate.dtype == up.dtype:
        from . import triton_activation
        return triton_activation.silu_and_mul_triton(gate, up)
    return silu_and_mul_reference(gate, up)


def silu_and_mul_rounded(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(silu(gate) * up, its rows rounded to int8 as triton_dp4a.quantize_rows packs them, from the
    Triton kernel's same pass; None from the reference, whose products take float rows)."""
    if use_triton(gate, up) and not needs_grad(gate, up) and gate.dtype == up.dtype:
        from . import triton_activation
        return triton_activation.silu_and_mul_rounded_triton(gate, up)
    return silu_and_mul_reference(gate, up), None


def sigmoid_gate_reference(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(gate.reshape(x.shape)) * x


def sigmoid_gate(gate: torch.Tensor, x: torch.Tensor, rounded: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gate [T, heads, head_dim] (its heads may stride apart), x [T, heads * head_dim] ->
    (sigmoid(gate) * x, with `rounded` its rows rounded to int8 from the Triton kernel's same pass;
    None from the reference, whose products take float rows)."""
    if use_triton(gate, x) and not needs_grad(gate, x) and gate.dtype == x.dtype and gate.stride(-1) == 1:
        from . import triton_activation
        return triton_activation.sigmoid_gate_triton(gate, x, rounded)
    return sigmoid_gate_reference(gate, x), None
