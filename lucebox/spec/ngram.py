"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

No model: drafts come from the prompt and the output so far, which pays off on code edits,
summaries and anything that quotes its input. Longer matches are tried first (n_max down to n_min).

Each sequence keeps an index of where every n-gram of its tokens starts, extended by the tokens
appended since the last lookup, so a lookup costs a few dictionary probes whatever the context
length (a scan of the whole context each step cost ~0.25 ms at 300 tokens and ~2.5 ms at 3,000,
more than a decode step of a small model on a GPU).
"""
from __future__ import annotations

from ..errors import RequestError
from ..sampling.acceptance import Draft
from .proposer import Proposer


class NgramIndex:
    """One sequence's tokens and, per n-gram (n_min <= n <= n_max), its first and latest start and,
    for each start, the previous start of the same n-gram: extended as the sequence grows, so nothing
    is rescanned. N-grams are keyed by their hash and nothing but ints is stored: a list of starts
    per n-gram, or a tuple key, leaves containers behind that the garbage collector walks, ~5 us
    per indexed token against 0.9. (Two n-grams of equal hash, about one in 2^60, would propose a
    draft that verification then rejects: lookup proposes, the target decides.)"""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        sizes = range(n_max - n_min + 1)
        self.first: list[dict[int, int]] = [{} for _ in sizes]  # n-gram hash -> start
        self.last: list[dict[int, int]] = [{} for _ in sizes]
        self.previous: list[list[int]] = [[] for _ in sizes]  # by start; -1: the first occurrence
        self.tables = list(zip(range(n_min, n_max + 1), self.first, self.last, self.previous))

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens and index the n-grams they complete."""
        tokens, old = self.tokens, len(self.tokens)
        tokens += new_tokens
        end = len(tokens)
        for n, first, last, previous in self.tables:
            for start in range(max(0, old - n + 1), end - n + 1):
                key = hash(tuple(tokens[start:start + n]))
                before = last.get(key, -1)
                previous.append(before)
                if before < 0:
                    first[key] = start
                last[key] = start

    def lookup(self, k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching tail, up to k tokens:
        the latest occurrence that has k tokens after it, else the one with the most (the first)."""
        tokens, end = self.tokens, len(self.tokens)
        if end <= self.n_min or self.previous[0][end - self.n_min] < 0:
            return []  # the shortest tail never occurred before, so no longer one did (most steps)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            i = n - self.n_min
            key = hash(tuple(tokens[end - n:]))
            start, previous, latest = self.last[i].get(key, -1), self.previous[i], max(end - n - k, -1)
            while start > latest:  # at most k + 1 steps back: the starts after end - n - k
                start = previous[start]
            if start >= 0:
                return tokens[start + n:start + n + k]
            first = self.first[i].get(key, end)
            if first < end - n:  # earlier ones all run into the tail: the longest follow
                return tokens[first + n:]
        return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, n_min: int = 3, n_max: int = 5):
        if not 1 <= n_min <= n_max:
            raise RequestError(f"n-gram lookup needs 1 <= prompt_lookup_min ({n_min}) <= prompt_lookup_max ({n_max})")
        self.n_min, self.n_max = n_min, n_max
        self.indexes: dict[int, tuple[list[int], NgramIndex]] = {}  # per sequence: (its prompt list, index)

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        return [Draft(self.lookup(seq, k)) for seq, k in zip(seqs, num_tokens)]

    def lookup(self, seq, k: int) -> list[int]:
        if k <= 0:
            return []
        prompt, index = self.indexes.get(id(seq), (None, None))
        if prompt is not seq.prompt_token_ids or len(index.tokens) > seq.num_tokens:  # not this sequence's
            index = NgramIndex(self.n_min, self.n_max)
            self.indexes[id(seq)] = (seq.prompt_token_ids, index)
        index.extend(seq.token_slice(len(index.tokens), seq.num_tokens))
        return index.lookup(k)

    def release(self, seq, finished: bool = True) -> None:
        self.indexes.pop(id(seq), None)
