"""What state a layer keeps per sequence, as small typed specs, and the byte figures they add up to.

Each layer (and each proposer with a cache of its own) declares one spec; the engine's cache
manager and memory planner read only these:
  PagedKVSpec      paged K/V in blocks of tokens ([num_blocks, block_size, kv_heads, head_dim] per
                   K and V, model/kv_cache.PagedKVCache); `window=W`: a sliding-window layer whose
                   queries read only the last W positions, so blocks behind it can be released
  SharedKVSpec     no storage: the layer reads another layer's paged K/V (Gemma 4's KV sharing)
  RecurrentSpec    a fixed-size recurrent state plus a short conv window per sequence (Gated
                   DeltaNet), in a slot pool with a small per-position stash for verifies
                   (model/recurrent_state.RecurrentState)
A spec knows its bytes per token (paged) and per sequence (fixed-size), and builds its storage:
the one place a layer's cache tensors are made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kv_cache import PagedKVCache, bytes_per_value, parse_cache_type
from .recurrent_state import RecurrentState


@dataclass(frozen=True)
class PagedKVSpec:
    num_kv_heads: int
    head_dim: int
    cache_type_k: str  # resolved names (kv_cache.parse_cache_type): f32 / f16 / bf16 / fp8 / q8_0 / q4_0
    cache_type_v: str
    window: int | None = None  # None: full attention; W: queries read positions p - W < k <= p
    rotate_k: bool = False

    @classmethod
    def of(cls, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype, cache_type_k: str | None = "auto",
           cache_type_v: str | None = "auto", window: int | None = None, rotate_k: bool = False) -> "PagedKVSpec":
        """A spec with its cache type names resolved against the model dtype (`auto`, aliases)."""
        return cls(num_kv_heads, head_dim, parse_cache_type(cache_type_k, model_dtype, "--cache-type-k"),
                   parse_cache_type(cache_type_v, model_dtype, "--cache-type-v"), window, rotate_k)

    @property
    def bytes_per_token(self) -> float:
        """K and V of one token, scales included."""
        per_value = (bytes_per_value(self.cache_type_k, self.head_dim)
                     + bytes_per_value(self.cache_type_v, self.head_dim))
        return self.num_kv_heads * self.head_dim * per_value

    def bytes_per_sequence(self, positions: int = 0) -> int:
        return 0

    def build(self, num_blocks: int, block_size: int, model_dtype: torch.dtype,
              device: torch.device | str) -> tuple[PagedKVCache, PagedKVCache]:
        """The (K, V) stores of this layer: num_blocks blocks (the scratch block included)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return (PagedKVCache(*shape, self.cache_type_k, model_dtype, device, rotate=self.rotate_k),
                PagedKVCache(*shape, self.cache_type_v, model_dtype, device))


@dataclass(frozen=True)
class RecurrentSpec:
    state_shape: tuple[int, int, int]  # the recurrent state of one sequence: (value heads, d_k, d_v)
    conv_shape: tuple[int, int]  # the short conv's window of past inputs: (channels, kernel - 1)
    key_heads: int  # q/k heads (GVA: each serves value_heads / key_heads value heads)
    dtype: torch.dtype

    bytes_per_token = 0.0
    window = None

    @property
    def values_per_position(self) -> int:
        """One stashed verify position: the conv's raw input and output, g and beta."""
        return 2 * self.conv_shape[0] + 2 * self.state_shape[0]

    def bytes_per_sequence(self, positions: int = 0) -> int:
        """The live state and conv window plus `positions` stashed verify positions (1 + the longest draft)."""
        size = math.prod(self.state_shape) + math.prod(self.conv_shape) + positions * self.values_per_position
        return size * torch.empty(0, dtype=self.dtype).element_size()

    def build(self, num_slots: int, positions: int, device: torch.device | str, layers: int = 1) -> RecurrentState:
        """Storage for num_slots sequences (and the scratch slot) with `positions` stash rows each;
        layers > 1: a pool of that many layers of this spec (RecurrentState.layer(i))."""
        return RecurrentState(num_slots, positions, self.state_shape, self.conv_shape, self.key_heads, self.dtype,
                              device, layers)


@dataclass(frozen=True)
class SharedKVSpec:
    """A layer that keeps nothing of its own: it attends to layer `source`'s paged K/V (Gemma 4's
    KV-shared layers), with the same window."""
    source: int
    window: int | None = None

    bytes_per_token = 0.0

    def bytes_per_sequence(self, positions: int = 0) -> int:
        return 0


CacheSpec = PagedKVSpec | RecurrentSpec | SharedKVSpec


def bytes_per_token(specs) -> int:
    """Bytes one token costs across these specs (paged K/V of every layer)."""
    return round(sum(s.bytes_per_token for s in specs))


def bytes_per_sequence(specs, positions: int = 0) -> int:
    """Fixed bytes one sequence costs across these specs (recurrent state and its verify stash)."""
    return sum(s.bytes_per_sequence(positions) for s in specs)


