"""Rotary position embedding (the rotate-half / NeoX layout HF checkpoints use), and RoPE fused
with the paged K/V cache write that follows it in every attention layer.

    q = rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    # == apply_rope(q, ...), after k_cache.write(apply_rope(k, ...)) and v_cache.write(v)

GPU tensors go to the Triton kernel in kernels/triton_rope_kv.py through kernels/dispatch.py
(bit-identical to the reference); CPU tensors, and anything autograd records, take the reference.
"""
import torch

from .dispatch import use_triton
from .norm import needs_grad


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] (already in x's dtype)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_and_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D]; cos/sin [T, D] in q's dtype; k_cache / v_cache are
    engine/kv_cache.PagedKVCache; slot_mapping [T]. Writes rotated k and v into their slots and
    returns rotated q."""
    k_cache.write(apply_rope(k, cos, sin), slot_mapping)
    v_cache.write(v, slot_mapping)
    return apply_rope(q, cos, sin)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache, v_cache, slot_mapping: torch.Tensor) -> torch.Tensor:
    if (use_triton(q, k, v, cos, sin, k_cache.values, v_cache.values, slot_mapping)
            and not needs_grad(q, k, v)):
        from . import triton_rope_kv
        return triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_and_write_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
