"""The gated activation of the MLP, silu(gate) * up, and the output gates of gated attention.

    h = silu_and_mul(gate, up)   # == F.silu(gate) * up (gelu_tanh_and_mul likewise, Gemma)
    h, rows = silu_and_mul_rounded(gate, up)   # also h's rows rounded to int8, from the same launch
    h, rows = output_gate(gate, x, act, rounded)   # == act(gate) * x, gate [T, heads, head_dim]

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


def gelu_tanh_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) (tanh approximation, Gemma's GeGLU) * up, gate and up as silu_and_mul's."""
    return gelu_tanh_and_mul_rounded(gate, up, rounded=False)[0]


def gelu_tanh_and_mul_rounded(gate: torch.Tensor, up: torch.Tensor, rounded: bool = True
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gelu_tanh(gate) * up, with `rounded` its rows rounded to int8 from the Triton kernel's same
    pass; None from the reference)."""
    if use_triton(gate, up) and not needs_grad(gate, up) and gate.dtype == up.dtype:
        from . import triton_activation
        return triton_activation.gated_act_triton(gate, up, "gelu_tanh", rounded)
    return gelu_tanh_and_mul_reference(gate, up), None


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


# Output gates by name: act(gate) in float32, rounded to the gate's dtype (Qwen 3.5: sigmoid, Laguna: softplus)
OUTPUT_GATES = {"sigmoid": lambda g: torch.sigmoid(g),
                "softplus": lambda g: F.softplus(g.float()).to(g.dtype)}


def output_gate_reference(gate: torch.Tensor, x: torch.Tensor, act: str) -> torch.Tensor:
    return OUTPUT_GATES[act](gate).reshape(x.shape) * x


def output_gate(gate: torch.Tensor, x: torch.Tensor, act: str, rounded: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gate [T, heads, head_dim] (any strides: heads apart, or one value a head expanded), x [T,
    heads * head_dim], act a key of OUTPUT_GATES -> (act(gate) * x, with `rounded` its rows rounded
    to int8 from the Triton kernel's same pass; None from the reference, whose products take float
    rows)."""
    if use_triton(gate, x) and not needs_grad(gate, x) and gate.dtype == x.dtype:
        from . import triton_activation
        return triton_activation.output_gate_triton(gate, x, act, rounded)
    return output_gate_reference(gate, x, act), None
