"""The linear ops the model calls: it says what to compute, routing.py's table picks the kernel.

    y = linear(x, projection)                                       # == projection(x)
    ys, stream = norm_linear(x, residual, norm_weight, eps, projections)
    # == tuple(p(rms_norm(x + residual)) for p in projections), x + residual; residual None: (.., x)
    h, stream, rows = norm_rows(x, residual, norm_weight, eps, projections)  # h kept, rows for linears
    y = silu_mul_linear(gate_up, projection)     # == projection(silu(gate) * up), gate_up = [gate | up]
    y = gelu_mul_linear(gate, up, projection)    # == projection(gelu_tanh(gate) * up) (Gemma)
    y = output_gate_linear(gate, x, projection, act)  # == projection(act(gate) * x), gated attention
    ys = linears(x, projections)                 # == tuple(p(x) for p in projections)

A projection is float weights (an nn.Linear exactly, or a FusedProjection), quantised rows (an
object with qweight, qtype, in_features, split_rows, bias and chunk_bytes, as weights.quant's
QuantLinear, or the bound forward of one), or any other module, which is called. Products of one
input on int8 activations share one rounding of it (triton_dp4a.quantize_rows' rows), passed
explicitly: made by the op that makes the input (the norm, silu * up, the gate) in the same launch, or by
the first product that takes it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import dequant, routing
from .activation import gelu_tanh_and_mul_rounded, output_gate, silu_and_mul, silu_and_mul_rounded
from .dispatch import use_triton
from .norm import rms_norm, rms_norm_residual, rms_norm_rounded
from .routing import DEQUANT_MATMUL, GEMV, GEMV_NORM, GEMV_SILU_MUL, INT8, QUANT_GEMV, QUANT_TILES, SPLIT_GEMV
from .split_rows import join_rows


class FusedProjection:
    """x -> F.linear(x, weight, bias) over float weights fused from several linears: a plain
    object, so its tensors are not counted as a module's parameters twice."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def float_weights(projection) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a float projection; None for others."""
    if type(projection) is nn.Linear or isinstance(projection, FusedProjection):
        return projection.weight, projection.bias
    return None


def quant_rows(projection):
    """The quantised module behind a projection (itself, or the owner of its bound forward), or None;
    None too for one whose forward transforms its input first (`transforms_input`): it is called."""
    module = getattr(projection, "__self__", projection)
    if getattr(module, "transforms_input", False):
        return None
    return module if hasattr(module, "qweight") and hasattr(module, "in_features") else None


