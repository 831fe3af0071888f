"""ForwardBatch: one ragged batch, the same description for prefill chunks, decodes and verifies.

Each sequence brings `q_len` new tokens that attend causally to themselves and to its cached
context. Built once per step by the runner; every layer reads it.

Two ways to build one: `build` from host lists (eager steps: host copies of the lengths ride
along, so the CPU reference attention never syncs), and `from_device` over a CUDA graph's static
buffers, where lengths exist only on the device (a replay changes the values, never the host side)
and only static bounds (`max_query_len`, `max_seq_len`) are known to the host.

KV cache groups (engine/cache_manager.py): a model mixing sliding-window and full attention keeps
one block table per group; `block_tables` / `slot_mapping` are the primary group's, and
`group(g)` is the batch a layer of group g attends with (group g's tables and slots).

Tree verify rows (DDTree): a sequence's row of T <= MAX_TREE_TOKENS tokens, the pending token then a
draft tree's nodes in DFS order (every parent before its children). Token i is STORED at position
start + i (slot_mapping, seq_lens and every attention kernel's causal bound use the storage
position ctx - q_len + i, never `positions`), but rotated at start + depth(i) (`positions`). Query
i sees the committed keys [0, start) and the row's keys j with bit j of tree_mask[i] set (its
ancestors and itself: tree_mask_bits). Tokens of ordinary rows carry -1 (every bit: plain causal;
in-row keys past bit 63 count as visible when the mask is -1, the sign extension of bit 63).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from ..util import host_to_device

# Longest tree verify row: one int64 of visibility bits per query token.
MAX_TREE_TOKENS = 64


def _check_parents(parents: list[int]) -> None:
    if not 0 < len(parents) <= MAX_TREE_TOKENS:
        raise ValueError(f"a tree verify row holds 1..{MAX_TREE_TOKENS} tokens, got {len(parents)}")
    if parents[0] != -1:
        raise ValueError(f"tree token 0 (the pending token) is the root: its parent must be -1, got {parents[0]}")
    for i, p in enumerate(parents[1:], 1):
        if not 0 <= p < i:
            raise ValueError(f"tree token {i}: parent {p} must be an earlier token of the row (DFS order, 0 <= p < {i})")


def tree_mask_bits(parents: list[int]) -> list[int]:
    """Visibility masks of a tree verify row from parents[i] (the row index of token i's parent,
    -1 for token 0): bit j of mask i is set when j is i or an ancestor of i. int64 values (bit 63
    makes the value negative), ready for ForwardBatch.tree_mask."""
    _check_parents(parents)
    masks: list[int] = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


def check_tree_window(batch: "ForwardBatch", sliding_window: int | None) -> None:
    """Tree rows on a sliding-window layer: windows shorter than a tree row are refused (an
    ancestor could then fall out of a node's window, which the kernels do not model)."""
    if batch.tree_mask is not None and sliding_window is not None and sliding_window < MAX_TREE_TOKENS:
        raise ValueError(f"tree verification (ForwardBatch.tree_mask) on a sliding-window layer needs a window of at "
                         f"least {MAX_TREE_TOKENS} positions (a tree row's length), this layer's is {sliding_window}: "
                         f"verify chains on this model")


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each token of a tree verify row (0 for the pending token): its rope offset."""
    _check_parents(parents)
    depths: list[int] = []
    for p in parents:
        depths.append(depths[p] + 1 if p >= 0 else 0)
    return depths


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all sequences' new tokens back to back
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    query_start_loc: torch.Tensor  # [B+1] int64, offsets of each sequence's tokens in input_ids
    seq_lens: torch.Tensor  # [B] int64, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) for each new token
    block_size: int
    # Hidden states after these layer indices are captured (speculative drafters tap them).
    capture_layers: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    # Host-side copies so the CPU reference attention never syncs on device tensors; None in a
    # device-only batch (from_device), whose kernels must read lengths from the device tensors.
    query_lens_host: list[int] | None = field(default_factory=list)
    seq_lens_host: list[int] | None = field(default_factory=list)
    # Device-only batches: every sequence brings exactly max_query_len tokens, and no sequence is
    # longer than max_seq_len (the block-table width in tokens) -- what fixes a kernel's grid.
    max_query_len: int | None = None
    max_seq_len: int | None = None
    # A prefill graph bucket's batch: one sequence, its real rows first, then padding.
    prefill_bucket: bool = False
    # Models with Gated DeltaNet layers, per sequence: its recurrent-state slot, and how many of its
    # tokens advance the state in place (its length; 0 for a verify, whose drafts wait for the
    # verdict: model/recurrent_state.py). Device tensors; eager steps also carry the host lists.
    state_slots: torch.Tensor | None = None
    state_advance: torch.Tensor | None = None
    state_slots_host: list[int] | None = None
    state_advance_host: list[int] | None = None
    # What every layer of one kind derives from the batch alike (e.g. DeltaNet's row plans), kept once.
    layer_cache: dict = field(default_factory=dict)
    # KV cache groups 1.. (sliding-window groups of a mixed model): each one's block tables and slots.
    group_tables: tuple[torch.Tensor, ...] = ()
    group_slots: tuple[torch.Tensor, ...] = ()
    # Tree verification: [T] int64 visibility bits per query token (module docstring), -1 for tokens
    # of ordinary rows; None when the batch holds no tree row (every kernel then runs as before).
    tree_mask: torch.Tensor | None = None
    # Rows rotated apart from their storage positions (PFlash): every rope position is below this.
    rope_bound: int | None = None
    # KVFlash's chunk scores: each paged layer's post-RoPE queries of every row's last token, keyed by
    # id(k_cache) ([rows, heads, head_dim]); None: not captured (eager steps only).
    query_capture: dict | None = None

    def group(self, g: int) -> "ForwardBatch":
        """This batch as layers of KV cache group g see it: group g's block tables and slot mapping
        (0: the primary group, this batch itself). Made once per group and step."""
        if g == 0:
            return self
        views = self.layer_cache.setdefault("kv_groups", {})
        if g not in views:
            views[g] = dataclasses.replace(self, block_tables=self.group_tables[g - 1],
                                           slot_mapping=self.group_slots[g - 1], group_tables=(), group_slots=(),
                                           captured={}, layer_cache={})
        return views[g]

    def set_state_rows(self, slots: list[int], advance: list[int]) -> None:
        """Each sequence's recurrent slot and how many of its tokens advance the state in place."""
        self.state_slots_host, self.state_advance_host = list(slots), list(advance)
        self.state_slots = host_to_device(self.state_slots_host, self.input_ids.device, torch.long)
        self.state_advance = host_to_device(self.state_advance_host, self.input_ids.device, torch.long)

    @property
    def position_bound(self) -> int:
        """Every position of the batch is below this, known on the host without a device sync."""
        if self.seq_lens_host:
            return max(max(self.seq_lens_host), self.rope_bound or 0)
        return self.max_seq_len if self.max_seq_len is not None else 0

    @property
    def query_starts_host(self) -> list[int]:
        """Host prefix sums of query_lens_host: sequence i's tokens are rows [starts[i], starts[i+1])."""
        cached = getattr(self, "_starts_cache", None)
        if cached is None:
            cached = self._starts_cache = list(itertools.accumulate(self.query_lens_host, initial=0))
        return cached

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def device_only(self) -> bool:
        return self.query_lens_host is None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def context_slots(self, i: int) -> torch.Tensor:
        """Cache slots of positions 0..seq_len-1 of sequence i (cached context plus new tokens)."""
        cached = getattr(self, "_slots_cache", None)
        if cached is None:
            cached = self._slots_cache = {}
        if i not in cached:
            n = self.seq_lens_host[i]
            pos = torch.arange(n, device=self.block_tables.device)
            blocks = self.block_tables[i, pos // self.block_size].long()
            cached[i] = blocks * self.block_size + pos % self.block_size
        return cached[i]

    def select(self, seqs: list[int]) -> tuple["ForwardBatch", torch.Tensor]:
        """(the batch of sequences `seqs` alone, the rows of their tokens in this batch's [T, ...]
        tensors), for handing part of an eager step to another kernel (e.g. its decodes to the
        Triton kernel when its prefill chunks go elsewhere). Host lengths required; cached, since
        every layer asks for the same split."""
        cached = getattr(self, "_select_cache", None)
        if cached is None:
            cached = self._select_cache = {}
        key = tuple(seqs)
        if key not in cached:
            starts = self.query_starts_host
            q_lens = [self.query_lens_host[i] for i in seqs]
            device = self.input_ids.device
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]).to(device)
            idx = torch.tensor(seqs, dtype=torch.long, device=device)
            sub_starts = list(itertools.accumulate(q_lens, initial=0))
            sub = ForwardBatch(
                input_ids=self.input_ids[rows], positions=self.positions[rows],
                query_start_loc=torch.tensor(sub_starts, dtype=self.query_start_loc.dtype, device=device),
                seq_lens=self.seq_lens[idx], block_tables=self.block_tables[idx], slot_mapping=self.slot_mapping[rows],
                block_size=self.block_size, query_lens_host=q_lens,
                seq_lens_host=[self.seq_lens_host[i] for i in seqs],
                tree_mask=self.tree_mask[rows] if self.tree_mask is not None else None, rope_bound=self.rope_bound)
            cached[key] = (sub, rows)
        return cached[key]

    @classmethod
    def build(cls, token_ids: list[list[int]], start_positions: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu", capture_layers: tuple[int, ...] = (),
              group_tables: list[list[list[int]]] = (),
              tree_parents: list[list[int] | None] | None = None,
              rope_positions: list[list[int] | None] | None = None,
              rope_shifts: list[int] | None = None) -> "ForwardBatch":
        """token_ids[i] are the new tokens of sequence i, placed at start_positions[i]...;
        group_tables[g - 1][i]: sequence i's table in KV cache group g (mixed windows);
        tree_parents[i], when given and not None, makes sequence i a tree verify row (parents as
        tree_mask_bits takes them): rope positions start + depth, the tree's visibility masks;
        rope_positions[i], when given and not None: sequence i's tokens' RoPE positions (a PFlash
        prompt kept at its original positions), which replace start + i / start + depth;
        rope_shifts[i], when given: added to sequence i's start + i / start + depth (decoding past a
        compressed prompt, a KVFlash view's tail), storage unchanged."""
        if tree_parents is not None and len(tree_parents) != len(token_ids):
            raise ValueError(f"tree_parents has {len(tree_parents)} entries for {len(token_ids)} sequences")
        if rope_shifts is not None and len(rope_shifts) != len(token_ids):
            raise ValueError(f"rope_shifts has {len(rope_shifts)} entries for {len(token_ids)} sequences")
        ids, positions, starts, masks = [], [], [0], []
        for i, (toks, start) in enumerate(zip(token_ids, start_positions)):
            ids.extend(toks)
            parents = tree_parents[i] if tree_parents is not None else None
            rotated = start + (rope_shifts[i] if rope_shifts is not None else 0)
            if parents is None:
                positions.extend(range(rotated, rotated + len(toks)))
                masks.extend([-1] * len(toks))
            else:
                if len(parents) != len(toks):
                    raise ValueError(f"sequence {i}: {len(parents)} tree parents for {len(toks)} tokens")
                positions.extend(rotated + d for d in tree_depths(parents))
                masks.extend(tree_mask_bits(parents))
            rope = rope_positions[i] if rope_positions is not None else None
            if rope is not None:
                if len(rope) != len(toks):
                    raise ValueError(f"sequence {i}: {len(rope)} rope positions for {len(toks)} tokens")
                positions[len(positions) - len(toks):] = rope
            starts.append(starts[-1] + len(toks))
        seq_lens = [s + len(t) for s, t in zip(start_positions, token_ids)]
        apart = rope_positions is not None or (rope_shifts is not None and any(rope_shifts))
        rope_bound = max(positions) + 1 if apart and positions else None

        def as_tensor(values, dtype=torch.int64):
            return host_to_device(values, device, dtype)

        def tables_and_slots(tables: list[list[int]]):
            slots = [table[pos // block_size] * block_size + pos % block_size
                     for toks, start, table in zip(token_ids, start_positions, tables)
                     for pos in range(start, start + len(toks))]
            width = max((len(t) for t in tables), default=0)
            padded = [t + [-1] * (width - len(t)) for t in tables]
            return as_tensor(padded, torch.int32).reshape(len(padded), width), as_tensor(slots)

        tables, slots = tables_and_slots(block_tables)
        groups = [tables_and_slots(g) for g in group_tables]
        return cls(
            input_ids=as_tensor(ids), positions=as_tensor(positions), query_start_loc=as_tensor(starts),
            seq_lens=as_tensor(seq_lens), block_tables=tables, slot_mapping=slots, block_size=block_size,
            capture_layers=tuple(capture_layers), query_lens_host=[len(t) for t in token_ids], seq_lens_host=seq_lens,
            group_tables=tuple(t for t, _ in groups), group_slots=tuple(s for _, s in groups),
            tree_mask=as_tensor(masks) if tree_parents is not None and any(p is not None for p in tree_parents)
            else None, rope_bound=rope_bound)

    @classmethod
    def from_device(cls, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, query_len: int,
                    query_start_loc: torch.Tensor | None = None, capture_layers: tuple[int, ...] = (),
                    group_tables: tuple[torch.Tensor, ...] = (), group_slots: tuple[torch.Tensor, ...] = (),
                    tree_mask: torch.Tensor | None = None) -> "ForwardBatch":
        """A batch over existing device tensors where every sequence brings `query_len` tokens
        (padding included); nothing here reads a tensor's values, so it can be captured in a graph.
        tree_mask: [T] int64 visibility bits (-1 for ordinary rows), or None for no tree rows."""
        num_seqs = int(seq_lens.shape[0])
        if query_start_loc is None:
            query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int64, device=input_ids.device) * query_len
        return cls(input_ids=input_ids, positions=positions, query_start_loc=query_start_loc, seq_lens=seq_lens,
                   block_tables=block_tables, slot_mapping=slot_mapping, block_size=block_size,
                   capture_layers=tuple(capture_layers), query_lens_host=None, seq_lens_host=None,
                   max_query_len=query_len, max_seq_len=int(block_tables.shape[1]) * block_size,
                   group_tables=tuple(group_tables), group_slots=tuple(group_slots), tree_mask=tree_mask)
