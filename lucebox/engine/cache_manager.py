"""CacheManager: all of a sequence's cache state, whatever its layers keep (model/cache_spec.py).

The scheduler and the engine grow, commit, roll back and free a sequence here; they see bytes
per token and per sequence, never a layer's tensors:
  paged K/V          blocks of the BlockManager (block tables, prefix caching, ref counts)
  window-bounded     when every paged spec has a window (the model's layers and any proposer's
                     cache), blocks wholly behind the window of the next position to compute go
                     back to the pool as the sequence commits; their table entries become the
                     BlockManager's `released` id (the scratch block), so tables keep their shape
                     and attention, which reads only positions inside the window, never sees them.
                     Mixed windows keep everything (per-group tables would be needed).
  recurrent state    one slot per sequence in a pool; a verify leaves the state alone and stashes its
                     tokens' inputs, and the rollback after its verdict advances the state over
                     the accepted ones (model/recurrent_state.RecurrentState.commit).
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..model.cache_spec import PagedKVSpec, RecurrentSpec, bytes_per_sequence, bytes_per_token, release_window
from ..model.recurrent_state import RecurrentState
from ..util import host_to_device
from .block_manager import BlockManager
from .sequence import Sequence

log = logging.getLogger("lucebox")


class CacheManager:
    def __init__(self, specs, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_slots: int = 0, verify_positions: int = 0):
        """specs: every cache spec whose state follows the target's sequences (the model's layers
        and the proposer's); num_slots / verify_positions: recurrent slots (at most this many
        sequences at once) and the positions a verify may stash (1 + the longest draft)."""
        self.specs = tuple(specs)
        self.recurrent = [s for s in self.specs if isinstance(s, RecurrentSpec)]
        # Recurrent state belongs to the whole prefix, not to a block: no prefix sharing with it.
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching and not self.recurrent)
        self.block_size = block_size
        self.verify_positions = verify_positions
        self.release_window = release_window(self.specs)
        if self.release_window is None and any(isinstance(s, PagedKVSpec) and s.window for s in self.specs):
            log.info("sliding-window layers keep their whole context: other caches read all of it")
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
        return self.blocks.match_prefix(token_ids)

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a new sequence starting from `cached` blocks fits: blocks, and a slot if recurrent."""
        if self.recurrent and not self.free_slots:
            return False
        return self.blocks.can_admit(cached, num_tokens)

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        self.blocks.admit(seq.block_table, cached)
        if self.recurrent:
            slot = self.free_slots.pop()
            self.slots[id(seq)] = slot
            index = torch.tensor([slot], device=self.states[0].state.device) if self.states else None
            for state in self.states:
                state.reset(index)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks.can_allocate(seq.block_table, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Room for seq's first num_tokens tokens."""
        self.blocks.allocate(seq.block_table, num_tokens)

    def commit(self, seq: Sequence) -> None:
        """seq.num_computed positions are now final: hash their full blocks for prefix sharing, and
        release the blocks no window of a position still to compute reaches."""
        self.blocks.register_full_blocks(seq.block_table, seq.block_hashes, seq.token_slice, seq.num_computed)
        if self.release_window is not None:
            self.blocks.release_before(seq.block_table, seq.num_computed - self.release_window + 1)

    def rollback(self, seq: Sequence, num_tokens: int, accepted: int | None = None) -> None:
        """Forget what lies past num_tokens tokens (rejected drafts); with `accepted` (a of k drafts,
        after a verify), recurrent state advances over the pending token and the accepted drafts
        (at once, or at the end of a `commits_batched` block)."""
        self.blocks.truncate(seq.block_table, num_tokens)
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
        self.blocks.free_table(seq.block_table)
        slot = self.slots.pop(id(seq), None)
        if slot is not None:
            self.free_slots.append(slot)

    def held_blocks(self, seq: Sequence) -> int:
        return self.blocks.held(seq.block_table)

    def slot(self, seq: Sequence) -> int:
        return self.slots[id(seq)]
