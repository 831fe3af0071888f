"""Quantised GGUF weights that stay quantised in memory, and the linear / embedding layers using them.

A `QuantTensor` keeps the raw GGUF blocks (uint8, one row of blocks per output feature); a
`QuantLinear` dequantises a few rows at a time inside `forward`, so a large matrix never exists in
float form; a `QuantEmbedding` dequantises only the rows a batch looks up. All dequantisation
goes through `lucebox.kernels.dequant` so a faster kernel can be dispatched there.
"""
from __future__ import annotations

import contextlib
import math
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from lucebox.errors import CheckpointError, UnsupportedError
from lucebox.kernels import dequant
from lucebox.kernels.dequant import SUPPORTED_TYPES, qtype_name
from lucebox.kernels.dispatch import int8_activations, use_triton

__all__ = ["SUPPORTED_TYPES", "QuantEmbedding", "QuantLinear", "QuantTensor", "one_rounding", "quant_matmul",
           "takes_int8"]


def _check_type(qtype, name: str) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        pass
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedError(
            f"tensor {name!r} has GGUF type {qtype_name(qtype)}, which lucebox cannot load; "
            f"supported types: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))} "
            f"(re-quantise the model, e.g. with llama.cpp's llama-quantize)")
    return qtype


def _row_bytes(qtype: GGMLQuantizationType, in_features: int, name: str) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if in_features % block_size:
        raise CheckpointError(f"tensor {name!r}: row length {in_features} is not a multiple of the "
                              f"{qtype.name} block size {block_size}")
    return in_features // block_size * type_size


@dataclass(frozen=True, eq=False)  # eq would compare tensors elementwise
class QuantTensor:
    """Raw GGUF bytes `data` [rows, bytes_per_row] of a tensor whose logical shape is `shape`
    (outermost first, e.g. (out_features, in_features); rows = product of all but the last)."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "qtype", _check_type(self.qtype, self.name))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.shape:
            raise CheckpointError(f"tensor {self.name!r} has no dimensions")
        expected = (math.prod(self.shape[:-1]), _row_bytes(self.qtype, self.shape[-1], self.name))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise CheckpointError(
                f"tensor {self.name!r} ({self.qtype.name}, shape {self.shape}) should hold "
                f"{expected[0]} rows of {expected[1]} bytes, found {self.data.dtype} "
                f"{tuple(self.data.shape)}; the file is corrupt or does not match its header")

    @classmethod
    def from_numpy(cls, array: np.ndarray, qtype, gguf_shape, name: str = "") -> QuantTensor:
        """Build from `GGUFReader` output: `array` is a tensor's `.data` and `gguf_shape` its
        `.shape`, which GGUF lists innermost first (in_features, out_features)."""
        qtype = _check_type(qtype, name)
        shape = tuple(int(d) for d in reversed(list(gguf_shape)))
        if not shape:
            raise CheckpointError(f"tensor {name!r} has no dimensions")
        row_bytes = _row_bytes(qtype, shape[-1], name)
        # F32/F16 arrive as float arrays; their bytes are the GGUF blocks.
        raw = np.ascontiguousarray(array).view(np.uint8) if array.ndim else array
        if raw.ndim == 0 or raw.shape[-1] != row_bytes or raw.size != math.prod(shape[:-1]) * row_bytes:
            raise CheckpointError(
                f"tensor {name!r} ({qtype.name}, shape {shape}) should have {row_bytes} bytes per "
                f"row, found data of shape {tuple(raw.shape)}; the file is corrupt or truncated")
        with warnings.catch_warnings():
            # The reader hands out read-only memory maps; copying is what torch would want anyway.
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.array(raw.reshape(-1, row_bytes), copy=True))
        return cls(data, qtype, shape, name)

    @classmethod
    def from_reader_tensor(cls, tensor) -> QuantTensor:
        """Build from a `gguf.GGUFReader` `ReaderTensor`."""
        return cls.from_numpy(tensor.data, tensor.tensor_type, tensor.shape, tensor.name)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> QuantTensor:
        return QuantTensor(self.data.to(device), self.qtype, self.shape, self.name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequant.dequantize(self.data, self.qtype, dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return (f"QuantTensor({self.name!r}, {self.qtype.name}, shape={self.shape}, "
                f"nbytes={self.nbytes}, device={self.device})")


def _triton_quant(x: torch.Tensor, qweight: torch.Tensor, qtype):
    """The Triton quantised-weight module when it should handle this call (GPU), else None."""
    if not use_triton(x, qweight):
        return None
    from lucebox.kernels import triton_quant_matmul
    return triton_quant_matmul if triton_quant_matmul.supports(qweight, qtype) else None


def _dequantize_rows(rows: torch.Tensor, qtype, in_features: int, dtype: torch.dtype,
                     split_rows: bool = False) -> torch.Tensor:
    tq = _triton_quant(rows, rows, qtype)
    if tq is not None:
        return tq.dequantize(rows, qtype, in_features, dtype, split_rows=split_rows)
    if split_rows:
        from lucebox.kernels.triton_split_rows import join_rows
        rows = join_rows(rows, qtype)
    return dequant.dequantize(rows, qtype, dtype)


_rounding = threading.local()  # .shared: [input tensor, its int8 rows or None] within one_rounding


@contextlib.contextmanager
def one_rounding(x: torch.Tensor, rows: torch.Tensor | None = None):
    """Within it, the products of `x` itself (the same tensor object) that run on int8 activations
    share one rounding of it (e.g. q, k and v of one input when their weights differ in type): `rows`
    when its producer wrote them (kernels.norm.rms_norm_rounded, activation.silu_and_mul_rounded),
    else one quantising launch at the first product instead of one a product. x must not change
    inside."""
    previous = getattr(_rounding, "shared", None)
    _rounding.shared = [x, rows]
    try:
        yield
    finally:
        _rounding.shared = previous


def _rounded_once(x: torch.Tensor) -> torch.Tensor | None:
    """x's int8 rows when a one_rounding block shares them (quantised on first use), else None."""
    shared = getattr(_rounding, "shared", None)
    if shared is None or shared[0] is not x:
        return None
    if shared[1] is None:
        from lucebox.kernels.triton_dp4a import quantize_rows
        shared[1] = quantize_rows(x)
    return shared[1]


