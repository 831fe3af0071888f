"""The expert products of a sparse MoE layer (model/moe.py's Experts): which kernel runs them, and
the launch. The torch reference is Experts' own (it gathers or groups the routed experts).

    kernel = expert_kernel(x, ids, gate_up, down, "silu")  # routing.TORCH: the caller's reference runs
    out = expert_matmul(x, ids, weights, gate_up, down, kernel)
    # == sum over j of weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j]
    out = expert_matmul(x, ids, weights, gate_up, down, kernel, activation="gelu_pytorch_tanh",
                        weights_on_input=True)
    # == sum over j of down_e(gelu_tanh(gate_e(w x[t])) * up_e(w x[t])), w = weights[t, j]

Stacked experts are float tensors [E, out, in] or quantised ones: any object with `data` (raw GGUF
rows [E * out, bytes a row]), `qtype` and `shape` (E, out, in), as weights.quant's QuantTensor.
gate_up holds each expert's gate rows then its up rows ([E, 2I, H]); down is [E, H, I].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import routing
from .dispatch import use_triton
from .norm import needs_grad

# The gated activations the kernels fuse (triton_moe.ACTIVATIONS; named here without importing Triton).
KERNEL_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _tensor(w) -> torch.Tensor:
    """The tensor holding stacked experts' values (float) or bytes (quantised)."""
    return w if isinstance(w, torch.Tensor) else w.data


def _readable(x: torch.Tensor, w) -> bool:
    """Triton's expert kernels can read these stacked experts in place for activations x."""
    if isinstance(w, torch.Tensor):
        return w.dim() == 3 and w.dtype == x.dtype and w.is_contiguous()
    if len(getattr(w, "shape", ())) != 3 or not isinstance(getattr(w, "data", None), torch.Tensor):
        return False
    from . import triton_quant_matmul
    return triton_quant_matmul.supports(w.data, w.qtype)


def expert_kernel(x: torch.Tensor, ids: torch.Tensor, gate_up, down, activation: str = "silu") -> str:
    """routing's kernel for x [T, H] routed to ids [T, k] through these experts with this gated
    activation (a name of model/moe.ACTIVATIONS)."""
    operands = (x, ids, _tensor(gate_up), _tensor(down))
    fused = (activation in KERNEL_ACTIVATIONS and x.dim() == 2 and x.dtype in routing.ACTIVATION_DTYPES and use_triton(*operands)
             and not needs_grad(*operands) and _readable(x, gate_up) and _readable(x, down))
    return routing.moe_kernel(x.shape[0], fused)


def route_experts(logits: torch.Tensor, top_k: int, *, softmax: bool, softcap: float, bias: torch.Tensor | None,
                  norm: bool, dtype: torch.dtype, expert_scale: torch.Tensor | None = None,
                  shared: str | None = None, routed_scale: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A router's (expert ids [T, k], weights [T, k] in dtype) of its logits [T, E] in one Triton kernel
    (triton_moe_route) where Triton runs on them; None: the caller's torch reference (Routing.choose,
    Gemma4Router). expert_scale [E]: each chosen weight times its expert's entry, last (Gemma 4).
    shared ("gated": logits [T, E + 1] end with the shared expert's gate; "ungated"): a (k+1)-th route
    to the shared expert, id E (triton_moe_route.route)."""
    if not (logits.dim() == 2 and logits.dtype in routing.ACTIVATION_DTYPES and use_triton(logits, bias, expert_scale)
            and not needs_grad(logits)):
        return None
    from . import triton_moe_route
    return triton_moe_route.route(logits, top_k, softmax=softmax, softcap=softcap, bias=bias, norm=norm, dtype=dtype,
                                  expert_scale=expert_scale, shared=shared, routed_scale=routed_scale)


@dataclass(frozen=True)
class Shared:
    """A MoE's shared expert, added to the routed experts' sum: out = scale * routed + value, or with a
    gate logit [T, 1], + sigmoid(gate) * value (value [T, H])."""
    value: torch.Tensor
    gate: torch.Tensor | None = None
    scale: float = 1.0  # the routed experts' scaling factor (routing.routed_scaling_factor)


def add_shared(out: torch.Tensor, shared: Shared) -> torch.Tensor:
    """The routed experts' out combined with the shared expert, in torch (the reference's ops)."""
    if shared.scale != 1.0:
        out = out * shared.scale
    if shared.gate is None:
        return out + shared.value
    return out + torch.sigmoid(shared.gate) * shared.value


def stacked(w):
    """triton_moe's view of stacked experts (float or quantised)."""
    from . import triton_moe
    if isinstance(w, torch.Tensor):
        return triton_moe.float_stack(w)
    return triton_moe.quant_stack(w.data, w.qtype, tuple(w.shape))


def expert_matmul(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
                  kernel: str | None = None, *, activation: str = "silu",
                  weights_on_input: bool = False, shared: Shared | None = None,
                  shared_pair: tuple | None = None) -> torch.Tensor:
    """out [T, H] for x [T, H] routed to experts ids [T, k] with weights [T, k], by routing's kernel
    (or `kernel`, decided already; not TORCH). weights_on_input: each expert reads weight * x and
    the experts' outputs are summed unweighted. shared: the shared expert to combine with (by the
    decode kernels' last launch); shared_pair: its (gate_up, down) as stacks of one expert, routed
    as expert E by the ids (the pairs kernel only)."""
    kernel = kernel or expert_kernel(x, ids, gate_up, down, activation)
    from . import triton_moe
    options = {"activation": activation, "weights_on_input": weights_on_input}
    if shared_pair is not None and kernel != routing.MOE_PAIRS:
        raise ValueError(f"a shared expert routed as a pair runs in the pairs kernel, not {kernel!r}")
    if kernel == routing.MOE_PAIRS:
        pair = None if shared_pair is None else (stacked(shared_pair[0]), stacked(shared_pair[1]))
        return triton_moe.pairs_experts(x, ids, weights, stacked(gate_up), stacked(down), shared=shared,
                                        shared_pair=pair, **options)
    if kernel == routing.MOE_GROUPED:
        out = triton_moe.grouped_experts(x, ids, weights, stacked(gate_up), stacked(down), **options)
        return out if shared is None else add_shared(out, shared)
    raise ValueError(f"expert_matmul runs the Triton kernels, not {kernel!r} (the torch reference is Experts')")
