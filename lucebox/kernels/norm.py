"""RMSNorm, and RMSNorm fused with the residual add that precedes it in every decoder layer.

    h = rms_norm(x, weight, eps)
    h, residual = rms_norm_residual(x, residual, weight, eps)
    # == (rms_norm(x + residual, weight, eps), x + residual)
    h, residual, rows = rms_norm_rounded(x, residual_or_None, weight, eps)
    # also h's rows rounded to int8 (triton_dp4a.quantize_rows' bytes), from the same launch
    stream = rms_norm_add(y, weight, eps, stream[, scale])   # == (stream + rms_norm(y, ...)) [* scale]
    outs, rows = rms_norm_many(x, weights, eps, rounded)   # rms_norm(x, weights[i]) for each i, one launch
    stream = rms_norm_pair_add(a, b, weights, eps, stream[, scale])
    # == (stream + rms_norm(rms_norm(a, w0) + rms_norm(b, w1), w2)) [* scale] (Gemma 4's MoE FFN output)

The references compute in float32 like HF's, cast back to the input dtype, then scale. GPU tensors
go to the Triton kernels in kernels/triton_norm.py (one pass over the row instead of three) through
kernels/dispatch.py -- except when autograd is recording: the kernels have no backward, and
train/lm.py trains through these same modules.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's v norm and router norm), in float32 like the others."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_residual_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x, weight) and not needs_grad(x, weight):
        from . import triton_norm
        return triton_norm.rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_add(x: torch.Tensor, weight: torch.Tensor, eps: float, addend: torch.Tensor,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """(addend + rms_norm(x)) [* scale]: a post-norm added to the residual stream (Gemma's sandwich
    norms), the layer's one-value scale after it."""
    if use_triton(x, weight, addend) and not needs_grad(x, weight, addend, scale):
        from . import triton_norm
        return triton_norm.rms_norm_add_triton(x, weight, eps, addend, scale)
    out = addend + rms_norm_reference(x, weight, eps)
    return out if scale is None else out * scale


def rms_norm_many(x: torch.Tensor, weights: torch.Tensor, eps: float, rounded: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([outputs, *x.shape]: rms_norm(x, weights[i]) for each row of weights [outputs, hidden], the
    first output's rows rounded to int8 or None): norms of one stream in one launch where Triton runs
    (rounded only there, as rms_norm_rounded)."""
    if use_triton(x, weights) and not needs_grad(x, weights):
        from . import triton_norm
        return triton_norm.rms_norm_many_triton(x, weights, eps, rounded)
    return torch.stack([rms_norm_reference(x, w, eps) for w in weights]), None


def rms_norm_pair_add(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor, eps: float, stream: torch.Tensor,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """(stream + rms_norm(rms_norm(a, weights[0]) + rms_norm(b, weights[1]), weights[2])) [* scale]:
    two branches' post-norms, their sum's post-norm and the residual add in one launch where Triton
    runs and the tensors share a dtype."""
    same = len({t.dtype for t in (a, b, stream, weights) + ((scale,) if scale is not None else ())}) == 1
    if same and use_triton(a, b, stream, weights) and not needs_grad(a, b, stream, weights, scale):
        from . import triton_norm
        return triton_norm.rms_norm_pair_add_triton(a, b, weights, eps, stream, scale)
    h = rms_norm_reference(a, weights[0], eps) + rms_norm_reference(b, weights[1], eps)
    out = stream + rms_norm_reference(h, weights[2], eps)
    return out if scale is None else out * scale


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if use_triton(x, residual, weight) and not needs_grad(x, residual, weight):
        from . import triton_norm
        return triton_norm.rms_norm_residual_triton(x, residual, weight, eps)
    return rms_norm_residual_reference(x, residual, weight, eps)


def rms_norm_rounded(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(h, x + residual or None, h's rows rounded to int8) with h = rms_norm(x [+ residual]): the
    rounded rows (triton_dp4a.quantize_rows' bytes) written by the Triton kernel in the same pass,
    for products on int8 activations; None from the reference, whose products take float rows."""
    if use_triton(x, residual, weight) and not needs_grad(x, residual, weight):
        from . import triton_norm
        return triton_norm.rms_norm_rounded_triton(x, residual, weight, eps)
    if residual is None:
        return rms_norm_reference(x, weight, eps), None, None
    return *rms_norm_residual_reference(x, residual, weight, eps), None
