"""Needle recall against pool size on the bundled model: a needle line at five depths of a ~2K-token haystack
of code lines, the question quoting it; after the prompt's resident-set choice, how much of the needle stays
on the device. Chunk scores (Quest bounds against the last query) beat recency at every pool size."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.model.kv_pool.score import ChunkSummaries
from tests.engine.test_pflash_needle import NEEDLE, haystack

LINES, DEPTHS = 100, (10, 25, 40, 55, 70)


def recall(pool_tokens: int) -> float:
    """Share of needle tokens resident when the first token is decoded, over DEPTHS."""
    llm = LLM(max_model_len=8192, kv_pool_tokens=pool_tokens, kv_pool_target=True, max_num_batched_tokens=8192,
              speculative_config={})
    engine, block = llm.engine, llm.engine.args.block_size
    found = total = 0
    for depth in DEPTHS:
        text = haystack(LINES, depth)
        ids = llm.tokenizer.encode(text)
        first = len(llm.tokenizer.encode(text[:text.index(NEEDLE)]))
        needle = range(first, first + len(llm.tokenizer.encode(NEEDLE)))
        engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2,
                                                                          ignore_eos=True))
        seq = engine.requests["r"][1][0]
        engine.step()  # the exact prefill, then the resident set chosen with its last token's queries
        engine.kv_pool.land()  # as the next step does first
        resident = set(seq.kv_view.blocks(len(seq.block_table))) if seq.kv_view is not None else None
        found += sum(resident is None or p // block in resident for p in needle)
        total += len(needle)
        while engine.has_unfinished():
            engine.step()
    return found / total


def test_scored_chunks_keep_the_needle_more_often_than_recency(monkeypatch):
    pools = (512, 1024)
    scored = [recall(p) for p in pools]
    monkeypatch.setattr(ChunkSummaries, "scores", lambda self, q: torch.zeros(self.count))  # ties: most recent
    recent = [recall(p) for p in pools]
    print("needle recall, pool", pools, "scored", scored, "recency", recent)
    assert scored == sorted(scored) and scored[-1] >= 0.8
    assert all(s > r for s, r in zip(scored, recent))
