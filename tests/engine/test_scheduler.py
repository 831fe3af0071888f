"""Continuous batching, chunked prefill, preemption and prefix caching keep outputs exact."""
from __future__ import annotations

import random

import pytest

from lucebox import LLM, SamplingParams
from lucebox.errors import ContextLengthError, OverloadError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 3, lo: int = 2, hi: int = 40) -> list[dict]:
    g = random.Random(seed)
    return [{"prompt_token_ids": [g.randrange(380) for _ in range(g.randint(lo, hi))]} for _ in range(n)]


@pytest.fixture(scope="module")
def path(hf_models):
    return str(hf_models["llama"])


@pytest.fixture(scope="module")
def one_at_a_time(path):
    llm = LLM(path, block_size=4, max_num_seqs=1, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts(10)]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_pool_empty(llm):
    blocks = llm.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(b.ref_count == 0 for b in blocks.blocks)


def test_batched_equals_one_at_a_time(path, one_at_a_time):
    llm = LLM(path, block_size=4)
    assert token_ids(llm.generate(prompts(10), GREEDY, use_tqdm=False)) == one_at_a_time
    assert_pool_empty(llm)


def test_chunked_prefill_under_a_small_token_budget_equals_one_at_a_time(path, one_at_a_time):
    llm = LLM(path, block_size=4, max_num_batched_tokens=7)
    seen = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        seen.append(batch.total_tokens)
        return batch

    llm.engine.scheduler.schedule = spy
    assert token_ids(llm.generate(prompts(10), GREEDY, use_tqdm=False)) == one_at_a_time
    assert max(seen) <= 7
    assert_pool_empty(llm)


def test_preemption_and_recompute_equal_one_at_a_time(path, one_at_a_time):
    # 96 tokens of KV: enough for the longest sequence, far too few for ten at once.
    llm = LLM(path, block_size=4, max_model_len=96, kv_cache_memory=96 * 512)
    assert token_ids(llm.generate(prompts(10), GREEDY, use_tqdm=False)) == one_at_a_time
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


def test_prefix_cache_hits_keep_outputs_identical(path, one_at_a_time):
    llm = LLM(path, block_size=4)
    first = token_ids(llm.generate(prompts(10), GREEDY, use_tqdm=False))
    again = llm.generate(prompts(10), GREEDY, use_tqdm=False)
    assert first == token_ids(again) == one_at_a_time
    assert sum(o.num_cached_tokens for o in again) > 0


def test_shared_three_block_prefix_is_served_from_cache_and_only_the_rest_computed(path):
    llm = LLM(path, block_size=4)
    shared = list(range(10, 22))  # exactly 3 blocks
    llm.generate({"prompt_token_ids": shared + [1, 2]}, GREEDY, use_tqdm=False)
    engine = llm.engine
    engine.add_request("b", {"prompt_token_ids": shared + [5, 6, 7]}, GREEDY)
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [3]
    assert batch.seqs[0].num_cached_tokens == 12
    engine.abort("b")
    out = llm.generate({"prompt_token_ids": shared + [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 12


def test_several_prefixes_stay_cached_at_once(path):
    llm = LLM(path, block_size=4)
    systems = [list(range(s, s + 16)) for s in (20, 60, 100)]
    for system in systems:
        llm.generate({"prompt_token_ids": system + [7]}, GREEDY, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": system + [8, 9]} for system in systems], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [16, 16, 16]


def test_whole_prompt_never_served_from_cache(path):
    llm = LLM(path, block_size=4)
    p = {"prompt_token_ids": list(range(30, 38))}  # 2 full blocks
    first = llm.generate(p, GREEDY, use_tqdm=False)[0]
    again = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 4  # the last block holds the last token, which must be computed
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_random_adds_aborts_and_finishes_leave_no_leak(path):
    llm = LLM(path, block_size=4, max_model_len=64, kv_cache_memory=160 * 512, max_num_batched_tokens=24)
    engine, rng = llm.engine, random.Random(11)
    live, next_id = set(), 0
    for step in range(300):
        action = rng.random()
        if action < 0.3:
            n = rng.randint(1, 30)
            shared = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []
            ids = shared + [rng.randrange(380) for _ in range(n)]
            params = SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, 64 - len(ids)),
                                    ignore_eos=True, n=rng.choice([1, 1, 2]))
            engine.add_request(str(next_id), {"prompt_token_ids": ids}, params)
            live.add(str(next_id))
            next_id += 1
        elif action < 0.4 and live:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            live.discard(out.request_id)
    assert not engine.has_unfinished() and not live and not engine.scheduler.has_work()
    assert_pool_empty(llm)


def test_request_that_can_never_fit_is_refused_at_admission(path):
    llm = LLM(path, max_model_len=32)
    with pytest.raises(ContextLengthError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [1] * 20}, SamplingParams(max_tokens=20), use_tqdm=False)


def test_full_waiting_queue_refuses_new_work(path):
    llm = LLM(path, max_queue=2)
    engine = llm.engine
    engine.add_request("a", "x", GREEDY)
    engine.add_request("b", "y", GREEDY)
    with pytest.raises(OverloadError, match="max-queue"):
        engine.add_request("c", "z", GREEDY)
    engine.abort("a"), engine.abort("b")


def test_token_slice_reads_prompt_and_output_as_one_list():
    from lucebox.engine.sequence import Sequence
    seq = Sequence("r", 0, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    seq.output_token_ids += [5, 6, 7]
    whole = seq.token_ids
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_slice(start, end) == whole[start:end]
    assert seq.last_token == 7 and Sequence("s", 0, [9], SamplingParams()).last_token == 9
