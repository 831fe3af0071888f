"""Triton silu(gate) * up and gelu_tanh(gate) * up, and the output gates act(gate) * x of gated attention (sigmoid: Qwen 3.5,
softplus: Laguna) (reference and dispatch: kernels/activation.py).

One pass over the row: gate and up are read once, the activation stays in registers. Rounding
follows torch's two elementwise kernels: the activation is computed in float32 and rounded to the
input dtype, then the product is computed in float32 and rounded. The exponential may differ from
torch's in the last bit.

An output gate of per-head rows [T, heads, head_dim] may stride over heads (Qwen 3.5's sits beside
each head's query in one projection) or not along head_dim (Laguna's one value a head, expanded): it
is read in place, where a flat row would be a copy.
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, pdl_launch

SILU, SIGMOID, SOFTPLUS, GELU_TANH = 0, 1, 2, 3
GATED_ACTS = {"silu": SILU, "gelu_tanh": GELU_TANH}
OUTPUT_GATES = {"sigmoid": SIGMOID, "softplus": SOFTPLUS}
BLOCK = 1024


@functools.cache
def _kernel():
    """Defined on first use: importing this module must not import Triton (see triton_norm)."""
    global triton, tl, wait_for_previous_kernel, store_rounded
    import triton
    import triton.language as tl

    from .triton_dp4a import store_rounded
    from .triton_pdl import wait_for_previous_kernel

    @triton.jit
    def _act_mul_kernel(gate, up, out, q_ptr, n, head, stride_g, stride_gh, stride_gd, stride_u, stride_o,
                        stride_q, BLOCK_N: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr = False,
                        PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < n
        g = tl.load(gate + row * stride_g + (cols // head) * stride_gh + (cols % head) * stride_gd, mask=ok,
                    other=0.0)
        u = tl.load(up + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
        ty = g.dtype
        g = g.to(tl.float32)
        if ACT == 0:  # SILU
            s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
        elif ACT == 1:  # SIGMOID
            s = (1.0 / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
        elif ACT == 2:  # SOFTPLUS (torch's threshold 20)
            s = tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(tl.minimum(g, 20.0)))).to(ty).to(tl.float32)
        else:  # GELU_TANH: 0.5 g (1 + tanh(y)) == g * sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3)
            z = 1.5957691216057308 * (g + 0.044715 * g * g * g)
            s = (g / (1.0 + tl.exp(-z))).to(ty).to(tl.float32)
        h = (s * u).to(ty)
        tl.store(out + row * stride_o + cols, h, mask=ok)
        if ROUND:  # the output rounded to int8 too, for products on int8 activations
            b = tl.program_id(1) * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            store_rounded(q_ptr + row * stride_q, tl.reshape(h.to(tl.float32), [BLOCK_N // 32, 32]), b,
                           b < n // 32, n // 32)

    return _act_mul_kernel


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gated_act_triton(gate, up, "silu")[0]


def silu_and_mul_rounded_triton(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up, its rows rounded to int8 as triton_dp4a.quantize_rows packs them) in one launch."""
    return gated_act_triton(gate, up, "silu", rounded=True)


def gated_act_triton(gate: torch.Tensor, up: torch.Tensor, act: str, rounded: bool = False):
    """(act(gate) * up for act a key of GATED_ACTS, with `rounded` its rows rounded to int8 as
    triton_dp4a.quantize_rows packs them, else None) in one launch."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{act} and mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} differ")
    g2 = _rows(gate)
    out, packed = _launch(g2, g2.stride(0), g2.shape[-1], 0, 1, _rows(up), GATED_ACTS[act], rounded)
    return out.reshape(gate.shape), packed


def output_gate_triton(gate: torch.Tensor, x: torch.Tensor, act: str, rounded: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gate [T, heads, head_dim] (any strides: heads apart, or one value a head expanded), x [T,
    heads * head_dim] of its dtype, act a key of OUTPUT_GATES -> (act(gate) * x [T, heads *
    head_dim], with `rounded` its rows rounded to int8 as well, else None) in one launch."""
    tokens, heads, head = gate.shape
    if x.shape != (tokens, heads * head) or x.dtype != gate.dtype or act not in OUTPUT_GATES:
        raise ValueError(f"output gate {act!r}: gate {tuple(gate.shape)} {gate.dtype} does not gate x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _launch(gate, gate.stride(0), head, gate.stride(1), gate.stride(2), _rows(x), OUTPUT_GATES[act], rounded)


def _launch(gate, stride_g: int, head: int, stride_gh: int, stride_gd: int, up: torch.Tensor, act: int,
            rounded: bool):
    """act(gate) * up over rows of up [M, n]; a row's gate value of column c lies at
    gate + row * stride_g + (c // head) * stride_gh + (c % head) * stride_gd."""
    n = up.shape[-1]
    if rounded and n % 256:
        raise ValueError(f"gated activation: rows rounded to int8 need a multiple of 256 values, got {n}")
    out = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    packed = None
    if rounded:
        from .triton_dp4a import rounded_rows_like
        packed = rounded_rows_like(out)
    if out.numel():
        block = min(BLOCK, next_pow2(n))
        q = packed if packed is not None else out
        _kernel()[(up.shape[0], -(-n // block))](gate, up, out, q, n, head, stride_g, stride_gh, stride_gd, up.stride(0),
                                                 out.stride(0), q.stride(0), BLOCK_N=block, ACT=act, ROUND=rounded,
                                                 num_warps=4, enable_fp_fusion=False, **pdl_launch(out.device))
    return out, packed
