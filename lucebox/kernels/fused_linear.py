"""Linear layers with the op before them fused in, for a single decode token.

    y, total = norm_linear(x, residual, norm_weight, eps, weight, bias)
    # == (F.linear(rms_norm(x + residual), weight, bias), x + residual); residual None: (.., x)
    y = silu_mul_linear(gate_up, weight, bias)
    # == F.linear(silu(gate) * up, weight, bias), gate_up = [gate | up]
    y = linear(x, weight, bias)   # F.linear

One row of float weights on the GPU runs the Triton GEMV of kernels/triton_gemv.py (one kernel
where the unfused ops take two or three, plus cuBLAS's split-K reductions); anything else (several
rows, quantised or CPU weights, autograd) takes the reference: the dispatching ops of norm.py and
activation.py, then F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import silu_and_mul
from .dispatch import use_triton
from .norm import needs_grad, rms_norm, rms_norm_residual


def fuses(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The Triton GEMV applies: one row, float weights of x's dtype (as every other operand)."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and weight.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(t.dtype == x.dtype for t in (weight, *others) if t is not None)
            and use_triton(x, weight, *others) and not needs_grad(x, weight, *others))


def norm_linear_reference(x, residual, norm_weight, eps: float, weight, bias=None):
    h, total = (rms_norm(x, norm_weight, eps), x) if residual is None else \
        rms_norm_residual(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), total


def silu_mul_linear_reference(gate_up, weight, bias=None):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(silu_and_mul(gate, up), weight, bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if fuses(x, weight, residual, norm_weight, bias):
        from . import triton_gemv
        y, total = triton_gemv.gemv(x, weight, bias, triton_gemv.NORM, residual, norm_weight, eps)
        return y, (total if residual is not None else x)
    return norm_linear_reference(x, residual, norm_weight, eps, weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if fuses(gate_up, weight, bias):
        from . import triton_gemv
        return triton_gemv.gemv(gate_up, weight, bias, triton_gemv.SILU_MUL)[0]
    return silu_mul_linear_reference(gate_up, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if fuses(x, weight, bias):
        from . import triton_gemv
        return triton_gemv.gemv(x, weight, bias)[0]
    return F.linear(x, weight, bias)
