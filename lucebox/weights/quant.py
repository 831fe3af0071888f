"""Quantised GGUF weights that stay quantised in memory, and the linear / embedding layers using them.

A `QuantTensor` keeps the raw GGUF blocks (uint8, one row of blocks per output feature); a
`QuantLinear` holds them and their layout (ggml's, or the GPU's split rows) and leaves each product
to kernels/linear.py, whose routing table (kernels/routing.py) picks the kernel; a `QuantEmbedding`
dequantises only the rows a batch looks up.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from lucebox.errors import CheckpointError, UnsupportedError
from lucebox.kernels import dequant
from lucebox.kernels.dequant import SUPPORTED_TYPES, qtype_name
from lucebox.kernels.dispatch import use_triton
from lucebox.kernels.linear import dequantize_rows, quant_linear, quant_matmul
from lucebox.kernels.split_rows import applies, join_rows, split_rows

__all__ = ["SUPPORTED_TYPES", "PermutedInputQuantLinear", "QuantEmbedding", "QuantLinear", "QuantTensor"]


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


class _SplitRows:
    """Q8_0 / Q6_K rows reordered for the GPU's decode kernels (kernels/split_rows.py):
    `qweight` then holds each row's fields one after the other (Q8_0: values, then scales). For
    modules with `qweight`, `qtype` and `row_length`."""

    split_rows = False

    def _raw_rows(self) -> torch.Tensor:
        """qweight in ggml's layout."""
        if not self.split_rows:
            return self.qweight
        return join_rows(self.qweight, self.qtype)

    def splits_rows(self) -> bool:
        """Whether use_split_rows applies: weights that the Triton kernels read (the GPU), of a type and
        row length the split layout serves (triton_split_rows.applies)."""
        return applies(self.qtype, self.row_length) and use_triton(self.qweight)

    def use_split_rows(self, reorder: bool = True) -> None:
        """Rows in the GPU's split layout from now on: decode reads them with 16-byte loads.
        reorder=False: the bytes are split already (a row slice of a fused projection that was)."""
        if reorder:
            self.qweight.copy_(split_rows(self.qweight, self.qtype))
        self.split_rows = True


class QuantLinear(_SplitRows, torch.nn.Module):
    """y = x @ W.T (+ bias) with W kept quantised; where the product dequantises (prefill, the CPU),
    `chunk_bytes` (float32-equivalent) worth of output rows at a time."""

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
        return quant_linear(x, self)  # the kernel: kernels/routing.py

    def extra_repr(self) -> str:
        return (f"{self.name!r}, in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, bias={self.bias is not None}, split_rows={self.split_rows}")


class PermutedInputQuantLinear(QuantLinear):
    """A QuantLinear whose weight columns are stored in another order than its input's features:
    y = W_stored @ x[..., input_order]. For weights whose columns a converter reordered in blocks that
    quantisation blocks straddle (llama.cpp's tiled DeltaNet value heads in ssm_out), so that the
    bytes stay as stored; `weight` is the stored matrix."""

    transforms_input = True  # kernels/linear.quant_rows: multiply through forward, never the raw rows

    def __init__(self, weight: QuantTensor, input_order: torch.Tensor, bias: torch.Tensor | None = None,
                 chunk_bytes: int = 32 << 20):
        super().__init__(weight, bias, chunk_bytes)
        if tuple(input_order.shape) != (self.in_features,):
            raise CheckpointError(f"tensor {weight.name!r}: an input order of {tuple(input_order.shape)} entries "
                                  f"for {self.in_features} input features")
        self.register_buffer("input_order", input_order.to(device=weight.device, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.input_order))

    def block_order(self, block: int) -> torch.Tensor | None:
        """Where input_order moves whole blocks of `block` features (DeltaNet value heads): the
        source block of each stored block (long [in_features / block], on the weights' device), so a
        producer can write its output in the stored order; None otherwise. Reads the order (a sync)."""
        if self.in_features % block:
            return None
        blocks = self.input_order.view(-1, block)
        first = blocks[:, 0]
        whole = (first % block == 0).all() and torch.equal(blocks, first[:, None] + torch.arange(block, device=first.device))
        return (first // block).contiguous() if whole else None


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
        values = dequantize_rows(rows, self.qtype, self.embedding_dim, self.dtype, self.split_rows)
        return values.reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ table.T: the tied LM head."""
        return quant_matmul(hidden, self.qweight, self.qtype, self.embedding_dim, None, self.chunk_bytes,
                            self.split_rows)

    def extra_repr(self) -> str:
        return (f"{self.name!r}, num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}, qtype={self.qtype.name}, split_rows={self.split_rows}")
