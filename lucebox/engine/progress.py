"""Progress lines for long prefills: a prompt spanning several steps logs each chunk it completes, so
a server prefilling an agent's 40K-token prompt on a CPU says how far it is and how long is left."""
from __future__ import annotations

import logging
import time

from .sequence import Sequence

log = logging.getLogger("lucebox.prefill")


class PrefillProgress:
    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens
        self.started: dict[str, tuple[float, int]] = {}  # request id -> (time, tokens computed then)

    def chunk_done(self, seq: Sequence, now: float | None = None) -> str | None:
        """Called after a prompt chunk of seq is committed; returns (and logs) the progress line."""
        total = len(seq.prompt_token_ids)
        if total <= self.chunk_tokens or seq.index != 0:
            return None
        now = time.monotonic() if now is None else now
        done = min(seq.num_computed, total)
        started, first = self.started.setdefault(seq.request_id, (now, done))
        if done >= total:
            del self.started[seq.request_id]
        if done == first:  # the first chunk: no rate yet
            line = f"prefill {seq.request_id}: {done:,} / {total:,} prompt tokens"
        else:
            rate = (done - first) / max(now - started, 1e-9)
            line = (f"prefill {seq.request_id}: {done:,} / {total:,} prompt tokens ({100 * done / total:.0f}%), "
                    f"{rate:,.0f} tok/s, ~{(total - done) / rate:.0f} s left")
        log.info(line)
        return line

    def prompt_done(self, seq: Sequence) -> None:
        """Called after a decode row: the last chunk of a tracked prompt ends its progress."""
        if seq.request_id in self.started and seq.num_computed >= len(seq.prompt_token_ids):
            self.chunk_done(seq)

    def forget(self, request_id: str) -> None:
        self.started.pop(request_id, None)
