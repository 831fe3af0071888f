"""PFlash scoring interleaved with engine steps: a prompt being scored advances one scorer chunk a step while
the other sequences decode; its kept positions equal the dense reference's and the synchronous compress's;
aborts free the scorer's blocks; prompts are scored first in, first out; a failure ends its request alone."""
from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.async_engine import AsyncEngine
from lucebox.engine.pflash.jobs import ScoringJob
from lucebox.engine.pflash.select import SelectionRules, kept_token_spans, select_chunks
from lucebox.errors import OverloadError, RequestError

from tests.conftest import TRAINING_TEXT, build_hf_model
from tests.engine.test_pflash_score import dense_scores

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DECODER = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# small chunks, one forced at each end: which chunks are kept depends on the scores
RULES = SelectionRules(chunk=8, head_chunks=1, tail_chunks=1)
RATIO = 0.3
SCORER_CHUNK = 40  # a 240-token prompt: forwards over 0-40, ..., 200-232, then the 8-token tail


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("target"), tokenizer_dir, seed=5)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 380, (240,), generator=torch.Generator().manual_seed(2)).tolist()


def scoring_llm(path, chunk: int = SCORER_CHUNK, **kwargs) -> LLM:
    llm = LLM(str(path), block_size=4, prefill_min_tokens=16, **kwargs)
    prefill = llm.engine.speculative_prefill()
    prefill.rules, prefill.scorer.chunk = RULES, chunk
    return llm


def squeezed(ids: list[int]) -> dict:
    return {"prompt_token_ids": ids, "prefill_keep_ratio": RATIO}


def step_until_scored(engine, request_id: str, each_step=lambda: None, outs: dict | None = None) -> int:
    """Steps until request_id's prompt is scored (how many); requests finishing meanwhile go into `outs`."""
    steps = 0
    while request_id in engine.scoring:
        finished = [o for o in engine.step() if o.finished]
        if outs is not None:
            outs.update((o.request_id, o) for o in finished)
        each_step()
        steps += 1
    return steps


def finish(engine, outs: dict | None = None) -> dict:
    outs = {} if outs is None else outs
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return outs


