"""The commit of plan -> run -> commit: what a step's rows wrote becomes each sequence's state.

Prompt chunks and decodes commit their positions; verifies commit the pending token and their
accepted drafts, move a tree's accepted path onto contiguous positions (K/V rows and the
drafter's ring rows) and roll the rest back; the speculator sees every committed position's taps.
"""
from __future__ import annotations

import torch

from ..model.feature_ring import RingRows
from ..spec.tree import top_chain
from ..util import host_to_device
from .output_processor import OutputProcessor
from .overlap import Overlap
from .progress import PrefillProgress
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .step_plan import RowKind, StepPlan, StepResult


class StepCommitter:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, speculator, outputs: OutputProcessor,
                 progress: PrefillProgress, overlap: Overlap, kv_pool):
        self.scheduler, self.runner, self.speculator = scheduler, runner, speculator
        self.outputs, self.progress, self.overlap, self.kv_pool = outputs, progress, overlap, kv_pool

    def commit_step(self, plan: StepPlan, result: StepResult) -> None:
        """Commit every row's positions, then process what it brought back: decodes' logits rows
        come first, then each verify's k + 1."""
        features, out = result.features, self.outputs
        for row in plan.of(RowKind.CHUNK):
            self.commit(row.seq, len(row.tokens), features, row.offset)
            self.progress.chunk_done(row.seq)
        decodes, verifies = plan.of(RowKind.DECODE), plan.of(RowKind.VERIFY)
        if decodes:
            tokens, logprobs = out.decode_tokens(decodes, result)
            for row, token, lp in zip(decodes, tokens, logprobs):
                seq = row.seq
                self.commit(seq, seq.num_tokens - seq.num_computed, features, row.offset)
                self.progress.prompt_done(seq)
                out.append(seq, token, lp)
        if verifies:
            self._commit_verifies(verifies, len(decodes), result)
        if self.kv_pool is not None:  # host copies of the step's full blocks, then resident sets re-chosen
            self.kv_pool.finish_step(result.queries, {id(row.seq): row.index for row in plan.rows})

    def _commit_verifies(self, verifies, after: int, result: StepResult) -> None:
        """Each verify row's verdict (its logits rows follow the first `after` rows'): the pending token
        and the accepted drafts commit, the rejected ones roll back."""
        features, out = result.features, self.outputs
        for row in verifies:
            row.seq.draft = None
        verdicts, logprobs = out.verdicts(verifies, result, after)
        self._compact_trees(verifies, verdicts)
        with self.scheduler.cache.commits_batched():  # recurrent state: every verify's in one launch a layer
            for row, verdict, lps in zip(verifies, verdicts, logprobs):
                seq = row.seq
                # A tree's draft length is its depth: the chain it stands in for.
                drafted = max(row.depths) if row.depths is not None else len(row.draft.tokens)
                chain = top_chain(row.depths, verdict.rows) if verdict.rows is not None else None
                self.speculator.record(seq, drafted, verdict.num_accepted, chain)
                taps, at = features, row.offset
                if verdict.rows is not None and isinstance(features, RingRows):  # a graph step's ring rows
                    self.compact_ring_rows(features, row.offset, verdict.rows)
                elif verdict.rows is not None and features is not None:  # the accepted nodes' taps, in order
                    taps, at = features[host_to_device([row.offset + r for r in verdict.rows], features.device,
                                                       torch.long)], 0
                self.commit(seq, 1 + verdict.num_accepted, taps, at)  # the pending token + accepted
                self.scheduler.cache.rollback(seq, seq.num_computed + 1, verdict.num_accepted,  # rejected drafts
                                              verdict.rows)  # a tree's accepted rows: the state follows them
                out.append_tokens(seq, verdict.tokens, lps)

    def _compact_trees(self, verifies, verdicts) -> None:
        """Tree verifies stored node i at start + i: the accepted path's K/V move onto start + 0, 1, ...
        (as if verified as a chain); what lies past them is rolled back like rejected chain drafts."""
        moved = [(row, v.rows) for row, v in zip(verifies, verdicts)
                 if v.rows is not None and v.rows != list(range(len(v.rows)))]
        if moved:
            self.runner.compact_tree_rows([row.block_table for row, _ in moved], [row.start for row, _ in moved],
                                          [rows for _, rows in moved], [row.window_tables for row, _ in moved])

    def compact_ring_rows(self, features: RingRows, offset: int, accepted: list[int]) -> None:
        """A tree verify through a graph wrote its taps to feature-ring rows: the accepted nodes' rows
        move onto the row's first ones, in order (one gather before the writes, as kv_compact does)."""
        if accepted == list(range(len(accepted))):
            return
        ring = self.speculator.proposer.feature_ring.rows
        first = features.first + offset
        src = host_to_device([first + r for r in accepted], ring.device, torch.long)
        dst = host_to_device(list(range(first, first + len(accepted))), ring.device, torch.long)
        ring.index_copy_(0, dst, ring.index_select(0, src))

    def commit(self, seq: Sequence, n: int, features, offset: int) -> None:
        """The next n positions of seq (their K/V written this step) are now committed."""
        spec = self.speculator
        if features is not None:
            spec.observe(seq, seq.num_computed, features[offset:offset + n])
        elif spec is not None and spec.capture_layers and (spec.every_step or not self.overlap.in_run):
            spec.missed(seq, seq.num_computed)  # a dormant drafter's step (a run's: told already; every_step: raises)
        seq.num_computed += n
        self.scheduler.cache.commit(seq)
        if self.kv_pool is not None:
            self.kv_pool.committed(seq, n)
