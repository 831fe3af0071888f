"""Load a GGUF file (llama.cpp's format) into a Transformer.

F32/F16/BF16 tensors become plain parameters in the model dtype; quantised matrices become
QuantLinear / QuantEmbedding modules that stay quantised (the model is built on the meta device,
so no float copy of them is ever allocated). The file is memory-mapped; each tensor is copied out
once, checked against the header and the config first.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from tqdm import tqdm

from ..errors import CheckpointError, UnsupportedError
from ..kernels import dequant
from ..model.config import ModelConfig
from ..model.loader import LoadedModel, resolve_dtype
from ..model.rope import RopeTable
from ..model.transformer import Transformer
from ..util import on_meta
from .gguf_config import (
    ROPE_FREQS,
    SAMPLING_KEYS,
    Metadata,
    architecture,
    model_config,
    rows_permuted,
    to_our_name,
    unpermute_rows,
)
from .load import assign
from .quant import SUPPORTED_TYPES, QuantEmbedding, QuantLinear, QuantTensor

log = logging.getLogger("lucebox")

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def load_gguf(path: Path, dtype, device: torch.device) -> LoadedModel:
    from ..tokenizer import Tokenizer

    path = Path(path)
    reader = open_gguf(path)
    meta = Metadata(reader, path)
    architecture(meta)  # an unknown architecture is the clearest first message
    check_tensors(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = model_config(meta, {name: logical_shape(t) for name, t in tensors.items()})
    torch_dtype = resolve_dtype(dtype, None, device)
    with on_meta():
        model = Transformer(cfg).to(torch_dtype)
    assign(model, _model_tensors(reader, cfg, meta, model, torch_dtype, path), str(path), torch_dtype, device)
    if ROPE_FREQS in tensors:
        model.rope = RopeTable(cfg.rope, cfg.head_dim, _rope_freqs(tensors[ROPE_FREQS], cfg, path))
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise RuntimeError("load_gguf: a Transformer tensor is not filled from the file (new buffer?)")
    model.eval()
    tokenizer = Tokenizer.from_gguf(reader, path)
    return LoadedModel(model, tokenizer, cfg, str(path), "gguf", generation_defaults(meta))


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader fails with ValueError/IndexError/KeyError... on bad bytes
        raise CheckpointError(f"{path}: not a valid GGUF file, it is truncated or corrupt "
                              f"({type(e).__name__}: {e})") from None


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


def _raw_rows(tensor, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's bytes as [rows, bytes_per_row] uint8 (a view of the memory map)."""
    rows = math.prod(shape[:-1])
    return np.asarray(tensor.data).reshape(-1).view(np.uint8).reshape(rows, -1)


def _to_torch(array: np.ndarray) -> torch.Tensor:
    # A copy: the memory map is read-only and may be closed once the reader goes away.
    return torch.from_numpy(np.array(array, copy=True))


def _model_tensors(reader: GGUFReader, cfg: ModelConfig, meta: Metadata, model: Transformer,
                   dtype: torch.dtype, path: Path) -> Iterator[tuple[str, torch.Tensor | torch.nn.Module]]:
    arch = architecture(meta)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}
    for t in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor", disable=None):
        if t.name == ROPE_FREQS:
            continue
        ours = to_our_name(t.name)
        if ours is None or ours not in expected:
            log.warning("%s: ignoring tensor %s (not used by this architecture)", path, t.name)
            continue
        shape = logical_shape(t)
        if shape != expected[ours]:
            raise CheckpointError(f"{path}: tensor {t.name} has shape {list(shape)}, the model config needs "
                                  f"{list(expected[ours])}")
        rows = _raw_rows(t, shape)
        permuted = rows_permuted(arch, t.name)
        quantised = t.tensor_type not in FLOAT_TYPES and len(shape) == 2
        if quantised and (ours.endswith("_proj.weight") or ours == "lm_head.weight"):
            if permuted:  # quantised rows are independent byte rows, so they reorder like float rows
                rows = unpermute_rows(rows, heads[permuted])
            yield ours, QuantLinear(QuantTensor(_to_torch(rows), t.tensor_type, shape, t.name))
        elif quantised and ours == "embed_tokens.weight":
            yield ours, QuantEmbedding(QuantTensor(_to_torch(rows), t.tensor_type, shape, t.name), dtype)
        else:  # float tensors, and quantised norms/biases (tiny) widened to float
            values = dequant.dequantize(_to_torch(rows), t.tensor_type, dtype).reshape(shape)
            if permuted:
                values = unpermute_rows(values, heads[permuted])
            yield ours, values


def _rope_freqs(tensor, cfg: ModelConfig, path: Path) -> torch.Tensor:
    shape = logical_shape(tensor)
    if shape != (cfg.head_dim // 2,):
        raise CheckpointError(f"{path}: tensor {tensor.name} has shape {list(shape)}, expected "
                              f"[{cfg.head_dim // 2}] (one factor per RoPE frequency)")
    return dequant.dequantize(_to_torch(_raw_rows(tensor, shape)), tensor.tensor_type).reshape(shape)


def generation_defaults(meta: Metadata) -> dict:
    """GGUF has no generation_config.json; llama.cpp's `general.sampling.*` keys are the nearest thing."""
    out = {}
    for key, name in SAMPLING_KEYS.items():
        value = meta.get(f"general.sampling.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value if isinstance(value, int) else meta.number(f"general.sampling.{key}")
    return out
