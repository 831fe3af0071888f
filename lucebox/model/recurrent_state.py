"""RecurrentState: the fixed-size per-sequence state of one Gated DeltaNet layer, in slots.

Storage (a slot is one sequence's; slots are handed out by engine/cache_manager.py):
  state   [num_slots + 1, Hv, dk, dv]   the recurrent state after the last committed position
  conv    [num_slots + 1, channels, K-1] the short conv's window of past (pre-conv) inputs
  stash   per slot, `positions` rows of a verify's (or a step launched ahead's) per-token inputs:
          the raw pre-conv row and the conv's output [channels] each (its k and v parts, before
          normalisation, are what the recurrence reads), g [Hv] and beta [Hv]
The last slot (`scratch`) belongs to no sequence: CUDA-graph padding reads and writes it. The
layers of one shape share one pool (`layers=L`, per-layer views), so a commit is one launch pair.

Speculative verify = stash and recompute: a verify row of 1 + k tokens computes its outputs from
the slot's state without writing it, and stashes its per-token inputs; `commit(slots, accepted)`
then advances the state over the first accepted + 1 stashed tokens (the same kernel, state written)
and makes the conv window the K-1 raw inputs ending at the last of them. A stashed position costs
2 * channels + 2 * Hv values, a state snapshot Hv*dk*dv (Qwen3.6-27B: 20.6K vs 786K).

Prefix snapshots (engine/state_snapshots.py): a slot's state and conv window in every layer of the
pool copied out to (`save`) or in from (`load`) an entry of snapshot storage [entries, layers, ...];
two copies each, eager between steps (CUDA graphs read the slot tensors in place, never these).

Tree verifies (DDTree) stash node i at row i like any verify; the accepted path's rows a_0 = 0 <
a_1 < ... move onto rows 0, 1, ... first (`compact_stash`), and the commit is then a chain's.
"""
from __future__ import annotations

import torch

from ..kernels.gated_delta import conv_windows, gated_delta_steps


