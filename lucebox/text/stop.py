"""Stop strings over incrementally decoded text.

Text that could be the start of a stop string is held back until the next pieces show whether it
is one, so a stop string is never streamed partially (unless include_stop_str_in_output asks for
it). Because the held-back text is always the longest suffix that is a prefix of some stop string,
any match starts inside the held-back text or the new piece: emitted text never needs taking back.
"""

from __future__ import annotations

from typing import Sequence


class StopChecker:
    """One per sequence. `feed(piece) -> (text_to_emit, stopped, matched_stop)`."""

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(stop)
        self.include = include_stop_str_in_output
        self._window = max((len(s) for s in self.stop), default=1) - 1  # chars of the past a match can reach
        self._tail = ""  # the last `_window` characters seen (emitted or held)
        self._held = 0  # how many characters at the end of `_tail` are not emitted yet
        self.stopped = False
        self.matched_stop: str | None = None

    @classmethod
    def from_params(cls, params) -> StopChecker:
        return cls(params.stop, params.include_stop_str_in_output)

    def feed(self, piece: str) -> tuple[str, bool, str | None]:
        if self.stopped:
            return "", True, self.matched_stop
        text = self._tail + piece
        new_from = len(self._tail)
        emit_from = new_from - self._held
        match = self._first_match(text, new_from)
        if match is not None:
            start, stop = match
            self.stopped, self.matched_stop = True, stop
            cut = start + len(stop) if self.include else start
            self._tail, self._held = "", 0
            return text[emit_from:cut], True, stop
        # With the stop string going out anyway, a partial one needs no holding back.
        hold = 0 if self.include else min(self._longest_stop_prefix(text), len(text) - emit_from)
        self._tail = text[max(0, len(text) - self._window):]
        self._held = hold
        return text[emit_from:len(text) - hold], False, None

    def flush(self) -> str:
        """The held-back text, for when the sequence ends (EOS, max_tokens) without a match."""
        held = self._tail[len(self._tail) - self._held:]
        self._held = 0
        return held

    def _first_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The stop string completed first (smallest end, then earliest start) by the new text,
        so the result does not depend on how the text was split into pieces."""
        best = None
        for s in self.stop:
            # Only matches that end inside the new text: older ones would have been found before.
            start = text.find(s, max(0, new_from - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < (best[0] + len(best[1]), best[0])):
                best = (start, s)
        return best

    def _longest_stop_prefix(self, text: str) -> int:
        for n in range(min(len(text), self._window), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0
