"""Which prompt tokens the target prefills: 32-token chunks ranked by mean score, within a keep ratio;
the head and tail chunks forced (the system prompt and the question), and the neighbourhood of each
earlier occurrence of a 4-gram of the query forced (anchors: what the question quotes). Kept chunks
come back in prompt order; map_spans carries them from the scorer's tokens to the target's."""
from __future__ import annotations

import bisect
import math
from collections.abc import Generator
from dataclasses import dataclass

import torch

from ...text.tokenizer import IncrementalDetokenizer
from .jobs import drain


@dataclass(frozen=True)
class SelectionRules:
    chunk: int = 32
    head_chunks: int = 8
    tail_chunks: int = 24
    query_tokens: int = 96  # the query: the prompt's last tokens, whose n-grams anchor
    ngram: int = 4

    def anchor_limits(self, num_chunks: int) -> tuple[int, int]:
        """(radius in chunks, most anchor hits), growing with the prompt: 2/8 to 32K tokens, 4/16 to 128K, then 8/32."""
        tokens = num_chunks * self.chunk
        return (2, 8) if tokens <= 32768 else (4, 16) if tokens <= 131072 else (8, 32)


def chunk_means(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean score of each `chunk`-token chunk (the last one may be shorter)."""
    s = scores.shape[0]
    padded = torch.zeros(-(-s // chunk) * chunk, dtype=torch.float32, device=scores.device)
    padded[:s] = scores.float()
    counts = torch.full((padded.shape[0] // chunk,), float(chunk), device=scores.device)
    counts[-1] = s - (counts.shape[0] - 1) * chunk
    return padded.view(-1, chunk).sum(1) / counts


def anchor_chunks(token_ids: list[int], rules: SelectionRules, num_chunks: int) -> list[int]:
    """Chunks around earlier occurrences of the query's n-grams, the query's last n-grams first."""
    n, q_start = rules.ngram, max(0, len(token_ids) - rules.query_tokens)
    radius, max_hits = rules.anchor_limits(num_chunks)
    earlier: dict[tuple, list[int]] = {}
    for i in range(0, q_start - n + 1):
        earlier.setdefault(tuple(token_ids[i:i + n]), []).append(i)
    hits: list[int] = []
    for i in range(len(token_ids) - n, q_start - 1, -1):
        for at in earlier.get(tuple(token_ids[i:i + n]), ()):
            chunk = at // rules.chunk
            if chunk not in hits:
                hits.append(chunk)
        if len(hits) >= max_hits:
            break
    out: list[int] = []
    for chunk in hits[:max_hits]:
        out += [c for c in range(chunk - radius, chunk + radius + 1) if 0 <= c < num_chunks and c not in out]
    return out


def select_chunks(scores: torch.Tensor, token_ids: list[int], keep_ratio: float,
                  rules: SelectionRules = SelectionRules()) -> list[int]:
    """Indices of the kept chunks, ascending: max(1, floor(chunks * keep_ratio)) of them, forced head and
    tail first (shrunk in proportion when they alone exceed the budget), then anchors (forced, even past
    the budget), then by score while the budget lasts."""
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    if scores.shape[0] != len(token_ids):
        raise ValueError(f"{scores.shape[0]} scores for {len(token_ids)} tokens")
    means = chunk_means(scores, rules.chunk)
    num_chunks = means.shape[0]
    budget = max(1, math.floor(num_chunks * keep_ratio + 1e-9))
    head, tail = rules.head_chunks, rules.tail_chunks
    if head + tail > budget:  # shrink in proportion, the tail (the question) keeping at least one
        tail = max(1, round(budget * tail / (head + tail)))
        head = budget - tail
    kept: list[int] = []

    def take(chunks, limit: int) -> None:
        for c in chunks:
            if len(kept) >= limit:
                return
            if c not in kept:
                kept.append(c)
    take(range(num_chunks - 1, max(-1, num_chunks - 1 - tail), -1), budget)
    take(range(min(head, num_chunks)), budget)
    # anchors are forced even past the budget (at most max hits x (2 radius + 1) chunks): what the question quotes
    take(anchor_chunks(token_ids, rules, num_chunks), num_chunks)
    take(torch.argsort(means, descending=True, stable=True).tolist(), budget)
    return sorted(kept)


def kept_token_spans(chunks: list[int], chunk: int, num_tokens: int) -> list[tuple[int, int]]:
    """Kept chunks as merged [start, end) token spans."""
    spans: list[tuple[int, int]] = []
    for c in chunks:
        start, end = c * chunk, min((c + 1) * chunk, num_tokens)
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def decoded_with_ends(tokenizer, token_ids: list[int]) -> tuple[str, list[int]]:
    """(the decoded text, each token's end offset in it: a token completing no character ends where the
    text so far ends), in one incremental pass."""
    return drain(decoded_with_ends_steps(tokenizer, token_ids, len(token_ids) + 1))


def decoded_with_ends_steps(tokenizer, token_ids: list[int],
                            per_step: int) -> Generator[None, None, tuple[str, list[int]]]:
    """decoded_with_ends resumable: yields after every `per_step` tokens (a scoring job's unit of work)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    pieces, ends, length = [], [], 0
    for i, t in enumerate(token_ids, 1):
        pieces.append(detok.push(t))
        length += len(pieces[-1])
        ends.append(length)
        if i % per_step == 0 and i < len(token_ids):
            yield
    return "".join(pieces), ends


def char_ends(tokenizer, token_ids: list[int]) -> list[int]:
    return decoded_with_ends(tokenizer, token_ids)[1]


def map_spans(spans: list[tuple[int, int]], source_ends: list[int], target_ends: list[int]) -> list[int]:
    """Target token indices whose characters overlap the source token spans (by character offsets)."""
    char_spans = [(source_ends[a - 1] if a else 0, source_ends[b - 1]) for a, b in spans]
    starts = [a for a, _ in char_spans]
    kept = []
    for j, end in enumerate(target_ends):
        begin = target_ends[j - 1] if j else 0
        end = max(end, begin + 1)  # a token completing no character belongs with the next one
        i = bisect.bisect_right(starts, begin) - 1
        hit = (i >= 0 and char_spans[i][1] > begin) or (i + 1 < len(char_spans) and char_spans[i + 1][0] < end)
        if hit:
            kept.append(j)
    return kept