class RecurrentState:
    def __init__(self, num_slots: int, positions: int, state_shape: tuple[int, int, int],
                 conv_shape: tuple[int, int], key_heads: int, dtype: torch.dtype, device: torch.device | str,
                 layers: int = 1):
        """layers > 1: the storage of that many layers of one shape back to back (a pool): `layer(i)`
        is layer i's RecurrentState (views), and one `commit` advances every layer at once."""
        self.num_slots, self.positions, self.scratch, self.layers = num_slots, positions, num_slots, layers
        v_heads, dk, _ = state_shape
        self.key_heads, self.key_dim = key_heads, key_heads * dk
        channels, _ = conv_shape
        # per layer: its slots, then its stash rows slot * positions + i (flat, so kernels index them
        # like a batch's token rows) and one more (`trash`) for rows of a step longer than the stash
        self.slots_per_layer, self.rows_per_layer = num_slots + 1, (num_slots + 1) * positions + 1
        self.trash = self.rows_per_layer - 1
        slots, rows = layers * self.slots_per_layer, layers * self.rows_per_layer
        self.state = torch.zeros(slots, *state_shape, dtype=dtype, device=device)
        self.conv = torch.zeros(slots, *conv_shape, dtype=dtype, device=device)
        self.stash_raw = torch.zeros(rows, channels, dtype=dtype, device=device)
        self.stash_mixed = torch.zeros(rows, channels, dtype=dtype, device=device)
        self.stash_g = torch.zeros(rows, v_heads, dtype=dtype, device=device)
        self.stash_beta = torch.zeros(rows, v_heads, dtype=dtype, device=device)

    def layer(self, i: int) -> "RecurrentState":
        """Layer i of a pool: a RecurrentState over its slices of the shared tensors."""
        view = object.__new__(RecurrentState)
        view.__dict__.update(self.__dict__)
        view.layers = 1
        slots = slice(i * self.slots_per_layer, (i + 1) * self.slots_per_layer)
        rows = slice(i * self.rows_per_layer, (i + 1) * self.rows_per_layer)
        view.state, view.conv = self.state[slots], self.conv[slots]
        for name in ("stash_raw", "stash_mixed", "stash_g", "stash_beta"):
            setattr(view, name, getattr(self, name)[rows])
        return view

    def reset(self, slots: torch.Tensor) -> None:
        """A new sequence's slots start from the zero state (no history)."""
        slots = slots.to(self.state.device)  # a split model's pools lie on their layers' devices
        self.state[slots] = 0
        self.conv[slots] = 0

    @property
    def conv_stash(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw, mixed) stores the conv of a step's rows fills (kernels.gated_delta.conv_steps)."""
        return self.stash_raw, self.stash_mixed

    def gate_stash(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g store, beta store, rows): where kernels.gated_delta.gates keeps tokens' g and beta, at
        stash rows `rows` (slot * positions + index in the verify)."""
        return self.stash_g, self.stash_beta, rows

    def compact_stash(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Stash row slot * positions + src[i] moves onto slot * positions + dst[i] in every layer
        (flat per-layer stash rows): a tree verify's accepted path becomes stash rows 0, 1, ..., what
        `commit` advances over. The gather reads every source before any destination is written."""
        layer = (torch.arange(self.layers, device=src.device) * self.rows_per_layer)[:, None]
        src, dst = (layer + src).reshape(-1), (layer + dst).reshape(-1)
        for t in (self.stash_raw, self.stash_mixed, self.stash_g, self.stash_beta):
            t.index_copy_(0, dst, t.index_select(0, src))

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        """After a verify of `slots` (device tensors, one entry a sequence): advance each state over
        its first accepted + 1 stashed tokens, the conv window to the raw inputs ending there.
        skip: stashed tokens per sequence applied already (a commit split at a block boundary,
        where a prefix snapshot is taken in between)."""
        if self.positions == 0:
            raise RuntimeError("this recurrent pool keeps no verify stash (built with 0 positions)")
        device = self.state.device  # a split model's pools lie on their layers' devices
        slots, accepted = slots.to(device), accepted.to(device)
        skip = skip.to(device) if skip is not None else None
        layer = torch.arange(self.layers, device=slots.device)[:, None]  # a pool: every layer in one launch
        skip = torch.zeros_like(accepted) if skip is None else skip
        count = (accepted + 1 - skip).repeat(self.layers)
        first = (layer * self.rows_per_layer + slots * self.positions + skip).reshape(-1)
        slots = (layer * self.slots_per_layer + slots).reshape(-1)
        v_heads, dk, dv = self.state.shape[1:]
        k = self.stash_mixed[:, self.key_dim:2 * self.key_dim].view(-1, self.key_heads, dk)
        v = self.stash_mixed[:, 2 * self.key_dim:].view(-1, v_heads, dv)
        gated_delta_steps(None, k, v, self.stash_g, self.stash_beta, self.state, slots, first, first + count, count,
                          self.positions, outputs=False, normalize=True)
        conv_windows(self.stash_raw, self.conv, slots, first, count)

    def slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state, conv) of one slot in every layer: views [layers, ...] of the pool, written in place."""
        state = self.state.view(self.layers, self.slots_per_layer, *self.state.shape[1:])[:, slot]
        conv = self.conv.view(self.layers, self.slots_per_layer, *self.conv.shape[1:])[:, slot]
        return state, conv

    def snapshot_storage(self, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state, conv) storage of `entries` snapshots of one slot: [entries, layers, ...] each."""
        return (self.state.new_zeros(entries, self.layers, *self.state.shape[1:]),
                self.conv.new_zeros(entries, self.layers, *self.conv.shape[1:]))

    def save(self, slot: int, storage: tuple[torch.Tensor, torch.Tensor], entry: int) -> None:
        """Copy slot's live state and conv window (every layer) into snapshot entry `entry` of `storage`."""
        for dst, src in zip(storage, self.slot_views(slot)):
            dst[entry].copy_(src)

    def load(self, storage: tuple[torch.Tensor, torch.Tensor], entry: int, slot: int) -> None:
        """Slot's live state and conv window (every layer) become snapshot entry `entry` of `storage`."""
        for dst, src in zip(self.slot_views(slot), storage):
            dst.copy_(src[entry])

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the live state of slots src[i] -> dst[i] (a forked sequence, e.g. n > 1 samples)."""
        src, dst = src.to(self.state.device), dst.to(self.state.device)
        self.state[dst] = self.state[src]
        self.conv[dst] = self.conv[src]
