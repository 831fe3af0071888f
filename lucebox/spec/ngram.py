"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

No model: drafts come from the prompt and the output so far, which pays off on code edits,
summaries and anything that quotes its input. Longer matches are tried first (n_max down to n_min).
"""
from __future__ import annotations

from ..errors import RequestError
from .proposer import Draft, Proposer


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, n_min: int = 3, n_max: int = 5):
        if not 1 <= n_min <= n_max:
            raise RequestError(f"n-gram lookup needs 1 <= prompt_lookup_min ({n_min}) <= prompt_lookup_max ({n_max})")
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        return [Draft(self.lookup(seq.token_ids, k)) for seq, k in zip(seqs, num_tokens)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            tail = tokens[-n:]
            best: list[int] = []
            # Latest earlier occurrence first (recent context predicts best); one close to the end
            # has few tokens after it, so keep looking for one that can fill all k.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if len(follow) == k:
                        return follow
                    if len(follow) > len(best):
                        best = follow
            if best:
                return best
        return []
