"""PagedKVCache: the paged storage of one of K or V for one attention layer, in a chosen type.

Cache types (llama.cpp's flag names `--cache-type-k` / `--cache-type-v`, settable separately):
  auto   the model dtype          f32 / f16 / bf16   stored as is
  fp8    float8_e4m3fn + one float32 scale per (token, head)
  q8_0   llama.cpp q8_0: blocks of 32 along head_dim, int8 + fp16 scale    (34 bytes / 32 values)
  q4_0   llama.cpp q4_0: blocks of 32, packed nibbles + fp16 scale         (18 bytes / 32 values)
Formats and rounding: lucebox/kernels/kv_quant.py.

Storage layout (a slot is block * block_size + offset; a future Triton paged-attention kernel
reads a block as one contiguous [block_size, H, ...] tile of each tensor):
  values  [num_blocks, block_size, H, D]       f32 / f16 / bf16 / float8_e4m3fn / int8 (q8_0)
          [num_blocks, block_size, H, D // 2]  uint8 (q4_0; byte j of each 16-byte group holds
                                               value j low, value j+16 high, as ggml packs)
  scales  [num_blocks, block_size, H, D // 32] float16 (q8_0, q4_0: scale of each 32-value block)
          [num_blocks, block_size, H, 1]       float32 (fp8: one scale per token and head)
          None                                 (f32 / f16 / bf16)

rotate=True applies an orthonormal Walsh-Hadamard rotation along head_dim before quantising
(keys have a few outlier channels; rotating spreads them over the block so they stop setting the
scale for their neighbours) and undoes it in `gather`, so attention code needs no change. A
future kernel may instead rotate q once and skip the un-rotation: q.k is invariant under it.
"""
from __future__ import annotations

import torch

from ..errors import RequestError
from ..kernels import kv_quant

CACHE_TYPES = ("auto", "f32", "f16", "bf16", "fp8", "q8_0", "q4_0")
QUANTISED_TYPES = ("fp8", "q8_0", "q4_0")

_PLAIN_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _PLAIN_DTYPES.items()}
# Spellings people bring from vLLM / PyTorch; the canonical names are llama.cpp's.
_ALIASES = {"fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16", "half": "f16",
            "bfloat16": "bf16", "fp8_e4m3": "fp8"}


def parse_cache_type(name: str | None, model_dtype: torch.dtype,
                     flag: str = "--cache-type-k/--cache-type-v") -> str:
    """Validate a cache type name and resolve `auto` to the model dtype's name (f32/f16/bf16)."""
    key = (name or "auto").strip().lower()
    key = _ALIASES.get(key, key)
    if key not in CACHE_TYPES:
        raise RequestError(f"{flag} {name!r} is not a KV cache type lucebox supports; "
                           f"choose one of: {', '.join(CACHE_TYPES)}")
    if key == "auto":
        if model_dtype not in _DTYPE_NAMES:
            raise RequestError(f"{flag} auto: the model dtype {model_dtype} has no cache type; "
                               f"pick one of {', '.join(_PLAIN_DTYPES)} explicitly")
        key = _DTYPE_NAMES[model_dtype]
    return key


def bytes_per_value(cache_type: str, head_dim: int) -> float:
    """Storage cost of one cached value, scales included (cache_type already resolved)."""
    if cache_type in _PLAIN_DTYPES:
        return torch.empty(0, dtype=_PLAIN_DTYPES[cache_type]).element_size()
    if cache_type == "fp8":
        return 1 + 4 / head_dim  # float32 scale shared by the head's row
    if cache_type == "q8_0":
        return (kv_quant.QK + 2) / kv_quant.QK  # 32 int8 + fp16 d
    if cache_type == "q4_0":
        return (kv_quant.QK // 2 + 2) / kv_quant.QK  # 16 bytes of nibbles + fp16 d
    raise RequestError(f"unknown KV cache type {cache_type!r}; choose one of: {', '.join(CACHE_TYPES)}")


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, cache_type: str,
                 model_dtype: torch.dtype, device: torch.device | str, rotate: bool = False):
        self.cache_type = parse_cache_type(cache_type, model_dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rotate = rotate
        if self.cache_type in ("q8_0", "q4_0"):
            kv_quant.check_block_dim(head_dim, self.cache_type)
        lead = (num_blocks, block_size, num_kv_heads)
        self.scales: torch.Tensor | None = None
        if self.cache_type in _PLAIN_DTYPES:
            self.values = torch.zeros(*lead, head_dim, dtype=_PLAIN_DTYPES[self.cache_type], device=device)
        elif self.cache_type == "fp8":
            self.values = torch.zeros(*lead, head_dim, dtype=torch.float8_e4m3fn, device=device)
            self.scales = torch.zeros(*lead, 1, dtype=torch.float32, device=device)
        elif self.cache_type == "q8_0":
            self.values = torch.zeros(*lead, head_dim, dtype=torch.int8, device=device)
            self.scales = torch.zeros(*lead, head_dim // kv_quant.QK, dtype=torch.float16, device=device)
        else:  # q4_0
            self.values = torch.zeros(*lead, head_dim // 2, dtype=torch.uint8, device=device)
            self.scales = torch.zeros(*lead, head_dim // kv_quant.QK, dtype=torch.float16, device=device)
        # float32 so rotation adds no rounding beyond the storage type's own
        self._hadamard = kv_quant.hadamard_matrix(head_dim, torch.float32, device) if rotate else None

    @property
    def bytes_per_token(self) -> int:
        """Bytes this cache (one of K/V, one layer) spends per token, scales included."""
        return round(self.num_kv_heads * self.head_dim * bytes_per_value(self.cache_type, self.head_dim))

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])  # [num_blocks * block_size, H, ...], indexed by slot

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantise x [T, H, D] (rotating it first if `rotate`) into the slots slot_mapping [T]."""
        if self._hadamard is not None:
            x = x.float() @ self._hadamard
        if self.cache_type in _PLAIN_DTYPES:
            self._flat(self.values)[slot_mapping] = x.to(self.values.dtype)
            return
        if self.cache_type == "fp8":
            v, s = kv_quant.quantize_fp8(x, self.scales.dtype)
        elif self.cache_type == "q8_0":
            v, s = kv_quant.quantize_q8_0(x)
        else:
            v, s = kv_quant.quantize_q4_0(x)
        self._flat(self.values)[slot_mapping] = v
        self._flat(self.scales)[slot_mapping] = s

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values at slots [N] as [N, H, D] in dtype: dequantised and un-rotated."""
        v = self._flat(self.values)[slots]
        if self.cache_type in _PLAIN_DTYPES:
            x = v
        else:
            s = self._flat(self.scales)[slots]
            dq = {"fp8": kv_quant.dequantize_fp8, "q8_0": kv_quant.dequantize_q8_0,
                  "q4_0": kv_quant.dequantize_q4_0}[self.cache_type]
            x = dq(v, s, torch.float32 if self._hadamard is not None else dtype)
        if self._hadamard is not None:
            # Orthonormal, so the inverse is the transpose (Sylvester's is symmetric: itself).
            x = x.float() @ self._hadamard.T
        return x.to(dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] (values and scales), e.g. for copy-on-write."""
        self.values[dst] = self.values[src]
        if self.scales is not None:
            self.scales[dst] = self.scales[src]
