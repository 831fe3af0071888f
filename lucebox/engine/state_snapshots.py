"""Recurrent-state snapshots at block boundaries: what makes a cached prefix reusable on hybrids.

A Gated DeltaNet layer's state belongs to the whole prefix before it, so a prefix whose K/V the
paged cache holds is reusable only where the recurrent state after exactly that prefix is kept
too. This pool keeps such states -- every recurrent layer's state and conv window, one entry the
size of one sequence's slot -- keyed by the chained block hash of the prefix they end
(engine/block_manager.chain_hash), least recently used evicted first. CacheManager takes them:
  prompt   at the last block boundary a later request repeating the prompt can be served up to,
           (length - 1) // block_size * block_size; the scheduler ends a prefill chunk exactly
           there (CacheManager.prefill_cut)
  branch   where a prompt leaves the blocks another cached (the end of a system prompt shared by
           two conversations): a chunk ends there too, so the third conversation finds a state;
           with the prompt's, a prompt takes at most two more (short) steps
  decode   whenever a commit reaches a block boundary past that one (a decode step completing a
           block; a verify whose accepted tokens cross one has its state commit split there, one
           more launch pair that step): the sequence's one moving entry, overwritten as it grows,
           so a finished sequence leaves the state of the last boundary it reached
and a new sequence's slot is loaded from the snapshot of the longest cached prefix that has one
(CacheManager.recurrent_prefix_hit). Cost: one copy of a slot's state per block_size committed
tokens per sequence (Qwen3.6-27B: ~150 MB per snapshot, 48 layers of a [48, 128, 128] float32
state), between steps; nothing when the pool has no entries (--recurrent-prefix-snapshots 0).
"""
from __future__ import annotations

from collections import OrderedDict

from ..model.cache_spec import RecurrentSpec, bytes_per_sequence
from ..model.recurrent_state import RecurrentState


def snapshot_bytes(specs, entries: int) -> int:
    """Bytes of a pool of `entries` snapshots of these specs' recurrent state (0 without any)."""
    return entries * bytes_per_sequence([s for s in specs if isinstance(s, RecurrentSpec)])


class StateSnapshots:
    def __init__(self, pools: list[RecurrentState], capacity: int):
        """pools: the recurrent storage whose slots are snapshotted (CacheManager.pools)."""
        if capacity < 1:
            raise ValueError(f"a snapshot pool needs at least one entry, got {capacity}")
        self.pools, self.capacity = pools, capacity
        self.storage = [pool.snapshot_storage(capacity) for pool in pools]
        self.entries: OrderedDict[int, int] = OrderedDict()  # prefix hash -> entry, least recently used first
        self.free = list(range(capacity - 1, -1, -1))
        self.moving: dict[int, int] = {}  # owner (id of a running sequence) -> the hash of its moving entry
        self.saved = self.loaded = self.evicted = 0
        self.loaded_tokens = 0  # prefix tokens the loaded states stood for (not recomputed)

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def save(self, key: int, slot: int, owner: int | None = None) -> None:
        """Keep slot's state as the state after the prefix hashed `key` (only touched when kept
        already: the state of a prefix is one). owner: the entry is that sequence's moving one,
        which its next save overwrites instead of taking another."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        old = self.moving.get(owner) if owner is not None else None
        if old is not None and old in self.entries:
            entry = self.entries.pop(old)
        elif self.free:
            entry = self.free.pop()
        else:
            _, entry = self.entries.popitem(last=False)
            self.evicted += 1
        for pool, storage in zip(self.pools, self.storage):
            pool.save(slot, storage, entry)
        self.entries[key] = entry
        self.saved += 1
        if owner is not None:
            self.moving[owner] = key

    def load(self, key: int, slot: int, tokens: int = 0) -> None:
        """Slot's state becomes the one kept for the prefix hashed `key` (which must be kept), a
        prefix of `tokens` tokens (counted in loaded_tokens)."""
        entry = self.entries[key]
        self.entries.move_to_end(key)
        for pool, storage in zip(self.pools, self.storage):
            pool.load(storage, entry, slot)
        self.loaded += 1
        self.loaded_tokens += tokens

    def release(self, owner: int) -> None:
        """The owner's sequence is gone: its moving entry stays, as any other."""
        self.moving.pop(owner, None)