def kernel_for(op: str, x: torch.Tensor, projection, *operands: torch.Tensor | None) -> str:
    """routing's kernel for projection's product of x within `op` (operands: the op's other
    tensors, e.g. the residual and norm weight, which a fused GEMV reads too)."""
    weights = float_weights(projection)
    if weights is not None:
        gemv = routing.float_gemv_applies(x, *weights, *operands)
        return routing.float_kernel(op, x.numel() // max(1, x.shape[-1]), gemv)
    q = quant_rows(projection)
    if q is None:
        return routing.TORCH
    return routing.quant_route(x, q.qweight, q.qtype, q.in_features, q.split_rows)


def takes_int8(projections, x: torch.Tensor) -> bool:
    """Whether any of these projections multiplies rows like x on int8 activations."""
    return any(kernel_for("products", x, p) in INT8 for p in projections)


def linear(x: torch.Tensor, projection) -> torch.Tensor:
    weights = float_weights(projection)
    if weights is None:
        return projection(x)
    if kernel_for("linear", x, projection) == GEMV:
        from . import triton_gemv
        return triton_gemv.gemv(x, *weights)[0]
    return F.linear(x, *weights)


def linears(x: torch.Tensor, projections, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Products of one input; `rows`: x rounded to int8 by its producer, if it was."""
    outs = []
    for projection in projections:
        kernel = kernel_for("products", x, projection)
        if kernel in INT8 and rows is None:  # rounded once, for every product of x that takes int8 rows
            from . import triton_dp4a
            rows = triton_dp4a.quantize_rows(x)
        q = quant_rows(projection)
        outs.append(projection(x) if q is None else
                    quant_linear(x, q, rows=rows if kernel in INT8 else None, kernel=kernel))
    return tuple(outs)


def norm_linear_reference(x, residual, norm_weight, eps: float, weight, bias=None):
    h, total = _norm(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), total


def _norm(x, residual, norm_weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return rms_norm(x, norm_weight, eps), x
    return rms_norm_residual(x, residual, norm_weight, eps)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                projections) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    weights = float_weights(projections[0]) if len(projections) == 1 else None
    if weights is not None:  # one float projection: the norm in its GEMV's prologue where it can be
        if kernel_for("norm_linear", x, projections[0], residual, norm_weight) == GEMV_NORM:
            from . import triton_gemv
            y, total = triton_gemv.gemv(x, *weights, triton_gemv.NORM, residual, norm_weight, eps)
            return (y,), (total if residual is not None else x)
        y, stream = norm_linear_reference(x, residual, norm_weight, eps, *weights)
        return (y,), stream
    h, stream, rows = norm_rows(x, residual, norm_weight, eps, projections)
    return linears(h, projections, rows), stream


def norm_rows(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              projections) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual), x + residual (x when residual is None), the normalised rows rounded
    to int8 by the norm's own launch where one of these projections takes int8 rows, else None)."""
    if takes_int8(projections, x):
        h, total, rows = rms_norm_rounded(x, residual, norm_weight, eps)
        return h, (x if residual is None else total), rows
    h, stream = _norm(x, residual, norm_weight, eps)
    return h, stream, None


def silu_mul_linear_reference(gate_up, weight, bias=None):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(silu_and_mul(gate, up), weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, projection) -> torch.Tensor:
    weights = float_weights(projection)
    if weights is not None:
        if kernel_for("silu_mul_linear", gate_up, projection) == GEMV_SILU_MUL:
            from . import triton_gemv
            return triton_gemv.gemv(gate_up, *weights, triton_gemv.SILU_MUL)[0]
        return silu_mul_linear_reference(gate_up, *weights)
    gate, up = gate_up.chunk(2, dim=-1)
    if takes_int8((projection,), gate):  # silu * up's launch rounds its output too
        h, rows = silu_and_mul_rounded(gate, up)
        return linears(h, (projection,), rows)[0]
    return projection(silu_and_mul(gate, up))


def gelu_mul_linear(gate: torch.Tensor, up: torch.Tensor, projection) -> torch.Tensor:
    """projection(gelu_tanh(gate) * up) (Gemma's GeGLU); the activation's launch rounds its output to
    int8 too where the product takes int8 rows."""
    h, rows = gelu_tanh_and_mul_rounded(gate, up, rounded=takes_int8((projection,), gate))
    return linear(h, projection) if rows is None else linears(h, (projection,), rows)[0]


def output_gate_linear(gate: torch.Tensor, x: torch.Tensor, projection, act: str) -> torch.Tensor:
    """projection(act(gate) * x), gate [T, heads, head_dim], x [T, heads * head_dim], act a key of
    activation.OUTPUT_GATES: the gate's launch rounds its output to int8 too where the product takes
    int8 rows."""
    h, rows = output_gate(gate, x, act, rounded=takes_int8((projection,), x))
    return linear(h, projection) if rows is None else linears(h, (projection,), rows)[0]


def stored_order_linear(x: torch.Tensor, module, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A transforms_input module's raw rows times x already in its stored input order (the module's
    own transform skipped); rows: x rounded to int8, used where the product takes int8 rows."""
    kernel = routing.quant_route(x, module.qweight, module.qtype, module.in_features, module.split_rows)
    return quant_linear(x, module, rows=rows if kernel in INT8 else None, kernel=kernel)


def stored_order_takes_int8(x: torch.Tensor, module) -> bool:
    """Whether stored_order_linear(x, module) multiplies on int8 rows."""
    return routing.quant_route(x, module.qweight, module.qtype, module.in_features, module.split_rows) in INT8


def quant_linear(x: torch.Tensor, q, *, rows: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """x times a quantised module's rows (+ its bias); rows: x rounded to int8, if it was."""
    return quant_matmul(x, q.qweight, q.qtype, q.in_features, q.bias, q.chunk_bytes, q.split_rows,
                        rows=rows, kernel=kernel)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype, in_features: int,
                 bias: torch.Tensor | None = None, chunk_bytes: int = 32 << 20, split_rows: bool = False, *,
                 rows: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for raw GGUF rows `qweight` [out_features, bytes_per_row] (split_rows: in
    the split layout), by routing's kernel (or `kernel`, decided already). rows: x rounded to int8
    (int8 kernels only). DEQUANT_MATMUL dequantises `chunk_bytes` (float32-equivalent) worth of
    output rows at a time."""
    kernel = kernel or routing.quant_route(x, qweight, qtype, in_features, split_rows)
    if kernel in INT8:
        from . import triton_quant_int8
        return triton_quant_int8.matmul(x, qweight, qtype, split_rows, in_features, bias, quantized=rows,
                                        runs=routing.runs_kernel(qtype, split_rows))
    if kernel == SPLIT_GEMV:
        from . import triton_split_rows
        return triton_split_rows.gemv(x, qweight, qtype, in_features, bias)
    if kernel in (QUANT_GEMV, QUANT_TILES):
        from . import triton_quant_matmul
        return triton_quant_matmul.quant_matmul(x, qweight, qtype, in_features, bias, split_rows=split_rows)
    assert kernel == DEQUANT_MATMUL, kernel
    out_features = qweight.shape[0]
    bias = None if bias is None else bias.to(x.dtype)
    chunk = dequant_chunk_rows(chunk_bytes, in_features, x.device)
    if chunk >= out_features:
        return F.linear(x, dequantize_rows(qweight, qtype, in_features, x.dtype, split_rows), bias)
    out = x.new_empty(*x.shape[:-1], out_features)
    for start in range(0, out_features, chunk):
        w = dequantize_rows(qweight[start:start + chunk], qtype, in_features, x.dtype, split_rows)
        out[..., start:start + chunk] = F.linear(x, w)
    if bias is not None:
        out += bias
    return out


# On a GPU each dequantised chunk is three launches (graph nodes in a prefill bucket) and a transient of
# at most half this (16-bit values): whole projections but an LM head, however small chunk_bytes is.
GPU_DEQUANT_BYTES = 256 << 20


def dequant_chunk_rows(chunk_bytes: int, in_features: int, device: torch.device) -> int:
    """Output rows dequantised at a time: chunk_bytes (float32-equivalent) of them; on a GPU at least
    GPU_DEQUANT_BYTES."""
    if device.type != "cpu":
        chunk_bytes = max(chunk_bytes, GPU_DEQUANT_BYTES)
    return max(1, chunk_bytes // (4 * in_features))


def dequantize_rows(qweight: torch.Tensor, qtype, in_features: int, dtype: torch.dtype,
                    split_rows: bool = False) -> torch.Tensor:
    """Raw GGUF rows (or split rows) -> [rows, in_features] in dtype: Triton's dequantiser where
    it reads them in place, else the torch reference."""
    if use_triton(qweight):
        from . import triton_quant_matmul
        if triton_quant_matmul.supports(qweight, qtype):
            return triton_quant_matmul.dequantize(qweight, qtype, in_features, dtype, split_rows=split_rows)
    if split_rows:
        qweight = join_rows(qweight, qtype)
    return dequant.dequantize(qweight, qtype, dtype)
