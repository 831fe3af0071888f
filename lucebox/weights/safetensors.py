"""HF safetensors checkpoints: single or sharded files, read lazily (mmap), never unpickled.

Before the safetensors library opens a file, its header is checked here against the file's size
(header length, dtypes, shapes, byte ranges back to back), and an index's shard names must stay
inside the checkpoint directory, so a hostile checkpoint cannot make lucebox read /etc/passwd.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import safe_open

from ..errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_INDEX_BYTES = 64 << 20
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_NAME
    if index.is_file():
        return [model_dir / name for name in _index_shards(model_dir, index)]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found "
                              "(lucebox does not load pickled .bin checkpoints)")
    return files


def _index_shards(model_dir: Path, index: Path) -> list[str]:
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index}: {index.stat().st_size} bytes, more than the {MAX_INDEX_BYTES} an index may be")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file")
    shards = sorted({_shard_name(index, tensor, shard) for tensor, shard in weight_map.items()})
    for name in shards:
        if not (model_dir / name).is_file():
            raise CheckpointError(f"{model_dir / name}: shard listed in {index.name} is missing")
    return shards


def _shard_name(index: Path, tensor, shard) -> str:
    """A shard is a file name inside the checkpoint directory: relative, no `..`, no drive."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight_map[{tensor!r:.80}] must be a shard file name, got {shard!r:.80}")
    posix, windows = PurePosixPath(shard), PureWindowsPath(shard)
    if (posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts
            or ".." in windows.parts or "\0" in shard):
        raise CheckpointError(f"{index}: weight_map[{tensor!r:.80}] names the shard {shard!r:.200}, which is "
                              "outside the checkpoint directory")
    return shard


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The checked header of one .safetensors file: every tensor's dtype, shape and byte range."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: {size} bytes, too short for a safetensors file")
        length = int.from_bytes(head, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{file}: the header length is {length} bytes, but the file holds {size - 8} "
                                  f"after it (and at most {MAX_HEADER_BYTES} are allowed)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header must be a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{file}: __metadata__ must be an object of strings")
    entries = {name: _entry(file, name, value) for name, value in header.items()}
    _check_layout(file, entries, size - 8 - length)
    return entries


def _entry(file: Path, name: str, value) -> TensorEntry:
    where = f"{file}: tensor {name!r:.200}"
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: its header entry must be an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: dtype {dtype!r:.40} is not a safetensors dtype lucebox reads "
                              f"({', '.join(DTYPE_BYTES)})")
    if not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of up to 8 non-negative integers, got {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets must be [start, end] with 0 <= start <= end, "
                              f"got {offsets!r:.80}")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if nbytes != offsets[1] - offsets[0]:
        raise CheckpointError(f"{where}: shape {shape} of {dtype} needs {nbytes} bytes, its data_offsets "
                              f"{offsets} give {offsets[1] - offsets[0]}")
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(file: Path, entries: dict[str, TensorEntry], data_bytes: int) -> None:
    """Byte ranges back to back from 0 to the end of the file, as the format requires."""
    expected = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if e.start != expected:
            raise CheckpointError(f"{file}: tensor {name!r:.200} data_offsets start at {e.start}, expected "
                                  f"{expected} (tensors overlap or leave a gap)")
        expected = e.end
    if expected != data_bytes:
        raise CheckpointError(f"{file}: the tensors' data_offsets end at {expected}, but the file holds "
                              f"{data_bytes} bytes of data (the file is truncated or corrupt)")


def safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape across the checkpoint's files (headers only, no data read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(model_dir):
        for name, entry in read_header(file).items():
            if name in shapes:
                raise CheckpointError(f"{model_dir}: tensor {name!r:.200} appears in more than one shard")
            shapes[name] = entry.shape
    return shapes


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time so peak memory stays near one tensor above the model."""
    for file in safetensors_files(model_dir):
        read_header(file)
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from None
