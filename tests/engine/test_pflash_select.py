"""PFlash chunk selection: budget, forced head and tail, anchors, order, and the token-span mapping."""
from __future__ import annotations

import pytest
import torch

from lucebox.engine.pflash.select import (SelectionRules, anchor_chunks, char_ends, chunk_means, kept_token_spans,
                                          map_spans, select_chunks)
from lucebox.text.tokenizer import Tokenizer

RULES = SelectionRules(chunk=4, head_chunks=1, tail_chunks=1, query_tokens=8, ngram=4)


def flat_scores(n: int, peaks: dict[int, float] = {}) -> torch.Tensor:
    s = torch.zeros(n)
    for i, v in peaks.items():
        s[i] = v
    return s


def test_chunk_means_handle_a_short_last_chunk():
    torch.testing.assert_close(chunk_means(torch.arange(10.0), 4), torch.tensor([1.5, 5.5, 8.5]))


def test_budget_is_the_ratio_of_chunks_with_head_and_tail_forced():
    ids = list(range(100, 140))  # 10 chunks of 4, no repeated n-grams
    scores = flat_scores(40, {21: 5.0, 13: 3.0, 30: 1.0})
    assert select_chunks(scores, ids, 0.5, RULES) == [0, 3, 5, 7, 9]  # head, tail, then chunks 5, 3, 7 by score
    assert select_chunks(scores, ids, 0.3, RULES) == [0, 5, 9]
    assert select_chunks(scores, ids, 1.0, RULES) == list(range(10))
    assert select_chunks(scores, ids, 0.01, RULES) == [9]  # one chunk: the tail wins the shrink


def test_forced_chunks_shrink_in_proportion():
    rules = SelectionRules(chunk=4, head_chunks=8, tail_chunks=24, query_tokens=8)
    ids = list(range(1000, 1400))  # 100 chunks
    kept = select_chunks(flat_scores(400, {200: 9.0}), ids, 0.08, rules)  # budget 8: tail 6, head 2
    assert kept == [0, 1, 94, 95, 96, 97, 98, 99]


def test_anchors_force_the_neighbourhood_of_quoted_ngrams():
    ids = list(range(500, 600))  # 25 chunks
    ids[40:44] = [7, 8, 9, 10]  # chunk 10 holds a 4-gram ...
    ids[95:99] = [7, 8, 9, 10]  # ... that the query (last 8 tokens) quotes
    assert anchor_chunks(ids, RULES, 25) == [8, 9, 10, 11, 12]  # radius 2 at this size
    kept = select_chunks(flat_scores(100, {60: 9.0}), ids, 0.4, RULES)  # budget 10
    # tail, head, the anchors, the best-scored chunk, then ties in prompt order
    assert kept == [0, 1, 2, 8, 9, 10, 11, 12, 15, 24]
    # anchors are forced past a budget the head and tail fill
    assert select_chunks(flat_scores(100, {60: 9.0}), ids, 0.08, RULES) == [0, 8, 9, 10, 11, 12, 24]
    # a 3-gram match is no anchor
    ids[43] = 11
    assert anchor_chunks(ids, RULES, 25) == []


def test_anchor_hits_are_capped():
    rules = SelectionRules(chunk=4, head_chunks=0, tail_chunks=1, query_tokens=8)
    ids = list(range(1000, 1400))
    for at in range(0, 360, 20):  # 18 earlier copies of the query's 4-gram
        ids[at:at + 4] = [1, 2, 3, 4]
    ids[396:400] = [1, 2, 3, 4]
    # 8 hits (chunks 0, 5, .., 35) of radius 2: the 10 others are ignored
    assert anchor_chunks(ids, rules, 100) == list(range(38))


def test_spans_merge_adjacent_chunks():
    assert kept_token_spans([0, 1, 3, 6], 4, 26) == [(0, 8), (12, 16), (24, 26)]


def test_bad_ratio_and_lengths_are_refused():
    with pytest.raises(ValueError, match="keep_ratio"):
        select_chunks(torch.zeros(8), list(range(8)), 0.0, RULES)
    with pytest.raises(ValueError, match="scores for"):
        select_chunks(torch.zeros(8), list(range(9)), 0.5, RULES)


def test_map_spans_follows_characters_across_tokenizers(tokenizer_dir):
    tok = Tokenizer.from_hf_dir(tokenizer_dir)
    text = "def fibonacci(n): return a + b. The quick brown fox jumps over the lazy dog."
    coarse = tok.encode(text, add_special_tokens=False)
    fine = [tok.token_to_id(ch) for ch in text.replace(" ", "Ġ")]  # one byte-level token per character
    assert tok.decode(fine) == text
    ends_coarse, ends_fine = char_ends(tok, coarse), char_ends(tok, fine)
    assert ends_fine == list(range(1, len(text) + 1)) and ends_coarse[-1] == len(text)
    start = text.index("quick")
    source = [(i, i + 1) for i, e in enumerate(ends_fine) if start <= i < start + 5]  # the characters of "quick"
    kept = map_spans(kept_token_spans([i for a, _ in source for i in [a]], 1, len(fine)), ends_fine, ends_coarse)
    assert "quick" in tok.decode([coarse[j] for j in kept])
    assert len(kept) < len(coarse) / 3
    # identity mapping: the same tokenisation on both sides keeps exactly the spans' tokens
    assert map_spans([(2, 5), (9, 11)], ends_coarse, ends_coarse) == [2, 3, 4, 9, 10]
