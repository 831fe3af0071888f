"""AsyncEngine: concurrent streams, early exits abort, bad requests fail alone."""
from __future__ import annotations

import asyncio
import time

import pytest

from lucebox import LLM, SamplingParams
from lucebox.engine.async_engine import AsyncEngine
from lucebox.errors import RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(hf_models):
    return LLM(str(hf_models["qwen3"]), block_size=4)


@pytest.fixture
def engine(llm):
    async_engine = AsyncEngine(llm.engine)
    yield async_engine
    async_engine.shutdown()


def collect(engine, request_id, prompt, params=GREEDY):
    async def run():
        outputs = [out async for out in await engine.add_request(request_id, prompt, params)]
        return outputs
    return run()


def test_concurrent_streams_equal_offline_generation(llm, engine):
    prompts = ["def", "class Foo:", "import sys\nprint(", "x = [1, 2"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    for stream, want in zip(streams, expected):
        assert stream[-1].finished and stream[-1].outputs[0].token_ids == want
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths) and len(stream) > 1  # incremental, not one final blob


def test_leaving_a_stream_early_aborts_and_frees_its_blocks(llm, engine):
    async def main():
        stream = await engine.add_request("early", "def", SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()

    asyncio.run(main())
    blocks = llm.engine.scheduler.blocks
    deadline = time.monotonic() + 5  # the abort is applied by the engine thread, between steps
    while llm.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks


def test_bad_request_fails_alone(engine):
    async def main():
        good = asyncio.ensure_future(collect(engine, "good", "def"))
        with pytest.raises(RequestError):
            await engine.add_request("bad", {"prompt_token_ids": [10**7]}, GREEDY)
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 10


def test_the_server_facing_surface_reports_the_engine(llm, engine, hf_models):
    assert engine.max_model_len == llm.engine.max_model_len and engine.tokenizer is llm.tokenizer
    assert engine.vocab_size == llm.engine.model.config.vocab_size
    assert engine.eos_token_ids == llm.engine.eos_token_ids and engine.model_name == hf_models["qwen3"].name


def test_stats_count_requests_and_kv_blocks_while_one_runs(llm, engine):
    idle = engine.stats()
    assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0.0)
    assert idle.kv_capacity_tokens == llm.engine.kv_capacity_tokens == idle.kv_blocks * 4

    async def main():
        stream = await engine.add_request("busy", "def", SamplingParams(max_tokens=50, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                busy = engine.stats()
                break
        await stream.aclose()
        return busy

    busy = asyncio.run(main())
    assert busy.running + busy.waiting == 1 and busy.kv_blocks_free < busy.kv_blocks and busy.kv_usage > 0
    assert busy.prefix_cache_queries >= idle.prefix_cache_queries
