"""A needle in a haystack on the bundled model: the question quotes the needle, so its 4-gram anchors keep the
needle's chunk at every keep ratio, and the compressed request runs end to end (with the default drafter)."""
from __future__ import annotations

import random

import pytest

from lucebox import LLM, SamplingParams

NEEDLE = "The vault code for project heron is 58213."
QUESTION = "\nQuestion: what is the vault code for project heron? Answer:"


def haystack(lines: int, needle_at: int) -> str:
    rng = random.Random(4)
    names = ["parse", "render", "load", "store", "merge", "split", "index", "count"]
    body = [f"def {rng.choice(names)}_{i}(x):\n    return x * {rng.randint(2, 999)} + {rng.randint(0, 99)}\n"
            for i in range(lines)]
    body.insert(needle_at, NEEDLE + "\n")
    return "".join(body) + QUESTION


@pytest.fixture(scope="module")
def llm():
    return LLM(prefill_min_tokens=256, max_model_len=8192)


@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.2])
def test_the_quoted_needle_survives_compression(llm, ratio):
    text = haystack(200, 77)
    ids = llm.tokenizer.encode(text)
    compression = llm.engine.speculative_prefill().compress(ids, ratio)
    kept_text = llm.tokenizer.decode(compression.kept_ids)
    assert NEEDLE in kept_text and kept_text.endswith(QUESTION)
    # the budget, plus at most 8 anchor hits of radius 2 (the query's last 96 tokens hold code lines too)
    chunks = -(-len(ids) // 32)
    assert len(compression.kept_positions) <= (int(chunks * ratio) + 8 * 5) * 32 < 0.6 * len(ids)


def test_a_compressed_request_runs_end_to_end(llm):
    text = haystack(200, 150)
    out = llm.generate({"prompt": text, "prefill_keep_ratio": 0.1},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6
    assert out.metrics.prompt_tokens_kept < 0.6 * len(out.prompt_token_ids)