def release_window(specs) -> int | None:
    """The window behind which a sequence's blocks may be released: when every paged spec is
    window-bounded, the widest window; else None (some layer reads the whole context)."""
    paged = [s for s in specs if isinstance(s, PagedKVSpec)]
    if not paged or any(s.window is None for s in paged):
        return None
    return max(s.window for s in paged)


@dataclass(frozen=True)
class KVGroup:
    """Paged layers that share one block table per sequence (and one block pool). Group 0 is the
    primary group: its table is `Sequence.block_table`, which proposers' caches share too."""
    layers: tuple[int, ...]  # indices into the specs
    window: int | None  # blocks wholly behind this window of the next position are released; None: kept


def kv_groups(specs) -> list[KVGroup]:
    """The KV cache groups of these specs. Every paged spec windowed (Mistral): one group released
    behind the widest window. Else the full-attention layers (and proposers' caches) form the
    primary group, which keeps everything, and each distinct window its own group, which holds
    only its window (Gemma 4, Laguna, Qwen2's max_window_layers)."""
    paged = [i for i, s in enumerate(specs) if isinstance(s, PagedKVSpec)]
    full = tuple(i for i in paged if specs[i].window is None)
    if not full:
        return [KVGroup(tuple(paged), release_window(specs))] if paged else []
    windows = sorted({specs[i].window for i in paged} - {None})
    return [KVGroup(full, None)] + [KVGroup(tuple(i for i in paged if specs[i].window == w), w) for w in windows]


def window_blocks(window: int, block_size: int, step_tokens: int) -> int:
    """Blocks a sequence of a window group holds at most during a step bringing step_tokens new
    tokens: the blocks its next position's window reaches (one partial at each end) and the new ones."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


def _window_wanted(group: KVGroup, block_size: int, max_num_seqs: int, step_tokens: int,
                   max_model_len: int) -> tuple[int, int]:
    """(blocks a window group needs at least: one sequence's window and chunk; blocks it wants:
    max_num_seqs decoding windows plus one step's new tokens)."""
    per_seq = -(-max_model_len // block_size)
    one = min(window_blocks(group.window, block_size, min(step_tokens, max_model_len)), per_seq + 1)
    decoding = min(window_blocks(group.window, block_size, 1), per_seq + 1)  # a window past max_model_len
    return one, max_num_seqs * decoding + -(-step_tokens // block_size)


def _group_block_bytes(specs, group: KVGroup, block_size: int) -> int:
    return bytes_per_token([specs[i] for i in group.layers]) * block_size


def plan_pools(specs, groups: list[KVGroup], budget: int, block_size: int, max_num_seqs: int,
               step_tokens: int, max_model_len: int) -> list[int]:
    """Blocks of each group's pool out of `budget` bytes. A window group gets room for max_num_seqs
    windows (each with a decode step's block) plus one step's new tokens, at least one sequence's
    window and chunk, and never more blocks than one shared pool of every layer would have given it
    (so short contexts fit as many sequences as before); the primary group takes the rest, which is
    what lets contexts grow with the full-attention layers alone."""
    if len(groups) <= 1:
        return [int(budget // (bytes_per_token(specs) * block_size))]
    shared = int(budget // (bytes_per_token(specs) * block_size))
    counts = []
    for group in groups[1:]:
        one, wanted = _window_wanted(group, block_size, max_num_seqs, step_tokens, max_model_len)
        counts.append(max(one, min(wanted, shared)))
    rest = budget - sum(n * _group_block_bytes(specs, g, block_size) for n, g in zip(counts, groups[1:]))
    primary = int(max(rest, 0) // _group_block_bytes(specs, groups[0], block_size))
    return [primary] + counts


def pools_bytes_wanted(specs, groups: list[KVGroup], block_size: int, max_num_seqs: int, step_tokens: int,
                       max_model_len: int) -> int:
    """Bytes that hold max_num_seqs sequences of max_model_len: the primary group's whole context and
    each window group's plan_pools wish (a budget sized from this leaves the primary that much)."""
    per_seq = -(-max_model_len // block_size)
    if len(groups) <= 1:
        return per_seq * max_num_seqs * bytes_per_token(specs) * block_size
    total = per_seq * max_num_seqs * _group_block_bytes(specs, groups[0], block_size)
    for group in groups[1:]:
        one, wanted = _window_wanted(group, block_size, max_num_seqs, step_tokens, max_model_len)
        total += max(one, wanted) * _group_block_bytes(specs, group, block_size)
    return total


def kv_bytes_per_token(model, cache_type_k: str = "auto", cache_type_v: str = "auto") -> int:
    """KV bytes one token costs across all of a model's layers, K and V, scales included."""
    return bytes_per_token(model.cache_specs(cache_type_k, cache_type_v))
