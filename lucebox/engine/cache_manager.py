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
                     the accepted ones (model/recurrent_state.RecurrentState.commit; a tree's
                     accepted path is compacted onto the first stash rows first). Prefix
                     reuse needs the state after exactly the cached prefix: snapshots kept at block
                     boundaries (engine/state_snapshots.py); a hit counts only up to the longest
                     boundary that has both its blocks cached and a snapshot (recurrent_prefix_hit).
"""
from __future__ import annotations

import contextlib
import itertools
import logging

import torch

from ..model.cache_spec import KVGroup, RecurrentSpec, bytes_per_sequence, bytes_per_token, kv_groups
from ..model.recurrent_state import RecurrentState
from ..util import host_to_device
from .block_manager import BlockManager, extend_hashes
from .sequence import Sequence
from .state_snapshots import StateSnapshots, snapshot_bytes
from .window_hits import CachedPrefix, prompt_window, window_hit

log = logging.getLogger("lucebox")


class CacheManager:
    def __init__(self, specs, num_blocks: int | list[int], block_size: int, enable_prefix_caching: bool = True,
                 num_slots: int = 0, verify_positions: int = 0, groups: list[KVGroup] | None = None,
                 recurrent_snapshots: int = 0):
        """specs: every cache spec whose state follows the target's sequences (the model's layers
        and the proposer's); num_blocks: the pool of each KV cache group (kv_groups(specs); one
        number: every group's); num_slots / verify_positions: recurrent slots (at most this many
        sequences at once) and the positions a verify may stash (1 + the longest draft); groups:
        the KV cache groups when not kv_groups(specs) (the runner's, runner.model_kv_groups);
        recurrent_snapshots: entries of the state-snapshot pool that prefix reuse needs with
        recurrent layers (0: no prefix reuse for them)."""
        self.specs = tuple(specs)
        self.recurrent = [s for s in self.specs if isinstance(s, RecurrentSpec)]
        self.groups = groups if groups is not None else kv_groups(self.specs)
        counts = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * max(1, len(self.groups))
        self.snapshot_capacity = recurrent_snapshots if self.recurrent else 0
        # Recurrent state belongs to the whole prefix: sharing needs snapshots of it at block boundaries.
        prefix = enable_prefix_caching and (not self.recurrent or self.snapshot_capacity > 0)
        self.blocks = BlockManager(counts[0], block_size, prefix)  # the primary group's pool
        self.window_pools = [BlockManager(n, block_size, prefix) for n in counts[1:]]  # one per window group
        self.windows = [g.window for g in self.groups[1:]]
        self.snapshots: StateSnapshots | None = None  # built with the recurrent storage
        self.prompt_boundaries: dict[int, int] = {}  # id(seq) -> the boundary its prompt snapshot is taken at
        self.branch_points: dict[int, int] = {}  # id(seq) -> where its prompt leaves the cached blocks
        self._pending_snapshots: list[tuple[Sequence, int, int]] = []  # (seq, slot, boundary) after the commits
        self._pending_splits: dict[int, tuple[Sequence, int, int]] = {}  # slot -> (seq, tokens to, boundary inside)
        self.block_size = block_size
        self.verify_positions = verify_positions
        # The primary group's release window: set when every paged spec is windowed (tests set None).
        self.release_window = self.groups[0].window if self.groups else None
        self.states: list[RecurrentState] = []  # one per recurrent spec (layer)
        self.pools: list[RecurrentState] = []  # the storage they view: one pool, or the states themselves
        self.free_slots = list(range(num_slots - 1, -1, -1)) if self.recurrent else []
        self.slots: dict[int, int] = {}  # id(seq) -> its recurrent slot
        self._pending_commits: list[tuple[int, int]] = []  # (slot, accepted) of rollbacks not applied yet
        self._pending_moves: list[tuple[int, int]] = []  # (from, to) stash rows of accepted tree paths
        self._batching = False
        self.kv_pool = None  # KVFlash's KVPool (engine/kv_pool.py): pooled sequences enrol at admission

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.specs)

    @property
    def bytes_per_sequence(self) -> int:
        return bytes_per_sequence(self.specs, self.verify_positions)

    @property
    def snapshot_bytes(self) -> int:
        """The recurrent-state snapshot pool's bytes (hybrids' prefix reuse)."""
        return snapshot_bytes(self.recurrent, self.snapshot_capacity)

    def build_recurrent(self, device: torch.device | str, layer_devices: list | None = None) -> list[RecurrentState]:
        """The storage of every recurrent spec, one slot per sequence the pool admits (and a scratch slot);
        layer_devices: each spec's device (a model split across devices), else all on `device`."""
        num_slots = len(self.free_slots) + len(self.slots)
        devices = list(layer_devices) if layer_devices is not None else [device] * len(self.recurrent)
        if self.recurrent and len(set(self.recurrent)) == 1:  # one shape (Qwen 3.5): a pool a device, commits at once
            self.pools, self.states = [], [None] * len(self.recurrent)
            for where in dict.fromkeys(devices):
                mine = [i for i, d in enumerate(devices) if d == where]
                self.pools.append(self.recurrent[0].build(num_slots, self.verify_positions, where, len(mine)))
                for j, i in enumerate(mine):
                    self.states[i] = self.pools[-1].layer(j)
        else:
            self.states = [s.build(num_slots, self.verify_positions, d) for s, d in zip(self.recurrent, devices)]
            self.pools = self.states
        if self.snapshot_capacity and self.blocks.enable_prefix_caching:
            self.snapshots = StateSnapshots(self.pools, self.snapshot_capacity)
            log.info("prefix reuse with recurrent layers: %d state snapshots (%.1f MiB)", self.snapshot_capacity,
                     self.snapshot_bytes / 2**20)
        return self.states

    # ------------------------------------------------------------------ admission and growth
    def match_prefix(self, token_ids: list[int], seq: Sequence | None = None) -> list[int]:
        """The cached blocks a prompt starts from (seq: the scheduler's lookup before admitting it):
        the primary group's, shortened to where a recurrent snapshot exists (recurrent_prefix_hit)
        and to what every window group can serve (window_hit; a CachedPrefix then carries their blocks)."""
        # a PFlash-compressed prompt neither reuses nor offers cached blocks: its K/V are not the exact prompt's
        found = self.blocks.match_prefix(token_ids) if seq is None or seq.compression is None else []
        if self.recurrent:
            if seq is not None and self.snapshots is not None:
                # Where the prompt leaves another's cached blocks (the end of a shared system prompt, say):
                # a snapshot there serves the next prompt that shares them.
                self.branch_points[id(seq)] = len(found) * self.block_size
            found = self.recurrent_prefix_hit(found)
        return self.window_hit(token_ids, found) if self.window_pools else found
    def window_hit(self, token_ids: list[int], found: list[int]) -> CachedPrefix:
        """The longest prefix of `found` every window group can serve (window_hits.window_hit). Kept
        apart from the primary lookup on purpose (hybrid prefix caching changes that one)."""
        return window_hit(self.window_pools, self.windows, self.block_size, token_ids, found)

    def _window_hits(self, cached: list[int]) -> list[tuple[int, list[int]]]:
        """(released entries, cached blocks) each window group starts a table with."""
        hits = getattr(cached, "windows", None)
        if hits is None and cached and self.window_pools:  # the window groups' K/V of that prefix: unknown
            raise ValueError("a prefix hit on a model mixing sliding-window and full attention must come from "
                             "CacheManager.match_prefix (a CachedPrefix with every group's blocks)")
        return hits if hits is not None else [(0, [])] * len(self.window_pools)

    def can_admit(self, cached: list[int], num_tokens: int, seq: Sequence | None = None) -> bool:
        """Whether a new sequence starting from `cached` blocks fits: blocks of every group, a slot if
        recurrent, and (a pooled seq) host memory for its whole length."""
        if self.recurrent and not self.free_slots:
            return False
        if seq is not None and seq.kv_pool and self.kv_pool is not None and not self.kv_pool.can_enroll(seq):
            return False
        return self.blocks.can_admit(cached, num_tokens) and all(
            pool.can_admit(ids, num_tokens, skipped)
            for pool, (skipped, ids) in zip(self.window_pools, self._window_hits(cached)))

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        self.blocks.admit(seq.block_table, cached)
        if seq.kv_pool and self.kv_pool is not None:
            self.kv_pool.enroll(seq)
        seq.window_tables = [[] for _ in self.window_pools]
        for pool, table, (skipped, ids) in zip(self.window_pools, seq.window_tables, self._window_hits(cached)):
            pool.admit(table, ids, skipped)
        if self.recurrent:
            slot = self.free_slots.pop()
            self.slots[id(seq)] = slot
            self.prompt_boundaries[id(seq)] = self.prompt_boundary(seq)
            if cached and self.snapshots is not None:  # recurrent_prefix_hit chose a prefix with a snapshot
                self.snapshots.load(self.blocks.blocks[cached[-1]].hash, slot, len(cached) * self.block_size)
                return
            index = torch.tensor([slot], device=self.states[0].state.device) if self.states else None
            for state in self.states:
                state.reset(index)

    def _tables(self, seq: Sequence):
        """(pool, table, release window) of every group of seq."""
        yield self.blocks, seq.block_table, self.release_window
        yield from zip(self.window_pools, seq.window_tables, self.windows)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return all(pool.can_allocate(table, num_tokens) for pool, table, _ in self._tables(seq))

    def can_grow_together(self, growth: list[tuple[Sequence, int]]) -> bool:
        """Whether every (seq, num_tokens) can grow at once: their new blocks come out of the same pools."""
        needed: dict[int, int] = {}
        free: dict[int, int] = {}
        for seq, num_tokens in growth:
            for pool, table, _ in self._tables(seq):
                needed[id(pool)] = needed.get(id(pool), 0) + max(0, pool.blocks_for(num_tokens) - len(table))
                free[id(pool)] = len(pool.free)
        return all(n <= free[key] for key, n in needed.items())

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Room for seq's first num_tokens tokens."""
        for pool, table, _ in self._tables(seq):
            pool.allocate(table, num_tokens)

    def commit(self, seq: Sequence) -> None:
        """seq.num_computed positions are now final: hash their full blocks for prefix sharing, and
        release the blocks no window of a position still to compute reaches."""
        self._register(seq)
        for pool, table, window in self._tables(seq):
            if window is not None:
                keep = prompt_window(len(seq.prompt_token_ids), self.block_size, window)
                pool.release_before(table, seq.num_computed - window + 1, keep)
        if self.snapshots is not None:
            entry = (seq, self.slots[id(seq)], self.prompt_boundaries[id(seq)])
            if self._batching:  # a verify's: the state advances when the block ends (_apply_commits)
                self._pending_snapshots.append(entry)
            else:
                self._snapshot(*entry)

    def _register(self, seq: Sequence) -> None:
        """Hash seq's newly full blocks for prefix sharing, in every group. A verify commits its
        accepted drafts before they join the sequence's tokens: only blocks whose tokens are known
        (the rest at the next commit, or when freed)."""
        if not self.blocks.enable_prefix_caching or seq.compression is not None:
            return
        if seq.kv_view is not None:  # KVFlash evicted some of its KV: blocks computed since are lossy, not shared
            return
        start = len(seq.block_hashes)
        chunks = extend_hashes(seq.block_hashes, seq.token_slice, min(seq.num_computed, seq.num_tokens),
                               self.block_size)
        if chunks:
            for pool, table, _ in self._tables(seq):
                pool.register(table, start, chunks)

    def rollback(self, seq: Sequence, num_tokens: int, accepted: int | None = None,
                 path: list[int] | None = None) -> None:
        """Forget what lies past num_tokens tokens (rejected drafts); with `accepted` (a of k drafts,
        after a verify), recurrent state advances over the pending token and the accepted drafts
        (at once, or at the end of a `commits_batched` block). path: a tree verify's accepted rows
        a_0 = 0 < a_1 < ... < a_accepted (None: a chain's, 0..accepted); their stashed inputs are
        what the state advances over."""
        for pool, table, _ in self._tables(seq):
            pool.truncate(table, num_tokens)
        if accepted is not None and self.states:
            slot = self.slots[id(seq)]
            if path is not None:
                if len(path) != accepted + 1 or path[0] != 0 or any(b <= a for a, b in itertools.pairwise(path)):
                    raise ValueError(f"rollback: an accepted tree path of {accepted} drafts is {accepted + 1} "
                                     f"increasing rows from 0, got {path}")
                if path[-1] >= self.verify_positions:
                    raise ValueError(f"rollback: tree row {path[-1]} lies past the {self.verify_positions} "
                                     "stashed verify positions")
                self._pending_moves.extend((slot * self.verify_positions + row, slot * self.verify_positions + k)
                                           for k, row in enumerate(path) if row != k)
            self._pending_commits.append((slot, accepted))
            self._split_at_boundary(seq, accepted)
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
        if self._pending_moves:  # accepted tree paths onto stash rows 0, 1, ... (then committed as chains)
            device = self.states[0].state.device
            src, dst = (host_to_device(list(rows), device, torch.long) for rows in zip(*self._pending_moves))
            self._pending_moves.clear()
            for pool in self.pools:
                pool.compact_stash(src, dst)
        if self._pending_commits:
            self._advance_pending()
        if self._pending_snapshots:
            self._take_pending_snapshots()

    def _advance_pending(self) -> None:
        slots, accepted = zip(*self._pending_commits)
        self._pending_commits.clear()
        device = self.states[0].state.device
        skip = self._advance_to_boundaries(slots) if self._pending_splits else None
        slots = host_to_device(list(slots), device, torch.long)
        accepted = host_to_device(list(accepted), device, torch.long)
        for pool in self.pools:
            pool.commit(slots, accepted, skip)

    def free(self, seq: Sequence) -> None:
        """Everything seq holds goes back (finished, aborted or preempted); its full blocks stay
        findable for prefix reuse until their blocks are taken again."""
        if seq.block_table:
            self._register(seq)
        for pool, table, _ in self._tables(seq):
            pool.free_table(table)
        if self.kv_pool is not None:
            self.kv_pool.release(seq)
        slot = self.slots.pop(id(seq), None)
        if slot is not None:
            self.free_slots.append(slot)
        self.prompt_boundaries.pop(id(seq), None)
        self.branch_points.pop(id(seq), None)
        if self.snapshots is not None and not self._batching:  # else after its pending snapshot
            self.snapshots.release(id(seq))

    # ------------------------------------------------------------------ recurrent prefix reuse
    def recurrent_prefix_hit(self, cached: list[int]) -> list[int]:
        """Of the cached blocks of a prompt's prefix, those up to the longest block boundary whose
        recurrent state a snapshot keeps (none: the prompt is computed from the start)."""
        if self.snapshots is None:
            return []
        for n in range(len(cached), 0, -1):
            if self.blocks.blocks[cached[n - 1]].hash in self.snapshots:
                return cached[:n]
        return []

    def prompt_boundary(self, seq: Sequence) -> int:
        """The last block boundary a later request repeating seq's tokens could be served up to
        (its last token is always computed): where the prompt's snapshot is taken."""
        return (seq.num_tokens - 1) // self.block_size * self.block_size

    def prefill_cut(self, seq: Sequence, start: int, num_tokens: int) -> int:
        """How many of `num_tokens` prompt tokens from `start` the next chunk computes: a chunk
        ends exactly at the prompt's snapshot boundaries (where it branches off cached blocks, and
        its last), so the states there exist to be kept."""
        if self.snapshots is None:
            return num_tokens
        for boundary in (self.branch_points.get(id(seq), 0), self.prompt_boundary(seq)):
            if start < boundary < start + num_tokens:
                return boundary - start
        return num_tokens

    def _snapshot(self, seq: Sequence, slot: int, prompt_boundary: int, position: int | None = None) -> None:
        """seq's slot holds the state after its first `position` (default num_computed) positions:
        keep it when that is its prompt's boundary, or (its moving entry) any block boundary past it."""
        n = seq.num_computed if position is None else position
        if n % self.block_size or n == 0 or len(seq.block_hashes) < n // self.block_size:
            return  # mid-block, or tokens not known yet (a verify cut off by a stop)
        if n in (prompt_boundary, self.branch_points.get(id(seq))):
            owner = None  # kept as any other entry
        elif n > prompt_boundary:
            owner = id(seq)  # its moving entry
        else:
            return  # a prefill chunk's end short of the prompt's boundaries
        self.snapshots.save(seq.block_hashes[n // self.block_size - 1], slot, owner=owner)

    def _split_at_boundary(self, seq: Sequence, accepted: int) -> None:
        """A verify whose committed positions jump past a block boundary (not ending on one): its
        state commit stops there first, so the moving snapshot keeps up with speculation."""
        if self.snapshots is None:
            return
        end = seq.num_computed
        before, boundary = end - 1 - accepted, (end - 1) // self.block_size * self.block_size
        if end % self.block_size and boundary > before:
            self._pending_splits[self.slots[id(seq)]] = (seq, boundary - before, boundary)

    def _advance_to_boundaries(self, slots: tuple[int, ...]) -> torch.Tensor:
        """The first half of split commits: states advanced to their boundaries and snapshotted
        there; returns each pending commit's stashed tokens applied (0 where not split)."""
        splits, self._pending_splits = self._pending_splits, {}
        device = self.states[0].state.device
        split_slots = host_to_device(list(splits), device, torch.long)
        upto = host_to_device([n - 1 for _, n, _ in splits.values()], device, torch.long)  # as `accepted`
        for pool in self.pools:
            pool.commit(split_slots, upto)
        for slot, (seq, _, boundary) in splits.items():
            if seq.block_table:  # accepted drafts have joined its tokens now (a freed one registered then)
                self._register(seq)
            self._snapshot(seq, slot, self.prompt_boundaries.get(id(seq), 0), boundary)
        return host_to_device([splits[s][1] if s in splits else 0 for s in slots], device, torch.long)

    def _take_pending_snapshots(self) -> None:
        pending, self._pending_snapshots = self._pending_snapshots, []
        for seq, slot, boundary in pending:
            if seq.block_table:  # accepted drafts have joined its tokens now (a freed one registered then)
                self._register(seq)
            self._snapshot(seq, slot, boundary)
            if id(seq) not in self.slots:  # finished within the block
                self.snapshots.release(id(seq))

    def pool_usage(self) -> list[tuple[int | None, int, int]]:
        """(window, blocks, free blocks) of each KV cache group's pool, primary first (window None:
        full attention)."""
        return [(window, pool.num_blocks, pool.num_free_blocks) for pool, window in
                zip([self.blocks, *self.window_pools], [self.release_window, *self.windows])]

    def held_blocks(self, seq: Sequence) -> int:
        """Pool blocks seq holds, all groups together."""
        return sum(self.held_by_group(seq))

    def held_by_group(self, seq: Sequence) -> list[int]:
        """Pool blocks seq holds in each KV cache group (primary first), a KVFlash page-in's in flight too."""
        held = [pool.held(table) for pool, table, _ in self._tables(seq)]
        if self.kv_pool is not None:
            held[0] += self.kv_pool.in_flight(seq)
        return held

    def slot(self, seq: Sequence) -> int:
        return self.slots[id(seq)]
