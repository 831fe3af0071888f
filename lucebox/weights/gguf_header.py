"""Check a GGUF file's header against the file itself before anything trusts it.

gguf's GGUFReader takes counts, lengths, offsets and shapes from the header as they are: a count of
2^63 loops for ever, an offset of 2^64-1 wraps round into the header, a relabelled tensor type reads
the wrong bytes. This scan walks the same header with every number checked against the bytes left
in the file (so nothing is allocated or looped over beyond what the file holds), and the tensor
data against llama.cpp's layout rule: tensors back to back, each padded to the alignment.
Every failure is a CheckpointError naming the field.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import CheckpointError

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 1 << 16
MAX_TENSORS = 1 << 20
# Array elements over all keys: real vocabularies hold well under 1M tokens (+ types, merges); the
# reader builds Python objects per element, so this bounds its memory and time.
MAX_ARRAY_ELEMENTS = 1 << 23
MAX_ALIGNMENT = 1 << 16

SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as stored: innermost first
    qtype: GGMLQuantizationType
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    alignment: int
    data_start: int
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    """Reads little- or big-endian numbers at a position, refusing to go past the end of the file."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.order = buf, path, 0, "<"
        self.size = len(buf)

    def left(self) -> int:
        return self.size - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left():
            raise CheckpointError(f"{self.path}: {what} needs {nbytes} bytes at byte {self.pos}, past the end of "
                                  f"the {self.size}-byte file (the file is truncated or corrupt)")

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.unpack("Q", f"{what} (length)")
        if limit is not None and length > limit:
            raise CheckpointError(f"{self.path}: {what} is {length} bytes long, more than the {limit} allowed")
        self.need(length, what)
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} is not valid UTF-8") from None

    def skip(self, nbytes: int, what: str) -> None:
        self.need(nbytes, what)
        self.pos += nbytes


