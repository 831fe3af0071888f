"""Prefix hits on models mixing sliding-window and full attention (engine/cache_manager.py): what each
window group serves of a prefix the primary group has cached, and which of a sequence's window blocks a
later prompt's hit reads (released last, BlockManager.release_before)."""
from __future__ import annotations

from .block_manager import BlockManager, prefix_chunks


class CachedPrefix(list):
    """A prefix-cache hit: the primary group's block ids (a list, as the scheduler reads them) and
    per window group (released entries before its blocks, its cached block ids)."""

    def __init__(self, primary: list[int], windows: list[tuple[int, list[int]]]):
        super().__init__(primary)
        self.windows = windows


def window_hit(pools: list[BlockManager], windows: list[int], block_size: int, token_ids: list[int],
               found: list[int]) -> CachedPrefix:
    """The longest prefix of `found` (k blocks, n = k * block_size tokens) every window group can
    serve: the first query, at position n, reads keys from n - W + 1 on, so a group of window W
    needs its cached blocks from (n - W + 1) // block_size to k - 1 (those before are released
    entries)."""
    chunks = list(prefix_chunks(token_ids[:len(found) * block_size], block_size))
    present = [list(pool.lookup(chunks)) for pool in pools]
    for k in range(len(found), -1, -1):
        firsts = [max(0, k * block_size - w + 1) // block_size for w in windows]
        if all(None not in ids[first:k] for ids, first in zip(present, firsts)):
            return CachedPrefix(found[:k], [(first, ids[first:k]) for ids, first in zip(present, firsts)])
    raise AssertionError("k = 0 needs no block")


def prompt_window(prompt_len: int, block_size: int, window: int) -> range:
    """Entries of a window group's table that a later prompt extending a prompt of prompt_len tokens
    reads on a hit at its last full block (window_hit): a thinking model's next turn drops the output."""
    k = (prompt_len - 1) // block_size
    return range(max(0, k * block_size - window + 1) // block_size, k)