def _int8_faster(qtype, split_rows: bool, rows: int) -> bool:
    """Whether a fused product of `rows` rows (on the GPU) takes int8 activations."""
    if not int8_activations():
        return False
    from lucebox.kernels import triton_quant_int8
    return triton_quant_int8.faster(qtype, split_rows, rows)


def _on_int8(x: torch.Tensor, qweight: torch.Tensor, qtype, in_features: int, split_rows: bool) -> bool:
    """Whether quant_matmul multiplies x by these rows on int8 activations."""
    tq = _triton_quant(x, qweight, qtype)
    m = x.numel() // max(1, in_features)
    return (tq is not None and x.dtype in tq.ACTIVATION_DTYPES and m <= tq.MAX_FUSED_M
            and _int8_faster(qtype, split_rows, m))


def takes_int8(projections, x: torch.Tensor) -> bool:
    """Whether any of these projections (QuantLinears, or the forward of a fused one) multiplies rows
    like x on int8 activations: then x's producer may round it in the same launch (one_rounding)."""
    for projection in projections:
        m = getattr(projection, "__self__", projection)
        if isinstance(m, QuantLinear) and _on_int8(x, m.qweight, m.qtype, m.in_features, m.split_rows):
            return True
    return False


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                 bias: torch.Tensor | None = None, chunk_bytes: int = 32 << 20,
                 split_rows: bool = False) -> torch.Tensor:
    """x @ W.T (+ bias) for raw GGUF rows `qweight` [out_features, bytes_per_row], dequantising
    `chunk_bytes` (float32-equivalent) worth of output rows at a time. split_rows: rows in the GPU's
    split layout (QuantLinear.split_rows).

    On the GPU a few rows of x (decode / verify, M <= 64) go through a fused Triton kernel that reads
    each weight byte once: on int8 activations where that is faster (kernels/triton_quant_int8.py:
    decode of Q4_K and split Q6_K, verify of split Q8_0; LUCEBOX_INT8_ACTIVATIONS=0 turns it off),
    else dequantising in registers; more rows (prefill) are compute-bound, so chunks are dequantised
    by a Triton kernel and multiplied by torch.matmul."""
    out_features = qweight.shape[0]
    tq = _triton_quant(x, qweight, qtype)
    m = x.numel() // max(1, in_features)
    if tq is not None and x.dtype in tq.ACTIVATION_DTYPES and m <= tq.MAX_FUSED_M:
        if _int8_faster(qtype, split_rows, m):  # the conditions above are _on_int8's other half
            from lucebox.kernels import triton_quant_int8
            return triton_quant_int8.matmul(x, qweight, qtype, split_rows, in_features, bias,
                                            quantized=_rounded_once(x))
        if split_rows and m == 1:
            from lucebox.kernels import triton_split_rows
            return triton_split_rows.gemv(x, qweight, qtype, in_features, bias)
        return tq.quant_matmul(x, qweight, qtype, in_features, bias, split_rows=split_rows)
    bias = None if bias is None else bias.to(x.dtype)
    rows = max(1, chunk_bytes // (4 * in_features))
    if rows >= out_features:
        return F.linear(x, _dequantize_rows(qweight, qtype, in_features, x.dtype, split_rows), bias)
    out = x.new_empty(*x.shape[:-1], out_features)
    for start in range(0, out_features, rows):
        w = _dequantize_rows(qweight[start:start + rows], qtype, in_features, x.dtype, split_rows)
        out[..., start:start + rows] = F.linear(x, w)
    if bias is not None:
        out += bias
    return out


class _SplitRows:
    """Q8_0 / Q6_K rows reordered for the GPU's decode kernels (kernels/triton_split_rows.py):
    `qweight` then holds each row's fields one after the other (Q8_0: values, then scales). For
    modules with `qweight`, `qtype` and `row_length`."""

    split_rows = False

    def _raw_rows(self) -> torch.Tensor:
        """qweight in ggml's layout."""
        if not self.split_rows:
            return self.qweight
        from lucebox.kernels.triton_split_rows import join_rows
        return join_rows(self.qweight, self.qtype)

    def splits_rows(self) -> bool:
        """Whether use_split_rows applies: weights that the Triton kernels read (the GPU), of a type and
        row length the split layout serves (triton_split_rows.applies)."""
        from lucebox.kernels.triton_split_rows import applies
        return applies(self.qtype, self.row_length) and use_triton(self.qweight)

    def use_split_rows(self, reorder: bool = True) -> None:
        """Rows in the GPU's split layout from now on: decode reads them with 16-byte loads (Q8_0 ~20%,
        Q6_K ~10% faster per 8B matrix on the H200; BENCHMARKS, eleventh and twelfth rounds).
        reorder=False: the bytes are split already (a row slice of a fused projection that was)."""
        if reorder:
            from lucebox.kernels.triton_split_rows import split_rows
            self.qweight.copy_(split_rows(self.qweight, self.qtype))
        self.split_rows = True


class QuantLinear(_SplitRows, torch.nn.Module):
    """y = x @ W.T (+ bias) with W kept quantised; dequantised `chunk_bytes` (float32-equivalent)
    worth of output rows at a time."""

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None = None,
                 chunk_bytes: int = 32 << 20):
        super().__init__()
        if len(weight.shape) != 2:
            raise CheckpointError(f"tensor {weight.name!r}: a linear weight must be 2-D, "
                                  f"got shape {weight.shape}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise CheckpointError(f"bias for {weight.name!r} has shape {tuple(bias.shape)}, "
                                  f"expected ({self.out_features},)")
        self.qtype = weight.qtype
        self.name = weight.name
        self.chunk_bytes = chunk_bytes
        self.register_buffer("qweight", weight.data)
        self.register_buffer("bias", bias)

    @property
    def row_length(self) -> int:
        return self.in_features

    @property
    def weight(self) -> QuantTensor:
        return QuantTensor(self._raw_rows(), self.qtype, (self.out_features, self.in_features), self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_matmul(x, self.qweight, self.qtype, self.in_features, self.bias, self.chunk_bytes,
                            self.split_rows)

    def extra_repr(self) -> str:
        return (f"{self.name!r}, in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, bias={self.bias is not None}, split_rows={self.split_rows}")


class QuantEmbedding(_SplitRows, torch.nn.Module):
    """Token embedding with the table kept quantised: a lookup dequantises only the rows it reads.

    With tied embeddings the same bytes are the LM head (`project`), so they are stored once."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype = torch.float32, chunk_bytes: int = 32 << 20):
        super().__init__()
        if len(weight.shape) != 2:
            raise CheckpointError(f"tensor {weight.name!r}: an embedding table must be 2-D, "
                                  f"got shape {weight.shape}")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.qtype = weight.qtype
        self.name = weight.name
        self.chunk_bytes = chunk_bytes
        self.register_buffer("qweight", weight.data)
        # Empty, but `module.to(dtype)` casts it, so lookups follow the model's float dtype the
        # way nn.Embedding's output follows its weight.
        self.register_buffer("_dtype_anchor", torch.empty(0, dtype=dtype, device=weight.device))

    @property
    def row_length(self) -> int:
        return self.embedding_dim

    @property
    def weight(self) -> QuantTensor:
        return QuantTensor(self._raw_rows(), self.qtype, (self.num_embeddings, self.embedding_dim), self.name)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype_anchor.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, ids.reshape(-1))
        values = _dequantize_rows(rows, self.qtype, self.embedding_dim, self.dtype, self.split_rows)
        return values.reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ table.T: the tied LM head."""
        return quant_matmul(hidden, self.qweight, self.qtype, self.embedding_dim, None, self.chunk_bytes,
                            self.split_rows)

    def extra_repr(self) -> str:
        return (f"{self.name!r}, num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}, qtype={self.qtype.name}, split_rows={self.split_rows}")
