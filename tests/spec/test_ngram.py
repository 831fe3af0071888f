"""N-gram prompt lookup: the incremental index proposes exactly what a scan of the context would."""
from __future__ import annotations

import random

import pytest

from lucebox.engine.sequence import Sequence
from lucebox.sampling import SamplingParams
from lucebox.spec.ngram import NgramIndex, NgramProposer


def scan(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The specification: for the longest tail n-gram that occurred before, the latest earlier
    occurrence with k tokens after it, else the occurrence with the most tokens after it."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail, best = tokens[-n:], []
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


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_the_index_grown_token_by_token_proposes_what_a_scan_finds(vocab):
    rng = random.Random(vocab)
    for _ in range(20):
        n_min, n_max = rng.choice([(1, 1), (2, 4), (3, 5)])
        index = NgramIndex(n_min, n_max)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        for _ in range(40):
            if rng.random() < 0.3:  # a repeated stretch, as code and quotes have
                start = rng.randrange(len(tokens))
                tokens += tokens[start:start + rng.randrange(1, 6)]
            else:
                tokens.append(rng.randrange(vocab))
            if rng.random() < 0.5:  # lookups now and then: the index catches up over several tokens
                index.extend(tokens[len(index.tokens):])
                k = rng.randrange(1, 6)
                assert index.lookup(k) == scan(tokens, k, n_min, n_max), (tokens, k)


def test_the_proposer_keeps_one_index_per_sequence_and_drops_it_on_release():
    proposer = NgramProposer(2, 3)
    params = SamplingParams(max_tokens=10)
    a = Sequence("a", 0, [1, 2, 3, 9, 1, 2], params)
    b = Sequence("b", 0, [5, 6, 7, 5, 6], params)
    assert proposer.lookup(a, 2) == [3, 9]
    assert proposer.lookup(b, 3) == [7, 5, 6]
    a.output_token_ids.append(3)  # [.., 1, 2, 3]: the tail 1 2 3 matched at the start
    assert proposer.lookup(a, 2) == [9, 1]
    proposer.release(a)
    assert id(a) not in proposer.indexes and id(b) in proposer.indexes
