"""Read GGUF files (llama.cpp's format): open, check every tensor's type and bytes, copy rows out.

The header is checked against the file (gguf_header.py) before gguf's reader sees it.

model/loader.py builds a model from what these read.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from ..errors import CheckpointError, UnsupportedError
from ..kernels import dequant
from .gguf_header import scan_gguf
from .quant import SUPPORTED_TYPES

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    layout = scan_gguf(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader fails with ValueError/IndexError/KeyError... on bad bytes
        raise CheckpointError(f"{path}: not a valid GGUF file, it is truncated or corrupt "
                              f"({type(e).__name__}: {e})") from None
    if reader.data_offset != layout.data_start or len(reader.tensors) != len(layout.tensors):
        raise CheckpointError(f"{path}: gguf's reader and lucebox's header check disagree about the file's layout")
    return reader


def logical_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; torch outermost first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def check_tensors(reader: GGUFReader, path: Path) -> None:
    """Every tensor has a type we read, whole blocks per row, and all its bytes inside the file."""
    file_size = path.stat().st_size
    for t in reader.tensors:
        qtype = t.tensor_type
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedError(
                f"{path}: tensor {t.name} has GGUF type {dequant.qtype_name(qtype)}, which lucebox cannot "
                f"load; supported types: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))}")
        shape = logical_shape(t)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if not shape or shape[-1] % block_size:
            raise CheckpointError(f"{path}: tensor {t.name} ({qtype.name}) has shape {list(shape)}, whose rows "
                                  f"are not whole {block_size}-value blocks")
        nbytes = math.prod(shape) // block_size * type_size
        if t.data_offset + nbytes > file_size:
            raise CheckpointError(f"{path}: tensor {t.name} ({qtype.name}, shape {list(shape)}) needs {nbytes} bytes "
                                  f"at offset {t.data_offset}, past the end of the {file_size}-byte file "
                                  "(the file is truncated)")
        if t.data.nbytes != nbytes:
            raise CheckpointError(f"{path}: tensor {t.name} ({qtype.name}, shape {list(shape)}) should hold "
                                  f"{nbytes} bytes, the file gives {t.data.nbytes}")


def raw_rows(tensor, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's bytes as [rows, bytes_per_row] uint8 (a view of the memory map)."""
    rows = math.prod(shape[:-1])
    return np.asarray(tensor.data).reshape(-1).view(np.uint8).reshape(rows, -1)


def to_torch(array: np.ndarray) -> torch.Tensor:
    # A copy: the memory map is read-only and may be closed once the reader goes away.
    return torch.from_numpy(np.array(array, copy=True))
