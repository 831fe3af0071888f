"""Which chunks of a sequence stay resident: the protected sinks and tail, then the best-scored rest.

A chunk is `chunk_blocks` consecutive blocks (64 tokens in KVFlash); the chunk holding the sequence's
last positions and the `tail_chunks` before it are the tail (the next tokens read them most, and new
tokens are written there), the first `sink_chunks` are attention sinks. Neither is ever evicted; the
remaining budget goes to the highest scores (ties: the more recent chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Protection:
    sink_chunks: int = 1
    tail_chunks: int = 4

    @property
    def min_chunks(self) -> int:
        """The smallest pool these protections fit in (and one chunk to choose)."""
        return self.sink_chunks + self.tail_chunks + 2


def choose_chunks(num_chunks: int, budget: int, protection: Protection,
                  scores: torch.Tensor | None = None) -> tuple[list[int], int]:
    """(selected chunks before the tail, ascending; the first tail chunk) of a sequence with num_chunks
    chunks (the last may be partial) keeping at most `budget` resident. scores [num_chunks] (None:
    recency). The tail is the last tail_chunks + 1 chunks (the partial one and those before it)."""
    if budget < protection.min_chunks:
        raise ValueError(f"a pool of {budget} chunks is smaller than the sinks, tail and one chosen chunk "
                         f"({protection.min_chunks})")
    tail_from = max(0, num_chunks - 1 - protection.tail_chunks)
    sinks = list(range(min(protection.sink_chunks, tail_from)))
    candidates = list(range(len(sinks), tail_from))
    room = budget - (num_chunks - tail_from) - len(sinks)
    if room >= len(candidates):
        return sinks + candidates, tail_from
    if scores is None:  # recency: the chunks nearest the tail
        chosen = candidates[len(candidates) - room:] if room > 0 else []
    else:
        ranked = scores[len(sinks):tail_from].float().tolist()
        order = sorted(range(len(candidates)), key=lambda i: (ranked[i], i), reverse=True)
        chosen = sorted(candidates[i] for i in order[:max(0, room)])
    return sinks + chosen, tail_from
