"""Paged KV bookkeeping: a pool of fixed-size blocks and each sequence's block table."""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self.free_blocks)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it holds `num_tokens` tokens."""
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"KV pool exhausted: need {needed} blocks, {len(self.free_blocks)} free")
        block_table.extend(self.free_blocks.popleft() for _ in range(needed))

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Release the blocks past `num_tokens` tokens (speculative rollback, shorter context)."""
        keep = -(-num_tokens // self.block_size)
        while len(block_table) > keep:
            self.free_blocks.append(block_table.pop())

    def free(self, block_table: list[int]) -> None:
        self.truncate(block_table, 0)
