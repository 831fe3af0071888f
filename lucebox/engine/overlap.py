"""Overlapped decoding (EngineArgs.async_decode): the next decode step launched before this one's
tokens are read, its input ids copied on the device from this step's, so that the host's launch,
upload and bookkeeping overlap the GPU's work instead of following it.

Also the runs of plain steps a speculator promises (Speculator.plain_run): their steps are launched
ahead without consulting the speculator, and reported to it as the mean time of a few.
"""
from __future__ import annotations

import collections

from ..sampling.graph_rows import argmax_only, graph_samplable
from .step_plan import PlanRow, StepPlan, StepResult

# The steps of a promised plain run are reported to the speculator as the mean time of this many
# (or of fewer, when the run ends first).
RUN_TIMED_STEPS = 8


class AheadStep:
    """A decode step launched before its turn (Overlap.launch_ahead), and what it assumed."""

    def __init__(self, seqs: list, starts: list[int], argmax: bool, sample: list | None, step,
                 shifts: list[int] | None = None):
        self.seqs, self.starts, self.argmax, self.sample, self.step = list(seqs), starts, argmax, sample, step
        self.shifts = shifts or [0] * len(self.seqs)  # each row's PlanRow.rope_shift

    def covers(self, plan: StepPlan) -> bool:
        """This step is exactly the one the planner now asks for."""
        rows = plan.rows
        return (len(rows) == len(self.seqs) and all(r.seq is s for r, s in zip(rows, self.seqs))
                and all(len(r.tokens) == 1 for r in rows)
                and [r.start for r in rows] == self.starts
                and [r.rope_shift for r in rows] == self.shifts  # rotated where the plan rotates it
                and plan.argmax == self.argmax and (plan.argmax or plan.sample == self.sample))


class Overlap:
    """The step launched ahead (if any) and the promised plain run's bookkeeping."""

    def __init__(self, runner, scheduler, speculator, max_model_len: int, step_counts: collections.Counter):
        self.runner, self.scheduler, self.speculator = runner, scheduler, speculator
        self.max_model_len, self.step_counts = max_model_len, step_counts
        self.ahead: AheadStep | None = None
        # Steps launched ahead that the speculator promised plain, not consulted for them; whether
        # this step is one; and the run's steps not yet reported: count, seconds, size.
        self.run_left, self.in_run = 0, False
        self.run_steps, self.run_seconds, self.run_tokens = 0, 0.0, 0

    def continues_run(self) -> bool:
        """Whether this step is the next of a run the speculator promised plain, launched ahead for an
        unchanged batch with nobody waiting. Anything else ends the run and reports its time."""
        ahead, scheduler = self.ahead, self.scheduler
        if self.run_left and ahead is not None and ahead.seqs == scheduler.running and not scheduler.waiting:
            self.run_left -= 1
            self.in_run = True
        else:
            self.run_left, self.in_run = 0, False
            self.report_run()
        return self.in_run

    def time_run_step(self, num_tokens: int, seconds: float) -> None:
        self.run_steps += 1
        self.run_seconds += seconds
        self.run_tokens = num_tokens
        if self.run_steps == RUN_TIMED_STEPS:
            self.report_run()

    def report_run(self) -> None:
        if self.run_steps:
            self.speculator.record_plain_steps(self.run_tokens, self.run_seconds / self.run_steps)
            self.run_steps, self.run_seconds = 0, 0.0

    def run(self, plan: StepPlan) -> tuple[StepResult, bool]:
        """The plan's result, and whether it came from the step launched ahead for it; a deferred
        step gets the next one launched ahead before its own tokens are read."""
        ahead, self.ahead = self.ahead, None
        overlapped = ahead is not None and plan.defer and ahead.covers(plan)
        if ahead is not None and not overlapped:
            self.step_counts["unused ahead"] += 1
        # launched by the previous step, fed its tokens on the device
        result = StepResult(deferred=ahead.step) if overlapped else self.runner.run(plan)
        if overlapped:  # recurrent state: the step stashed its token (ModelRunner.state_rows); now it counts
            self.scheduler.cache.advance_stashed(ahead.seqs)
        if result.deferred is not None:
            self.ahead = self.launch_ahead(plan, result.deferred)
            result = result.deferred.result()
        return result, overlapped

    def launch_ahead(self, plan: StepPlan, step) -> AheadStep | None:
        """Launch the next decode step of the plan's sequences, fed from `step`'s device tokens. Only
        when the next step is predictable: nobody waiting to join, every sequence with room for one
        more token, the same kind of step (argmax or sampled in the graph) after this one's token,
        and a speculator that promises (Speculator.plain_run: binding, a run of steps) or guesses
        (guesses_plain) that the step neither drafts nor captures taps. A sequence that this step's
        token finishes (or a draft after all, on a guess) makes the launched step go unused."""
        seqs, sample = [row.seq for row in plan.rows], plan.sample
        if self.scheduler.waiting or any(len(row.tokens) != 1 for row in plan.rows):
            return None
        cache = self.scheduler.cache
        if any(s.num_tokens + 1 >= self.max_model_len for s in seqs) or \
                not cache.can_grow_together([(s, s.num_computed + 2) for s in seqs]):
            return None
        argmax = all(argmax_only(s.params, len(s.output_token_ids) + 1) for s in seqs)
        if not argmax and (sample is None or not all(graph_samplable(s.params, len(s.output_token_ids) + 1)
                                                     for s in seqs)):
            return None
        next_sample = None if argmax else sample
        if cache.kv_pool is not None:  # landed page-ins switch now, so the step launched ahead reads the new set
            cache.kv_pool.land()
        # a pooled sequence's row reads its resident blocks (a new choice at the commit leaves the step unused)
        starts = [s.num_computed + 1 if s.kv_view is None else s.kv_view.storage(s.num_computed + 1) for s in seqs]
        tables = [s.block_table if s.kv_view is None else s.kv_view.table(s.block_table) for s in seqs]
        # the next token keeps this one's shift (a plan that shifts it otherwise leaves the step unused: covers)
        shifts = [row.rope_shift for row in plan.rows]
        if self.runner.graphs.bucket([[0]] * len(seqs), starts, tables, rope_shifts=shifts) is None:
            return None
        if self.speculator is not None and not self.run_left:  # last: a promise binds
            self.run_left = self.speculator.plain_run(seqs)
            if not self.run_left and not self.speculator.guesses_plain(seqs):
                return None
        for s in seqs:
            cache.grow(s, s.num_computed + 2)
        rows = [PlanRow([0], start, s.block_table, seq=s, offset=i, index=i, rope_shift=shift)
                for i, (s, start, shift) in enumerate(zip(seqs, starts, shifts))]
        for row, s in zip(rows, seqs):
            if s.kv_view is not None:
                row.block_table = s.kv_view.table(s.block_table)
                row.window_tables = [s.kv_view.table(t) for t in s.window_tables]
        launched = self.runner.run(StepPlan(rows, logits_rows=list(range(len(seqs))), argmax=argmax,
                                            sample=next_sample, ids_from=step.device_tokens, defer=True))
        if launched.deferred is None:  # graphs without in-graph sampling: logits, already read
            return None
        return AheadStep(seqs, starts, argmax, next_sample, launched.deferred, shifts)
