"""Scheduler: which sequences run in the next step, and how many new tokens each brings.

Continuous batching with chunked prefill: every step has a token budget; running sequences
(oldest first) take their decode token or their next prefill chunk, then waiting sequences join
while budget, sequence slots and KV blocks last. Prompts are matched against the prefix cache on
admission. When blocks run out, the newest running sequence is preempted (blocks freed,
recomputed later, first in line), so the oldest always progresses: FIFO, no starvation.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from .cache_manager import CacheManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting by this schedule()

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.blocks = cache.blocks  # the paged pool: its counters and free blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted below for an older sequence
                continue
            pending = seq.num_tokens - seq.num_computed
            drafts = len(seq.draft.tokens) if seq.draft is not None else 0
            n = min(pending + drafts, budget)
            if not drafts:  # a prompt's chunk ends at its recurrent snapshot's boundary (hybrids)
                n = self.cache.prefill_cut(seq, seq.num_computed, n)
            if drafts and n < pending + drafts:  # the budget cuts the draft short
                self._trim_draft(seq, n - pending)
            while not self.cache.can_grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                batch.preempted.append(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.cache.grow(seq, seq.num_computed + n)
                batch.add(seq, n)
                budget -= n
        # New sequences join only when nobody had to give up blocks this step.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.cache.match_prefix(seq.token_ids, seq)
            start = len(cached) * self.blocks.block_size
            n = self.cache.prefill_cut(seq, start, min(seq.num_tokens - start, budget))
            if not self.cache.can_admit(cached, start + n, seq):
                break
            self.waiting.popleft()
            self.cache.admit(seq, cached)
            self.cache.grow(seq, start + n)
            if seq.num_cached_tokens is None:  # first admission (not a recompute after preemption)
                seq.num_cached_tokens = start
                self.blocks.queries += len(seq.prompt_token_ids)
                self.blocks.hits += start
            seq.num_computed = start
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            batch.add(seq, n)
            budget -= n
        return batch

    @staticmethod
    def _trim_draft(seq: Sequence, keep: int) -> None:
        if keep <= 0:
            seq.draft = None
        else:
            seq.draft.tokens = seq.draft.tokens[:keep]
            if seq.draft.parents is not None:  # a DFS prefix of a tree is a tree
                seq.draft.parents = seq.draft.parents[:keep]
            if seq.draft.probs is not None:
                seq.draft.probs = seq.draft.probs[:keep]

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.cache.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed = 0
        seq.block_hashes.clear()
        seq.status = Status.WAITING
        # Back to the front, in arrival order among the other preempted ones.
        index = 0
        while index < len(self.waiting) and self.waiting[index].arrival < seq.arrival:
            index += 1
        self.waiting.insert(index, seq)
