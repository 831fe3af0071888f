"""A device ring of captured target features, written by the forward itself.

DFlash needs the target's tapped features of every committed position. Gathering them out of a
step's output costs each step a launch (an index_select, tens of microseconds of host time on a
fast GPU: 5-10% of a small target's step, paid even while adaptive speculation keeps the drafter
off). Instead the engine reserves ring rows for a step's tokens and the CUDA graph writes each
token's features straight into its row (padding into a trash row past the end); what the engine
hands the proposer is the row range (`RingRows`), pure bookkeeping. The proposer projects rows
before the cursor comes round to them again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..util import host_to_device


@dataclass(frozen=True)
class RingRows:
    """Consecutive ring rows `first`..first+count-1, sliced like the features tensor they stand for."""

    first: int
    count: int

    def __getitem__(self, index: slice) -> RingRows:
        start, stop, step = index.indices(self.count)
        if step != 1:
            raise IndexError("ring rows slice with step 1 only")
        return RingRows(self.first + start, max(0, stop - start))

    @property
    def shape(self) -> tuple[int]:
        return (self.count,)


class FeatureRing:
    def __init__(self, rows: int, width: int, dtype: torch.dtype, device):
        self.capacity = rows
        self.rows = torch.zeros(rows + 1, width, dtype=dtype, device=device)  # the last: padding's trash row
        self.trash = rows
        self.row_bytes = width * self.rows.element_size()
        self.cursor = 0

    def reserve(self, n: int) -> int | None:
        """First of n consecutive rows for a step's tokens (None: more than half the ring, which a
        step through a graph never is; an eager prefill chunk returns its features as a tensor)."""
        if n > self.capacity // 2:
            return None
        if self.cursor + n > self.capacity:
            self.cursor = 0
        first, self.cursor = self.cursor, self.cursor + n
        return first

    def gather(self, parts: list[RingRows]) -> torch.Tensor:
        """The features of `parts`, in order: a view when they are consecutive rows."""
        first, end = parts[0].first, parts[0].first
        consecutive = True
        for p in parts:
            consecutive &= p.first == end
            end = p.first + p.count
        if consecutive:
            return self.rows[first:end]
        rows = [r for p in parts for r in range(p.first, p.first + p.count)]
        return self.rows[host_to_device(rows, self.rows.device)]