def test_other_sequences_decode_in_every_step_while_a_prompt_is_scored(qwen3_path, prompt):
    llm = scoring_llm(qwen3_path)
    engine, scorer = llm.engine, llm.engine.speculative_prefill().scorer
    engine.add_request("decoder", {"prompt_token_ids": prompt[:20]}, DECODER)
    engine.step()
    decoder = engine.requests["decoder"][1][0]
    assert len(decoder.output_token_ids) == 1
    engine.add_request("long", squeezed(prompt), GREEDY)
    long_seq = engine.requests["long"][1][0]
    assert long_seq not in engine.scheduler.waiting and long_seq.compression is None  # not schedulable yet
    produced, held = [], []

    def each_step():
        produced.append(len(decoder.output_token_ids))
        held.append(scorer.num_blocks - scorer.num_free_blocks)
    steps = step_until_scored(engine, "long", each_step)
    assert steps == 7 + 2  # 7 scorer forwards, the tail scores, the selection
    assert produced == list(range(2, 2 + steps))  # a token in every step
    assert held[:-1] == [240 // 4] * (steps - 1) and held[-1] == 0  # the prompt's blocks, back once scored
    assert long_seq.compression is not None and long_seq.prompt_token_ids == long_seq.compression.kept_ids
    kept = long_seq.compression.kept_positions
    outs = finish(engine)
    # the decoder is untouched by the scoring beside it, the scored request by the decoding beside it
    alone = scoring_llm(qwen3_path)
    assert outs["decoder"].outputs[0].token_ids == alone.generate(
        {"prompt_token_ids": prompt[:20]}, DECODER, use_tqdm=False)[0].outputs[0].token_ids
    long_alone = alone.generate(squeezed(prompt), GREEDY, use_tqdm=False)[0]
    assert outs["long"].outputs[0].token_ids == long_alone.outputs[0].token_ids
    assert outs["long"].metrics.prompt_tokens_kept == len(kept) == long_alone.metrics.prompt_tokens_kept


def test_kept_positions_equal_the_dense_reference_and_the_synchronous_compress(qwen3_path, prompt):
    chunks = select_chunks(dense_scores(qwen3_path, prompt, 8, 13), prompt, RATIO, RULES)
    want = [i for a, b in kept_token_spans(chunks, RULES.chunk, len(prompt)) for i in range(a, b)]
    assert len(want) == 9 * 8 and want[:8] == list(range(8)) and want[-8:] == list(range(232, 240))
    assert want != list(range(8)) + list(range(184, 240))  # chosen by score, not only forced
    llm = scoring_llm(qwen3_path)
    engine = llm.engine
    engine.add_request("long", squeezed(prompt), GREEDY)
    step_until_scored(engine, "long")
    assert engine.requests["long"][1][0].compression.kept_positions == want
    for chunk in (SCORER_CHUNK, 4096):  # the synchronous path, chunked or in one forward
        sync = scoring_llm(qwen3_path, chunk).engine.speculative_prefill()
        assert sync.compress(prompt, RATIO).kept_positions == want


def test_an_abort_mid_scoring_frees_the_scorers_blocks(qwen3_path, prompt):
    llm = scoring_llm(qwen3_path)
    engine, scorer = llm.engine, llm.engine.speculative_prefill().scorer
    engine.add_request("gone", squeezed(prompt), GREEDY)
    engine.add_request("next", squeezed(prompt[::-1]), GREEDY)
    engine.step()
    engine.step()
    assert scorer.num_free_blocks == scorer.num_blocks - 240 // 4
    engine.abort("gone")
    assert scorer.num_free_blocks == scorer.num_blocks and "gone" not in engine.scoring
    assert "attend" not in engine.model.layers[0].self_attn.__dict__
    outs = finish(engine)
    assert set(outs) == {"next"} and len(outs["next"].outputs[0].token_ids) == 8
    assert scorer.num_free_blocks == scorer.num_blocks


def test_prompts_are_scored_first_in_first_out(qwen3_path, prompt):
    prompts = {"a": squeezed(prompt), "b": squeezed(prompt[::-1][:200])}
    alone = {rid: scoring_llm(qwen3_path).generate(p, GREEDY, use_tqdm=False)[0] for rid, p in prompts.items()}
    engine = scoring_llm(qwen3_path).engine
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY)
    job_b = engine.scoring["b"]
    a_steps = step_until_scored(engine, "a")
    assert a_steps == 9 and job_b.seconds == 0 and job_b.progress is None  # b waited its turn, untouched
    assert engine.requests["a"][1][0] in engine.scheduler.running  # a prefills while b is scored
    outs = {}
    assert step_until_scored(engine, "b", outs=outs) == 6 + 2  # 0-40, ..., 160-192, 192-200; tail; selection
    finish(engine, outs)
    for rid in prompts:
        assert outs[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids
        assert outs[rid].metrics.prompt_tokens_kept == alone[rid].metrics.prompt_tokens_kept


def test_sequences_being_scored_count_against_the_queue_limit(qwen3_path, prompt):
    engine = scoring_llm(qwen3_path, max_queue=3).engine
    engine.add_request("two", squeezed(prompt), SamplingParams(n=2, max_tokens=2))
    assert engine.scoring.num_sequences == 2 and not engine.scheduler.waiting
    with pytest.raises(OverloadError, match="2 sequences are waiting and this request adds 2"):
        engine.add_request("more", squeezed(prompt), SamplingParams(n=2, max_tokens=2))
    engine.abort("two")
    assert engine.scoring.num_sequences == 0
    engine.add_request("more", squeezed(prompt), SamplingParams(n=2, max_tokens=2))
    outs = finish(engine)
    assert [len(o.token_ids) for o in outs["more"].outputs] == [2, 2] and engine.scoring.num_sequences == 0


def test_scoring_logs_its_progress(qwen3_path, prompt, caplog):
    engine = scoring_llm(qwen3_path).engine
    caplog.set_level(logging.INFO, logger="lucebox.prefill")
    engine.add_request("long", squeezed(prompt), GREEDY)
    finish(engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "lucebox.prefill"]
    assert lines[0] == "scoring long: 40 / 240 prompt tokens"
    done = [int(line.split(":")[1].split("/")[0]) for line in lines]
    assert done == [40, 80, 120, 160, 200, 232, 240]
    assert "(100%)" in lines[-1] and "tok/s" in lines[-1] and engine.progress.started == {}


@pytest.fixture(scope="module")
def narrow_scorer(tmp_path_factory, tokenizer_dir):
    """A scorer whose embedding ends before its tokenizer's vocabulary does: the tokenizer's merged tokens
    (ids of 300 up) cannot be scored."""
    return build_hf_model("qwen3", tmp_path_factory.mktemp("narrow"), tokenizer_dir, seed=7, vocab_size=300)


def test_a_failed_scoring_ends_its_request_alone(qwen3_path, narrow_scorer, prompt):
    llm = LLM(str(qwen3_path), block_size=4, prefill_min_tokens=16, prefill_scorer=str(narrow_scorer))
    text = TRAINING_TEXT[:400]
    assert max(llm.tokenizer.encode(text)) >= 300
    scorable = {"prompt": " ".join("xq" for _ in range(40)), "prefill_keep_ratio": 0.5}
    assert max(llm.tokenizer.encode(scorable["prompt"])) < 300
    exact = {"prompt_token_ids": prompt[:30]}
    alone = [llm.generate(p, DECODER, use_tqdm=False)[0].outputs[0].token_ids for p in (exact, scorable)]
    outs = llm.generate([exact, {"prompt": text, "prefill_keep_ratio": 0.5}, scorable], DECODER, use_tqdm=False)
    failed = outs[1]
    assert isinstance(failed.error, RequestError) and "outside the scorer's vocabulary (0..299)" in str(failed.error)
    assert failed.finished and failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert outs[0].error is None and outs[2].error is None and outs[2].metrics.prompt_tokens_kept is not None
    scorer = llm.engine.speculative_prefill().scorer
    assert scorer.num_free_blocks == scorer.num_blocks and not llm.engine.scoring


def test_a_failed_scoring_raises_in_its_stream_only(qwen3_path, narrow_scorer, prompt):
    llm = LLM(str(qwen3_path), block_size=4, prefill_min_tokens=16, prefill_scorer=str(narrow_scorer))
    engine = AsyncEngine(llm.engine)

    async def collect(request_id, request):
        return [out async for out in await engine.add_request(request_id, request, DECODER)]

    async def main():
        return await asyncio.gather(collect("ok", {"prompt_token_ids": prompt[:30]}),
                                    collect("bad", {"prompt": TRAINING_TEXT[:400], "prefill_keep_ratio": 0.5}),
                                    return_exceptions=True)
    try:
        ok, bad = asyncio.run(main())
        assert engine.is_running  # the engine loop lives on
    finally:
        engine.shutdown()
    assert isinstance(bad, RequestError) and "speculative prefill cannot score this prompt" in str(bad)
    assert ok[-1].finished and len(ok[-1].outputs[0].token_ids) == 40


def failing(error: Exception):
    yield (1, 2)
    raise error


@pytest.mark.parametrize("error,kind,words", [
    (ValueError("no spans"), RequestError, "speculative prefill failed on this prompt (ValueError: no spans)"),
    (torch.OutOfMemoryError("CUDA out of memory"), OverloadError, "ran out of memory scoring this prompt"),
    (RequestError("as it is"), RequestError, "as it is"),
])
def test_a_jobs_error_becomes_a_request_error(error, kind, words):
    class Owner:
        class scorer:
            chunk = 4
    job = ScoringJob(Owner(), failing(error), 10, 0.5)
    assert job.advance() is False and job.progress == (1, 2)
    assert job.advance() is True and job.error is error and job.result is None
    assert isinstance(job.request_error, kind) and words in str(job.request_error)
    with pytest.raises(type(error)):
        job.run()
