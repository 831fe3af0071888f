"""Rotary position embedding (the rotate-half / NeoX layout HF checkpoints use), and RoPE fused
with the paged K/V cache write that follows it in every attention layer.

    q = rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm=None)
    # == apply_rope(q, ...), after k_cache.write(apply_rope(k, ...)) and v_cache.write(v);
    # qk_norm (q weight, k weight, eps): q and k are RMS-normalised per head first (Qwen3);
    # v_norm_eps: v normalised per head without a weight first (Gemma 4)

GPU tensors go to the Triton kernel in kernels/triton_rope_kv.py through kernels/dispatch.py
(bit-identical to the reference; with qk_norm, within the norm's last-bit rounding); CPU tensors,
and anything autograd records, take the reference.
"""
import torch

from .dispatch import use_triton
from .norm import needs_grad, rms_norm_reference, unit_rms_norm

QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight, k weight, eps) of a per-head RMSNorm


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim] (already in x's dtype): the first rotary_dim
    dims of each head turned, the rest kept (partial rotary; rotary_dim == head_dim turns all)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_and_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor,
                                qk_norm: QKNorm | None = None, v_norm_eps: float | None = None) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D]; cos/sin [T, rotary_dim <= D] in q's dtype; k_cache / v_cache are
    model/kv_cache.PagedKVCache; slot_mapping [T]; qk_norm: (q weight, k weight, eps) of an
    RMSNorm over each head applied to q and k first (Qwen3); v_norm_eps: v normalised per head
    without a weight first (Gemma 4). Writes rotated k and v into their slots and returns rotated q."""
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        q, k = rms_norm_reference(q, q_w, eps), rms_norm_reference(k, k_w, eps)
    if v_norm_eps is not None:
        v = unit_rms_norm(v, v_norm_eps)
    k_cache.write(apply_rope(k, cos, sin), slot_mapping)
    v_cache.write(v, slot_mapping)
    return apply_rope(q, cos, sin)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache, v_cache, slot_mapping: torch.Tensor, qk_norm: QKNorm | None = None,
                      v_norm_eps: float | None = None) -> torch.Tensor:
    norm_w = qk_norm[:2] if qk_norm is not None else ()
    if (use_triton(q, k, v, cos, sin, k_cache.values, v_cache.values, slot_mapping, *norm_w)
            and not needs_grad(q, k, v, *norm_w)):
        from . import triton_rope_kv
        return triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm,
                                                v_norm_eps)
    return rope_and_write_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm, v_norm_eps)
