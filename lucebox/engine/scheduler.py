"""Scheduler: which sequences run in the next step, and how many new tokens each brings.

Continuous batching: waiting sequences join the running batch at any step (their whole
prompt as one prefill), running sequences decode one token. When the KV pool runs out, the
newest running sequence is preempted (its blocks freed) and recomputed later, first in line.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    token_ids: list[list[int]]  # new tokens per sequence
    start_positions: list[int]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [], [])
        # Decodes first: every running sequence needs a slot for its newest token.
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            while not self.blocks.can_allocate(seq.block_table, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.blocks.allocate(seq.block_table, seq.num_tokens)
                self._add(batch, seq)
        budget = self.max_num_batched_tokens - sum(len(t) for t in batch.token_ids)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - seq.num_computed
            if new_tokens > budget and batch.seqs:
                break  # a prompt longer than the budget still runs, alone, so nothing starves
            if not self.blocks.can_allocate(seq.block_table, seq.num_tokens):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.block_table, seq.num_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._add(batch, seq)
            budget -= new_tokens
        return batch

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.blocks.free(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _add(self, batch: ScheduledBatch, seq: Sequence) -> None:
        batch.seqs.append(seq)
        batch.token_ids.append(seq.token_ids[seq.num_computed:])
        batch.start_positions.append(seq.num_computed)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
