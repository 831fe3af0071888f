"""Paged KV bookkeeping: a pool of fixed-size blocks, block tables, and prefix caching.

A full block is identified by a hash chained over the previous block's hash and its own token
ids, so equal hashes mean equal prefixes (token ids are compared too, against collisions).
Blocks are reference-counted; a freed block keeps its hash and stays findable until it is
reused, least recently freed first (lazy LRU eviction).

A table entry may be `released` (the id one past the pool: the runner's scratch block): a block
behind the sliding window of every layer using the table went back to the pool while the table
kept its length, so positions still index the table as before and attention never reads the entry
(engine/cache_manager.py). A model mixing windows has one BlockManager per KV cache group.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, token_ids))


def prefix_chunks(token_ids: list[int], block_size: int):
    """(chained hash, token ids) of each full block of token_ids, lazily (a lookup stops at a miss)."""
    prev = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = tuple(token_ids[start:start + block_size])
        prev = chain_hash(prev, chunk)
        yield prev, chunk


def extend_hashes(block_hashes: list[int], token_slice: Callable[[int, int], list[int]], num_computed: int,
                  block_size: int) -> list[tuple[int, tuple[int, ...]]]:
    """Append the chained hashes of the blocks num_computed tokens complete; returns the new blocks'
    (hash, token ids). token_slice(start, end): the sequence's tokens (read only for new blocks)."""
    new = []
    for index in range(len(block_hashes), num_computed // block_size):
        chunk = tuple(token_slice(index * block_size, (index + 1) * block_size))
        block_hashes.append(chain_hash(block_hashes[-1] if block_hashes else None, chunk))
        new.append((block_hashes[-1], chunk))
    return new


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hits = self.queries = 0  # prompt tokens served from cache / looked up
        self.released = num_blocks  # the entry of a released block: the scratch block, never read

    def held(self, block_table: list[int]) -> int:
        """Blocks of the pool this table holds (released entries excluded)."""
        return sum(1 for b in block_table if b != self.released)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Ids of cached blocks holding a prefix of `token_ids`; the last token is never served from
        cache, so the model still computes it and produces logits."""
        if not self.enable_prefix_caching:
            return []
        found, prev = [], None
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            chunk = tuple(token_ids[start:start + self.block_size])
            prev = chain_hash(prev, chunk)
            block_id = self.cached.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            found.append(block_id)
        return found

    def lookup(self, chunks):
        """Per (chained hash, token ids) of `chunks` (prefix_chunks): the cached block holding them, or
        None, lazily (a window group's side of a prefix hit: window_hits.window_hit)."""
        for h, chunk in chunks:
            block_id = self.cached.get(h)
            yield block_id if block_id is not None and self.blocks[block_id].token_ids == chunk else None

    def can_admit(self, cached: list[int], num_tokens: int, skipped: int = 0) -> bool:
        """Whether a new table starting with `skipped` released entries and then `cached` blocks can
        grow to hold `num_tokens` tokens."""
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # they leave the free pool
        return self.blocks_for(num_tokens) - len(cached) - skipped <= len(self.free) - reclaimed

    def admit(self, block_table: list[int], cached: list[int], skipped: int = 0) -> None:
        block_table.extend([self.released] * skipped)  # behind a window: never read
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            block_table.append(block_id)

    def register(self, block_table: list[int], start: int, chunks: list[tuple[int, tuple[int, ...]]]) -> None:
        """Make the table's blocks start, start + 1, ... findable by their (hash, token ids) `chunks`
        (extend_hashes: the blocks a commit completed), so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        for index, (h, chunk) in enumerate(chunks, start):
            if block_table[index] == self.released:  # the chain goes on; the block is gone
                continue
            block = self.blocks[block_table[index]]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, chunk
                self.cached[h] = block.id

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= len(self.free)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it holds `num_tokens` tokens."""
        needed = self.blocks_for(num_tokens) - len(block_table)
        if needed > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {needed} blocks, {len(self.free)} free")
        for _ in range(needed):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict: its old contents are about to be overwritten
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            block_table.append(block_id)

    def take(self, n: int) -> list[int]:
        """n free blocks for a table's existing entries (KVFlash paging a block back in)."""
        taken: list[int] = []
        self.allocate(taken, n * self.block_size)
        return taken

    def evict(self, block_table: list[int], indices: list[int]) -> None:
        """Give back the blocks at these entries of the table, which keeps its length (KVFlash: their K/V
        live on in host memory); the entries become `released`, never read."""
        for index in indices:
            self._release(block_table[index])
            block_table[index] = self.released

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Release the blocks past `num_tokens` tokens (preemption, speculative rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(block_table) > keep:
            block_id = block_table.pop()
            if block_id != self.released:
                self._release(block_id)

    def release_before(self, block_table: list[int], num_tokens: int, keep: range = range(0)) -> int:
        """Release the blocks wholly before token `num_tokens` (out of every window), keeping the
        table's length; returns how many were released now. Walks back from the last such block to
        the first one released before, so a step costs the blocks it releases. Entries in `keep` (the
        window a prefix hit at the prompt's end reads) join the free pool last, the others first: a
        window slid past mid-output is what a later prompt is least likely to reach."""
        released = 0
        index = min(num_tokens // self.block_size, len(block_table)) - 1
        while index >= 0 and block_table[index] != self.released:
            self._release(block_table[index], evict_first=index not in keep)
            block_table[index] = self.released
            released += 1
            index -= 1
        return released

    def free_table(self, block_table: list[int]) -> None:
        # Tail blocks first, so a prompt's early blocks, the likeliest to be shared, are evicted last.
        self.truncate(block_table, 0)

    def _release(self, block_id: int, evict_first: bool = False) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if evict_first:
                self.free.move_to_end(block_id, last=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
