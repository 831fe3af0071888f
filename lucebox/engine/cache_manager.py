"""CacheManager: all of a sequence's cache state, whatever its layers keep (model/cache_spec.py).

The scheduler and the engine grow, commit, roll back and free a sequence here; they see bytes
per token and per sequence, never a layer's tensors:
  paged K/V          blocks of the BlockManager (block tables, prefix caching, ref counts)
  KV cache groups    (model/cache_spec.kv_groups) layers sharing one block table per sequence and one
                     pool: the primary group (full-attention layers and proposers' caches; its
                     table is seq.block_table) and, in a model mixing windows, one group per
                     window (seq.window_tables, each with its own BlockManager and pool).
  window-bounded     in a group with a window (every group of a model mixing windows but the
                     primary; the one group when every paged spec is windowed), blocks wholly
                     behind the window of the next position to compute go back to the pool as the
                     sequence commits; their table entries become the BlockManager's `released`
                     id (the group's scratch block), so tables keep their shape and attention,
                     which reads only positions inside the window, never sees them.
  recurrent state    one slot per sequence in a pool; a verify leaves the state alone and stashes its
                     tokens' inputs, and the rollback after its verdict advances the state over
                     the accepted ones (model/recurrent_state.RecurrentState.commit).
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..model.cache_spec import KVGroup, RecurrentSpec, bytes_per_sequence, bytes_per_token, kv_groups
from ..model.recurrent_state import RecurrentState
from ..util import host_to_device
from .block_manager import BlockManager, extend_hashes, prefix_chunks
from .sequence import Sequence

log = logging.getLogger("lucebox")


class CachedPrefix(list):
    """A prefix-cache hit: the primary group's block ids (a list, as the scheduler reads them) and
    per window group (released entries before its blocks, its cached block ids)."""

    def __init__(self, primary: list[int], windows: list[tuple[int, list[int]]]):
        super().__init__(primary)
        self.windows = windows


class CacheManager:
    def __init__(self, specs, num_blocks: int | list[int], block_size: int, enable_prefix_caching: bool = True,
                 num_slots: int = 0, verify_positions: int = 0, groups: list[KVGroup] | None = None):
        """specs: every cache spec whose state follows the target's sequences (the model's layers
        and the proposer's); num_blocks: the pool of each KV cache group (kv_groups(specs); one
        number: every group's); num_slots / verify_positions: recurrent slots (at most this many
        sequences at once) and the positions a verify may stash (1 + the longest draft); groups:
        the KV cache groups when not kv_groups(specs) (the runner's, runner.model_kv_groups)."""
        self.specs = tuple(specs)
        self.recurrent = [s for s in self.specs if isinstance(s, RecurrentSpec)]
        self.groups = groups if groups is not None else kv_groups(self.specs)
        counts = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * max(1, len(self.groups))
        # Recurrent state belongs to the whole prefix, not to a block: no prefix sharing with it.
        prefix = enable_prefix_caching and not self.recurrent
        self.blocks = BlockManager(counts[0], block_size, prefix)  # the primary group's pool
        self.window_pools = [BlockManager(n, block_size, prefix) for n in counts[1:]]  # one per window group
        self.windows = [g.window for g in self.groups[1:]]
        self.block_size = block_size
        self.verify_positions = verify_positions
        # The primary group's release window: set when every paged spec is windowed (tests set None).
        self.release_window = self.groups[0].window if self.groups else None
        self.states: list[RecurrentState] = []  # one per recurrent spec (layer)
        self.pools: list[RecurrentState] = []  # the storage they view: one pool, or the states themselves
        self.free_slots = list(range(num_slots - 1, -1, -1)) if self.recurrent else []
        self.slots: dict[int, int] = {}  # id(seq) -> its recurrent slot
        self._pending_commits: list[tuple[int, int]] = []  # (slot, accepted) of rollbacks not applied yet
        self._batching = False

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.specs)

    @property
    def bytes_per_sequence(self) -> int:
        return bytes_per_sequence(self.specs, self.verify_positions)

    def build_recurrent(self, device: torch.device | str) -> list[RecurrentState]:
        """The storage of every recurrent spec, one slot per sequence the pool admits (and a scratch slot)."""
        num_slots = len(self.free_slots) + len(self.slots)
        if self.recurrent and len(set(self.recurrent)) == 1:  # one shape (Qwen 3.5): one pool, commits at once
            self.pools = [self.recurrent[0].build(num_slots, self.verify_positions, device, len(self.recurrent))]
            self.states = [self.pools[0].layer(i) for i in range(len(self.recurrent))]
        else:
            self.states = [s.build(num_slots, self.verify_positions, device) for s in self.recurrent]
            self.pools = self.states
        return self.states

    # ------------------------------------------------------------------ admission and growth
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """The primary group's cached blocks of a prefix of token_ids, shortened to what every
        window group can serve (window_hit); a CachedPrefix carries the window groups' blocks."""
        found = self.blocks.match_prefix(token_ids)
        return self.window_hit(token_ids, found) if self.window_pools else found

    def window_hit(self, token_ids: list[int], found: list[int]) -> CachedPrefix:
        """The longest prefix of `found` (k blocks, n = k * block_size tokens) every window group
        can serve: the first query, at position n, reads keys from n - W + 1 on, so a group of
        window W needs its cached blocks from (n - W + 1) // block_size to k - 1 (those before are
        released entries). Kept apart from the primary lookup on purpose (hybrid prefix caching
        changes that one)."""
        bs = self.block_size
        chunks = list(prefix_chunks(token_ids[:len(found) * bs], bs))
        present = [list(pool.lookup(chunks)) for pool in self.window_pools]
        for k in range(len(found), -1, -1):
            firsts = [max(0, k * bs - w + 1) // bs for w in self.windows]
            if all(None not in ids[first:k] for ids, first in zip(present, firsts)):
                return CachedPrefix(found[:k], [(first, ids[first:k]) for ids, first in zip(present, firsts)])
        raise AssertionError("k = 0 needs no block")

    def _window_hits(self, cached: list[int]) -> list[tuple[int, list[int]]]:
        """(released entries, cached blocks) each window group starts a table with."""
        hits = getattr(cached, "windows", None)
        if hits is None and cached and self.window_pools:  # the window groups' K/V of that prefix: unknown
            raise ValueError("a prefix hit on a model mixing sliding-window and full attention must come from "
                             "CacheManager.match_prefix (a CachedPrefix with every group's blocks)")
        return hits if hits is not None else [(0, [])] * len(self.window_pools)

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a new sequence starting from `cached` blocks fits: blocks of every group, and a
        slot if recurrent."""
        if self.recurrent and not self.free_slots:
            return False
        return self.blocks.can_admit(cached, num_tokens) and all(
            pool.can_admit(ids, num_tokens, skipped)
            for pool, (skipped, ids) in zip(self.window_pools, self._window_hits(cached)))

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        self.blocks.admit(seq.block_table, cached)
        seq.window_tables = [[] for _ in self.window_pools]
        for pool, table, (skipped, ids) in zip(self.window_pools, seq.window_tables, self._window_hits(cached)):
            pool.admit(table, ids, skipped)
        if self.recurrent:
            slot = self.free_slots.pop()
            self.slots[id(seq)] = slot
            index = torch.tensor([slot], device=self.states[0].state.device) if self.states else None
            for state in self.states:
                state.reset(index)

    def _tables(self, seq: Sequence):
        """(pool, table, release window) of every group of seq."""
        yield self.blocks, seq.block_table, self.release_window
        yield from zip(self.window_pools, seq.window_tables, self.windows)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return all(pool.can_allocate(table, num_tokens) for pool, table, _ in self._tables(seq))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Room for seq's first num_tokens tokens."""
        for pool, table, _ in self._tables(seq):
            pool.allocate(table, num_tokens)

    def commit(self, seq: Sequence) -> None:
        """seq.num_computed positions are now final: hash their full blocks for prefix sharing, and
        release the blocks no window of a position still to compute reaches."""
        start = len(seq.block_hashes)
        chunks = (extend_hashes(seq.block_hashes, seq.token_slice, seq.num_computed, self.block_size)
                  if self.blocks.enable_prefix_caching else [])
        for pool, table, window in self._tables(seq):
            if chunks:
                pool.register(table, start, chunks)
            if window is not None:
                pool.release_before(table, seq.num_computed - window + 1)

    def rollback(self, seq: Sequence, num_tokens: int, accepted: int | None = None) -> None:
        """Forget what lies past num_tokens tokens (rejected drafts); with `accepted` (a of k drafts,
        after a verify), recurrent state advances over the pending token and the accepted drafts
        (at once, or at the end of a `commits_batched` block)."""
        for pool, table, _ in self._tables(seq):
            pool.truncate(table, num_tokens)
        if accepted is not None and self.states:
            self._pending_commits.append((self.slots[id(seq)], accepted))
            if not self._batching:
                self._apply_commits()

    def advance_stashed(self, seqs: list[Sequence]) -> None:
        """Recurrent state advances over the one token a step launched ahead stashed for each of
        `seqs` (that step turned out to be used; an unused one leaves the state as it was)."""
        if self.states:
            with self.commits_batched():
                self._pending_commits.extend((self.slots[id(seq)], 0) for seq in seqs)

    @contextlib.contextmanager
    def commits_batched(self):
        """Rollbacks inside advance recurrent state when the block ends, all sequences in one
        launch per layer (a step's verifies: not one per sequence)."""
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            self._apply_commits()

    def _apply_commits(self) -> None:
        if not self._pending_commits:
            return
        slots, accepted = zip(*self._pending_commits)
        self._pending_commits.clear()
        device = self.states[0].state.device
        slots = host_to_device(list(slots), device, torch.long)
        accepted = host_to_device(list(accepted), device, torch.long)
        for pool in self.pools:
            pool.commit(slots, accepted)

    def free(self, seq: Sequence) -> None:
        """Everything seq holds goes back (finished, aborted or preempted)."""
        for pool, table, _ in self._tables(seq):
            pool.free_table(table)
        slot = self.slots.pop(id(seq), None)
        if slot is not None:
            self.free_slots.append(slot)

    def held_blocks(self, seq: Sequence) -> int:
        """Pool blocks seq holds, all groups together."""
        return sum(self.held_by_group(seq))

    def held_by_group(self, seq: Sequence) -> list[int]:
        """Pool blocks seq holds in each KV cache group (primary first)."""
        return [pool.held(table) for pool, table, _ in self._tables(seq)]

    def slot(self, seq: Sequence) -> int:
        return self.slots[id(seq)]
