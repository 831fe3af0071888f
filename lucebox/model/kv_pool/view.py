"""KVView: the resident part of a sequence's KV as attention reads it.

A sequence's block table stays logical (entry i holds positions i*B .. i*B+B-1); under a bounded
pool some entries are not resident (their K/V live only in host memory). Attention reads a compact
table of the resident blocks in logical order, so the tokens stored in it sit at STORAGE positions
0.. while their keys were rotated at their LOGICAL positions when written. Every resident block but
the tail's last is full, so the storage position of a logical position p in a resident block is
(its block's index in the view) * B + p % B. New tokens always land in the tail (the blocks from
`tail_from` to the table's end, all resident), so a row's tokens are contiguous in storage too.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class KVView:
    selected: tuple[int, ...]  # resident logical blocks before the tail, ascending
    tail_from: int  # every block from here to the table's end is resident
    block_size: int

    @classmethod
    def identity(cls, block_size: int) -> "KVView":
        """Every block resident: storage = logical."""
        return cls((), 0, block_size)

    def blocks(self, table_len: int) -> list[int]:
        """Logical indices of the resident blocks of a table of table_len entries, in order."""
        return [*self.selected, *range(self.tail_from, table_len)]

    def table(self, block_table: list[int]) -> list[int]:
        """The compact table attention reads: the resident entries of block_table, in order."""
        return [block_table[i] for i in self.selected] + block_table[self.tail_from:]

    def storage(self, position: int) -> int:
        """Storage position (in the compact table) of logical `position`, which must be resident."""
        index = position // self.block_size
        if index >= self.tail_from:
            return (len(self.selected) + index - self.tail_from) * self.block_size + position % self.block_size
        at = bisect.bisect_left(self.selected, index)
        if at == len(self.selected) or self.selected[at] != index:
            raise ValueError(f"position {position} (block {index}) is not resident")
        return at * self.block_size + position % self.block_size

    @property
    def shift(self) -> int:
        """Logical minus storage position of every tail position (what new tokens are rotated past storage)."""
        return (self.tail_from - len(self.selected)) * self.block_size

    @property
    def is_identity(self) -> bool:
        return self.shift == 0
