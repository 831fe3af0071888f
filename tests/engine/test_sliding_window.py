"""Sliding-window models hold a window of KV, not the whole context: blocks behind every layer's
window go back to the pool as a sequence grows, and outputs stay exactly the reference's."""
from __future__ import annotations

import random

import pytest
import torch

from lucebox import LLM, SamplingParams

from tests.conftest import build_hf_model

WINDOW, BLOCK, NEW = 8, 4, 48
KV_MEMORY = 8 << 20  # explicit: on a GPU the default pool takes most of the card for each engine
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tokenizer_dir, tmp_path_factory):
    return str(build_hf_model("mistral", tmp_path_factory.mktemp("mistral-w8"), tokenizer_dir, seed=3,
                              sliding_window=WINDOW))


def prompts(n: int = 8, seed: int = 1) -> list[dict]:
    g = random.Random(seed)
    return [{"prompt_token_ids": [g.randrange(380) for _ in range(g.choice([3, 11, 26, 37]))]} for _ in range(n)]


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def reference_greedy(path: str, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def watch_blocks(llm) -> list[int]:
    """Record, every step, the blocks each decoding sequence holds once its step's room is taken."""
    held, schedule, cache = [], llm.engine.scheduler.schedule, llm.engine.scheduler.cache

    def spy():
        batch = schedule()
        held.extend(cache.held_blocks(s) for s, n in zip(batch.seqs, batch.num_new_tokens) if n == 1)
        return batch

    llm.engine.scheduler.schedule = spy
    return held


def assert_pool_empty(llm):
    blocks = llm.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(b.ref_count == 0 for b in blocks.blocks)


@pytest.fixture(scope="module")
def unreleased(mistral):
    llm = LLM(mistral, block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    llm.engine.scheduler.cache.release_window = None
    return ids(llm.generate(prompts(), GREEDY, use_tqdm=False))


def test_release_keeps_greedy_output_equal_to_transformers_and_to_keeping_everything(mistral, unreleased):
    llm = LLM(mistral, block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    assert llm.engine.scheduler.cache.release_window == WINDOW
    held = watch_blocks(llm)
    outs = ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
    assert outs == unreleased
    for prompt, out in zip(prompts(), outs):
        assert out == reference_greedy(mistral, prompt["prompt_token_ids"])
    # decoding position p reads p - W + 1 .. p: at most ceil(W / block) + 1 blocks, whatever the length
    assert len(held) >= NEW and max(held) <= -(-WINDOW // BLOCK) + 1
    assert_pool_empty(llm)


def test_preemption_and_recompute_with_released_blocks(mistral):
    g = random.Random(4)
    many = [{"prompt_token_ids": [g.randrange(380) for _ in range(g.randint(2, 5))]} for _ in range(16)]
    plain = LLM(mistral, block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    plain.engine.scheduler.cache.release_window = None
    want = ids(plain.generate(many, GREEDY, use_tqdm=False))
    # 24 blocks, one max_model_len: sixteen short prompts join at once, then their windows of 2-3
    # blocks do not fit; released blocks go to other sequences at once
    llm = LLM(mistral, block_size=BLOCK, max_model_len=96, kv_cache_memory=24 * BLOCK * 512)
    assert ids(llm.generate(many, GREEDY, use_tqdm=False)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


def test_prefix_cache_serves_released_blocks(mistral, unreleased):
    llm = LLM(mistral, block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    first = ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert first == ids(again) == unreleased
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_pool_empty(llm)


def test_chunked_prefill_with_release(mistral, unreleased):
    llm = LLM(mistral, block_size=BLOCK, kv_cache_memory=KV_MEMORY, max_num_batched_tokens=5)
    assert ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == unreleased


def test_speculative_rollback_with_released_blocks(mistral):
    repeated = [{"prompt_token_ids": p["prompt_token_ids"] * 3} for p in prompts(seed=2)]
    plain = LLM(mistral, block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    plain.engine.scheduler.cache.release_window = None
    want = ids(plain.generate(repeated, GREEDY, use_tqdm=False))
    llm = LLM(mistral, block_size=BLOCK, kv_cache_memory=KV_MEMORY,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                  "adaptive": False})
    assert llm.engine.scheduler.cache.release_window == WINDOW  # n-gram lookups keep no cache
    outs = llm.generate(repeated, GREEDY, use_tqdm=False)
    assert ids(outs) == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert_pool_empty(llm)


def test_mixed_windows_keep_every_full_block_and_a_window_of_sliding_ones(hf_models):
    # one sliding layer (window 6), one full: more in tests/engine/test_sliding_window_mixed.py
    llm = LLM(str(hf_models["qwen2"]), block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    cache = llm.engine.scheduler.cache
    assert cache.release_window is None and cache.windows == [6]
    held, schedule = [], llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        held.extend(cache.held_by_group(s) for s, n in zip(batch.seqs, batch.num_new_tokens) if n == 1)
        return batch

    llm.engine.scheduler.schedule = spy
    outs = llm.generate(prompts(2), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert max(h[0] for h in held) == -(-(max(len(o.prompt_token_ids) for o in outs) + 15) // BLOCK)
    assert max(h[1] for h in held) <= -(-6 // BLOCK) + 1
