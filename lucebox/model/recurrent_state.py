"""RecurrentState: the fixed-size per-sequence state of one recurrent layer (Gated DeltaNet), in slots.

Storage (a slot is one sequence's; slots are handed out by engine/cache_manager.py):
  state        [num_slots, *state_shape]                the recurrent state after the last kept position
  conv         [num_slots, *conv_shape]                 the short conv's window of past inputs
  snap_state   [num_slots, snapshots, *state_shape]     the state after each position of a verify
  snap_conv    [num_slots, snapshots, *conv_shape]
A verify of 1 + k tokens writes the state after position i into snapshot i (i = 0..k); accepting
a drafts keeps snapshot a. Snapshots, not recomputation: a rollback is one copy per slot.
"""
from __future__ import annotations

import torch


class RecurrentState:
    def __init__(self, num_slots: int, snapshots: int, state_shape: tuple[int, ...], conv_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str):
        self.num_slots, self.snapshots = num_slots, snapshots
        self.state = torch.zeros(num_slots, *state_shape, dtype=dtype, device=device)
        self.conv = torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device)
        self.snap_state = torch.zeros(num_slots, snapshots, *state_shape, dtype=dtype, device=device)
        self.snap_conv = torch.zeros(num_slots, snapshots, *conv_shape, dtype=dtype, device=device)

    def reset(self, slots: torch.Tensor) -> None:
        """A new sequence's slots start from the zero state (no history)."""
        self.state[slots] = 0
        self.conv[slots] = 0

    def snapshot(self, slots: torch.Tensor, index: torch.Tensor | int) -> None:
        """Keep the live state of `slots` as snapshot `index` (per slot, or one for all)."""
        self.snap_state[slots, index] = self.state[slots]
        self.snap_conv[slots, index] = self.conv[slots]

    def restore(self, slots: torch.Tensor, index: torch.Tensor | int) -> None:
        """Roll `slots` back to snapshot `index`: the state after the last accepted position."""
        self.state[slots] = self.snap_state[slots, index]
        self.conv[slots] = self.snap_conv[slots, index]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the live state of slots src[i] -> dst[i] (a forked sequence, e.g. n > 1 samples)."""
        self.state[dst] = self.state[src]
        self.conv[dst] = self.conv[src]