def scan_gguf(path: Path) -> GGUFLayout:
    """The checked header of the GGUF file at `path` (which must exist)."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise CheckpointError(f"{path}: the file is empty, not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(_Cursor(buf, path))


def _scan(c: _Cursor) -> GGUFLayout:
    c.need(4, "the GGUF magic")
    if bytes(c.buf[:4]) != GGUF_MAGIC:
        raise CheckpointError(f"{c.path}: not a GGUF file (it starts with {bytes(c.buf[:4])!r}, not b'GGUF')")
    c.pos = 4
    version = c.unpack("I", "version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (what GGUFReader detects)
        c.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise CheckpointError(f"{c.path}: GGUF version {version} is not supported (versions {VERSIONS})")
    tensor_count = c.unpack("Q", "tensor_count")
    kv_count = c.unpack("Q", "kv_count")
    _check_count(c, "kv_count", kv_count, MIN_KV_BYTES)
    alignment = _scan_metadata(c, kv_count)
    _check_count(c, "tensor_count", tensor_count, MIN_TENSOR_INFO_BYTES, MAX_TENSORS)
    infos = [_scan_tensor_info(c, i) for i in range(tensor_count)]
    data_start = -(-c.pos // alignment) * alignment
    if data_start > c.size:
        raise CheckpointError(f"{c.path}: the tensor data should start at byte {data_start}, past the end of the "
                              f"{c.size}-byte file (the file is truncated)")
    tensors = tuple(_sized(c, alignment, data_start, info) for info in infos)
    _check_layout(c, alignment, data_start, tensors)
    return GGUFLayout(version, alignment, data_start, tensors)


def _check_count(c: _Cursor, name: str, count: int, min_bytes: int, cap: int | None = None) -> None:
    room = c.left() // min_bytes
    if count > room or (cap is not None and count > cap):
        limit = min(room, cap) if cap is not None else room
        raise CheckpointError(f"{c.path}: {name} is {count}, but the file has room for at most {limit}")


def _scan_metadata(c: _Cursor, kv_count: int) -> int:
    seen: set[str] = set()
    budget = [MAX_ARRAY_ELEMENTS]
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = c.string(f"metadata key #{i}", MAX_NAME_BYTES)
        if key in seen:
            raise CheckpointError(f"{c.path}: metadata key {key} appears twice")
        seen.add(key)
        vtype = _value_type(c, c.unpack("I", f"metadata key {key} (type)"), f"metadata key {key}")
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise CheckpointError(f"{c.path}: metadata key general.alignment must be a uint32, "
                                      f"not {vtype.name}")
            alignment = c.unpack("I", "metadata key general.alignment")
            if alignment == 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
                raise CheckpointError(f"{c.path}: metadata key general.alignment is {alignment}, not a power "
                                      f"of two up to {MAX_ALIGNMENT}")
            continue
        _skip_value(c, vtype, f"metadata key {key}", budget)
    return alignment


def _value_type(c: _Cursor, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise CheckpointError(f"{c.path}: {what} has value type {raw}, which GGUF does not define") from None


def _skip_value(c: _Cursor, vtype: GGUFValueType, what: str, budget: list[int]) -> None:
    if vtype in SCALAR_FORMATS:
        c.skip(struct.calcsize(SCALAR_FORMATS[vtype]), what)
    elif vtype == GGUFValueType.STRING:
        length = c.unpack("Q", f"{what} (string length)")
        c.skip(length, f"{what} (a {length}-byte string)")
    else:  # ARRAY
        item = _value_type(c, c.unpack("I", f"{what} (array type)"), f"{what} (array items)")
        count = c.unpack("Q", f"{what} (array length)")
        if item == GGUFValueType.ARRAY:
            raise CheckpointError(f"{c.path}: {what} is an array of arrays, which lucebox does not read")
        item_bytes = struct.calcsize(SCALAR_FORMATS[item]) if item in SCALAR_FORMATS else 8
        if count > c.left() // item_bytes:
            raise CheckpointError(f"{c.path}: {what} claims {count} array items, more than the "
                                  f"{c.left()} bytes left in the file can hold")
        budget[0] -= count
        if budget[0] < 0:
            raise CheckpointError(f"{c.path}: {what} has {count} array items, past lucebox's limit of "
                                  f"{MAX_ARRAY_ELEMENTS} items over all metadata")
        if item == GGUFValueType.STRING:
            for j in range(count):
                length = c.unpack("Q", f"{what}[{j}] (string length)")
                c.skip(length, f"{what}[{j}] (a {length}-byte string)")
        else:
            c.skip(count * item_bytes, what)


def _scan_tensor_info(c: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = c.string(f"tensor #{i} name", MAX_NAME_BYTES)
    what = f"tensor {name}"
    n_dims = c.unpack("I", f"{what} (n_dims)")
    if not 1 <= n_dims <= MAX_DIMS:
        raise CheckpointError(f"{c.path}: {what} has n_dims {n_dims}, not 1 to {MAX_DIMS}")
    dims = tuple(c.unpack("Q", f"{what} (dimension {d})") for d in range(n_dims))
    if any(d == 0 for d in dims):
        raise CheckpointError(f"{c.path}: {what} has an empty dimension in its shape {list(dims)}")
    raw_type = c.unpack("I", f"{what} (type)")
    try:
        qtype = GGMLQuantizationType(raw_type)
        GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise CheckpointError(f"{c.path}: {what} has type {raw_type}, which GGML does not define") from None
    offset = c.unpack("Q", f"{what} (offset)")
    return name, dims, qtype, offset


def _sized(c: _Cursor, alignment: int, data_start: int, info) -> TensorInfo:
    name, dims, qtype, offset = info
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise CheckpointError(f"{c.path}: tensor {name} ({qtype.name}) has rows of {dims[0]} values, not whole "
                              f"{block}-value blocks")
    elements = 1
    for d in dims:  # Python integers do not wrap, so a huge shape stays huge and fails below
        elements *= d
    nbytes = elements // block * type_size
    room = c.size - data_start
    if offset % alignment:
        raise CheckpointError(f"{c.path}: tensor {name} (offset) {offset} is not a multiple of the "
                              f"{alignment}-byte alignment")
    if offset > room or nbytes > room - offset:
        raise CheckpointError(f"{c.path}: tensor {name} ({qtype.name}, shape {list(reversed(dims))}) needs "
                              f"{nbytes} bytes at (offset) {offset}, past the end of the {room}-byte data "
                              "section (the file is truncated or the header is corrupt)")
    return TensorInfo(name, dims, qtype, offset, nbytes)


def _check_layout(c: _Cursor, alignment: int, data_start: int, tensors: tuple[TensorInfo, ...]) -> None:
    """Tensors lie back to back, each padded to the alignment (llama.cpp writes and requires this), so a
    tensor whose type or shape was changed no longer fits the bytes it was given."""
    names: set[str] = set()
    expected, before = 0, None
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.name in names:
            raise CheckpointError(f"{c.path}: tensor {t.name} appears twice")
        names.add(t.name)
        if t.offset != expected:
            after = (f"the tensor before it, {_described(before)}, ends at {expected} (padded)" if before
                     else "the first tensor should start at 0")
            raise CheckpointError(
                f"{c.path}: tensor {_described(t)} starts at (offset) {t.offset}, but {after}: one of them has "
                "an offset, type or shape that does not match the bytes in the file")
        expected, before = -(-(t.offset + t.nbytes) // alignment) * alignment, t
    end = data_start + expected
    if tensors and c.size > end:
        raise CheckpointError(f"{c.path}: {c.size - end} bytes follow the last tensor "
                              f"{_described(max(tensors, key=lambda t: t.offset))}: its type or shape does not "
                              "match the bytes in the file")


def _described(t: TensorInfo) -> str:
    return f"{t.name} ({t.qtype.name}, shape {list(reversed(t.dims))})"
