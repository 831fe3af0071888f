"""Progress lines for long prefills: a prompt spanning several steps logs each chunk it completes, so
a server prefilling an agent's 40K-token prompt on a CPU says how far it is and how long is left; so does
PFlash's scorer, a line per scorer chunk of a prompt being scored."""
from __future__ import annotations

import logging
import time

from .sequence import Sequence

log = logging.getLogger("lucebox.prefill")


class PrefillProgress:
    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens
        # (what, request id) -> (time, tokens done then); what: "prefill", or "scoring" (PFlash's scorer)
        self.started: dict[tuple[str, str], tuple[float, int]] = {}

    def chunk_done(self, seq: Sequence, now: float | None = None) -> str | None:
        """Called after a prompt chunk of seq is committed; returns (and logs) the progress line."""
        total = len(seq.prompt_token_ids)
        if total <= self.chunk_tokens or seq.index != 0:
            return None
        return self._report("prefill", seq.request_id, min(seq.num_computed, total), total, now)

    def scoring_done(self, request_id: str, done: int, total: int, chunk: int, now: float | None = None) -> str | None:
        """Called after a PFlash scorer chunk (`chunk` tokens each) of a request's prompt: `done` of `total`
        scorer tokens prefilled."""
        return self._report("scoring", request_id, done, total, now) if total > chunk else None

    def _report(self, what: str, request_id: str, done: int, total: int, now: float | None) -> str:
        now = time.monotonic() if now is None else now
        started, first = self.started.setdefault((what, request_id), (now, done))
        if done >= total:
            del self.started[what, request_id]
        if done == first:  # the first chunk: no rate yet
            line = f"{what} {request_id}: {done:,} / {total:,} prompt tokens"
        else:
            rate = (done - first) / max(now - started, 1e-9)
            line = (f"{what} {request_id}: {done:,} / {total:,} prompt tokens ({100 * done / total:.0f}%), "
                    f"{rate:,.0f} tok/s, ~{(total - done) / rate:.0f} s left")
        log.info(line)
        return line

    def prompt_done(self, seq: Sequence) -> None:
        """Called after a decode row: the last chunk of a tracked prompt ends its progress."""
        if ("prefill", seq.request_id) in self.started and seq.num_computed >= len(seq.prompt_token_ids):
            self.chunk_done(seq)

    def forget(self, request_id: str) -> None:
        for what in ("prefill", "scoring"):
            self.started.pop((what, request_id), None)
