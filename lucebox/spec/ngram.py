"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

No model: drafts come from the prompt and the output so far, which pays off on code edits,
summaries and anything that quotes its input. Longer matches are tried first (n_max down to n_min).

Each sequence keeps an index of where every n-gram of its tokens starts, extended by the tokens
appended since the last lookup, so a lookup costs a few dictionary probes whatever the context
length (a scan of the whole context each step cost ~0.25 ms at 300 tokens and ~2.5 ms at 3,000,
more than a decode step of a small model on a GPU).
"""
from __future__ import annotations

from bisect import bisect_right

from ..errors import RequestError
from .proposer import Draft, Proposer


class NgramIndex:
    """One sequence's tokens and the start positions (ascending) of every n-gram in them,
    n_min <= n <= n_max; extended as the sequence grows, so nothing is rescanned."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens and index the n-grams they complete."""
        old = len(self.tokens)
        self.tokens += new_tokens
        end = len(self.tokens)
        for n in range(self.n_min, self.n_max + 1):
            for start in range(max(0, old - n + 1), end - n + 1):
                self.starts.setdefault(tuple(self.tokens[start:start + n]), []).append(start)

    def lookup(self, k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching tail, up to k tokens:
        the latest occurrence that has k tokens after it, else the one with the most."""
        tokens, end = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            starts = self.starts.get(tuple(tokens[end - n:]), ())
            i = bisect_right(starts, end - n - k) - 1  # latest start with k tokens after the n-gram
            if i >= 0:
                return tokens[starts[i] + n:starts[i] + n + k]
            if starts and starts[0] < end - n:  # earlier ones all run into the tail: the longest follow
                return tokens[starts[0] + n:]
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
