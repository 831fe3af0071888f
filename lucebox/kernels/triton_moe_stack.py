"""Stacked expert weights as triton_moe's kernels read them (float rows or GGUF rows in place), and
the checks and launch constants their launches share."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .triton_quant_matmul import DECODE_LAUNCH, unit_layout

FLOAT = -1  # the format id of float weights (quantised formats: triton_quant_matmul's ids)
# The experts' gated activation (model/moe.ACTIVATIONS' names) -> the kernels' ACT constant.
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


@dataclass(frozen=True)
class Stack:
    """Stacked expert weights as the kernels read them: `rows` [E * N, row_len] (elements of float
    weights, bytes of GGUF rows), K values a row, and the unit constants of unit_product (float: P
    columns a unit)."""
    rows: torch.Tensor
    experts: int
    out_features: int
    in_features: int
    fmt: int
    unit_bytes: int = 0
    unit_values: int = 0
    bpu: int = 1
    plane: int = 0
    n_units: int = 0

    def with_plane(self, plane: int) -> Stack:
        """Float weights in units of `plane` columns; quantised ones keep their format's."""
        if self.fmt != FLOAT:
            return self
        return Stack(self.rows, self.experts, self.out_features, self.in_features, FLOAT, 0, plane, 1, plane,
                     triton.cdiv(self.in_features, plane))


def float_stack(weight: torch.Tensor) -> Stack:
    """Float experts [E, N, K] (contiguous)."""
    experts, n, k = weight.shape
    return Stack(weight.view(experts * n, k), experts, n, k, FLOAT)


def quant_stack(data: torch.Tensor, qtype, shape: tuple[int, int, int]) -> Stack:
    """GGUF rows [E * N, row_bytes] of experts of logical shape (E, N, K)."""
    experts, n, k = shape
    fmt, unit_bytes, unit_values, bpu, plane, n_units = unit_layout(qtype, k)
    return Stack(data, experts, n, k, fmt, unit_bytes, unit_values, bpu, plane, n_units)


def consts(stack: Stack) -> dict:
    return {"FMT": stack.fmt, "UNIT_BYTES": stack.unit_bytes, "UNIT_VALUES": stack.unit_values, "BPU": stack.bpu,
            "P": stack.plane}


def check_operands(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Stack, down: Stack,
           activation: str) -> int:
    """The intermediate size, after checking that the operands fit together."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"the expert kernels have no activation {activation!r} (they have {sorted(ACTIVATIONS)})")
    inter = down.in_features
    if (gate_up.experts != down.experts or gate_up.out_features != 2 * inter or gate_up.in_features != x.shape[-1]
            or down.out_features != x.shape[-1]):
        raise ValueError(f"experts do not fit: gate_up ({gate_up.experts}, {gate_up.out_features}, "
                         f"{gate_up.in_features}), down ({down.experts}, {down.out_features}, {down.in_features}), "
                         f"x {tuple(x.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"routes do not fit: ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, x {tuple(x.shape)}")
    return inter


def check_shared_pair(gate_up: Stack, down: Stack, shared_gate_up: Stack, shared_down: Stack) -> None:
    """A shared expert read as one more pair: one expert of the experts' formats and sizes."""
    for name, stack, shared in (("gate_up", gate_up, shared_gate_up), ("down", down, shared_down)):
        if (shared.experts, shared.out_features, shared.in_features, shared.fmt, shared.rows.shape[1]) != (
                1, stack.out_features, stack.in_features, stack.fmt, stack.rows.shape[1]):
            raise ValueError(f"the shared expert's {name} ({shared.experts}, {shared.out_features}, "
                             f"{shared.in_features}) format {shared.fmt} does not fit the experts' "
                             f"({stack.out_features}, {stack.in_features}) format {stack.fmt}")


def decode_launch(stack: Stack, block_n: int | None, num_warps: int | None) -> tuple[int, int]:
    """(BLOCK_N, warps) of a pairs kernel: given, else the dense one-row GEMV's per format (GGUF rows)."""
    default = (32, 4) if stack.fmt == FLOAT else DECODE_LAUNCH.get(stack.fmt, (32, 4))
    return block_n or default[0], num_warps or default[1]
