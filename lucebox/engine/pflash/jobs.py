"""Scoring as engine work: a prompt's PFlash compression is a ScoringJob that advances one unit (one
scorer prefill chunk, the tail scores, the selection, a slice of re-tokenisation) per engine step, so
the other requests keep decoding while a long prompt is scored. ScoringQueue holds the requests being
scored, FIFO: one job at a time holds the scorer's KV pool (sized for one prompt of max_model_len),
so the oldest is scored to the end before the next starts."""
from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import TypeVar

import torch

from ...errors import LuceboxError, OverloadError, RequestError
from .positions import PromptCompression

log = logging.getLogger("lucebox")
T = TypeVar("T")


def drain(steps: Generator[object, None, T]) -> T:
    """The value a step generator (a unit of work per next()) returns, its units run at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class ScoringJob:
    """One prompt's compression, resumable: advance() runs one unit and says whether the job is done;
    then `result` is its PromptCompression (None: the prompt stays exact), or `error` the exception that
    ended it. Its scorer KV blocks go back when it ends, fails or is cancelled."""

    def __init__(self, owner, steps: Generator, prompt_tokens: int, ratio: float):
        self._owner, self._steps = owner, steps  # owner: the SpeculativePrefill (its last_seconds)
        self.prompt_tokens, self.ratio = prompt_tokens, ratio
        self.chunk = owner.scorer.chunk  # scorer tokens a unit prefills (progress lines)
        self.result: PromptCompression | None = None
        self.error: Exception | None = None
        self.done = False
        self.progress: tuple[int, int] | None = None  # after a scorer chunk: (scorer tokens prefilled, of)
        self.seconds = 0.0  # time spent in its units (not the steps between them)

    def advance(self) -> bool:
        """One unit of work; True once done (then a no-op)."""
        if self.done:
            return True
        started = time.perf_counter()
        try:
            self.progress = next(self._steps)
        except StopIteration as finished:
            self.result, self.done, self.progress = finished.value, True, None
        except Exception as e:  # the request's alone: the scorer's blocks are back (the generator's finally)
            self.error, self.done, self.progress = e, True, None
        self.seconds += time.perf_counter() - started
        if self.done and self.error is None:
            self._owner.last_seconds = self.seconds
            if self.result is not None:
                log.info("speculative prefill: %d of %d prompt tokens kept (ratio %.3f) in %.2f s",
                         len(self.result.kept_positions), self.prompt_tokens, self.ratio, self.seconds)
        return self.done

    def run(self) -> PromptCompression | None:
        """Every unit at once; raises what ended it."""
        while not self.advance():
            pass
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self) -> None:
        """Stop (an aborted request): the scorer's blocks go back now."""
        self._steps.close()
        self.done = True

    @property
    def request_error(self) -> LuceboxError:
        """The error its request ends with: what went wrong, and what to do."""
        e = self.error
        if isinstance(e, LuceboxError):
            return e
        if isinstance(e, torch.OutOfMemoryError):
            return OverloadError(f"speculative prefill ran out of memory scoring this prompt ({e}); retry later, "
                                 f"or send it without prefill_keep_ratio")
        return RequestError(f"speculative prefill failed on this prompt ({type(e).__name__}: {e}); send it without "
                            f"prefill_keep_ratio to prefill it exactly")


class ScoringQueue:
    """Requests whose prompts are being scored, oldest first; only the oldest advances."""

    def __init__(self):
        self._jobs: dict[str, tuple[ScoringJob, int]] = {}  # insertion-ordered (FIFO): the job, its sequences
        self.num_sequences = 0  # of every request being scored (the engine's queue limit, /metrics)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self):
        return iter(list(self._jobs))  # request ids, oldest first

    def __getitem__(self, request_id: str) -> ScoringJob:
        return self._jobs[request_id][0]

    def add(self, request_id: str, job: ScoringJob, num_sequences: int) -> None:
        self._jobs[request_id] = job, num_sequences
        self.num_sequences += num_sequences

    def cancel(self, request_id: str) -> None:
        if request_id in self._jobs:
            self._remove(request_id).cancel()

    def _remove(self, request_id: str) -> ScoringJob:
        job, n = self._jobs.pop(request_id)
        self.num_sequences -= n
        return job

    def advance(self) -> tuple[str, ScoringJob] | None:
        """One unit of the oldest job: (its request id, the job), which leaves the queue once done; None when empty."""
        if not self._jobs:
            return None
        request_id, (job, _) = next(iter(self._jobs.items()))
        if job.advance():
            self._remove(request_id)
        return request_id, job
