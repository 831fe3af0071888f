"""Long prefills log their progress: one line a chunk, with the rate and the time left."""
from __future__ import annotations

import logging

from lucebox.config import EngineArgs
from lucebox.engine.engine import LLMEngine
from lucebox.engine.progress import PrefillProgress
from lucebox.engine.sequence import Sequence
from lucebox.sampling import SamplingParams


def _seq(n: int, index: int = 0) -> Sequence:
    return Sequence("req-1", index, list(range(n)), SamplingParams())


def test_each_chunk_of_a_long_prompt_logs_done_total_rate_and_time_left():
    progress, seq = PrefillProgress(chunk_tokens=1000), _seq(3000)
    seq.num_computed = 1000
    assert progress.chunk_done(seq, now=10.0) == "prefill req-1: 1,000 / 3,000 prompt tokens"
    seq.num_computed = 2000
    assert progress.chunk_done(seq, now=12.0) == "prefill req-1: 2,000 / 3,000 prompt tokens (67%), 500 tok/s, ~2 s left"
    seq.num_computed = 3000
    assert progress.chunk_done(seq, now=14.0).endswith("3,000 / 3,000 prompt tokens (100%), 500 tok/s, ~0 s left")
    assert progress.started == {}


def test_short_prompts_and_sibling_outputs_log_nothing():
    progress = PrefillProgress(chunk_tokens=1000)
    short = _seq(1000)
    short.num_computed = 1000
    sibling = _seq(3000, index=1)
    sibling.num_computed = 1000
    assert progress.chunk_done(short) is None and progress.chunk_done(sibling) is None


def test_the_engine_logs_a_multi_chunk_prefill(hf_models, caplog):
    engine = LLMEngine.from_args(EngineArgs(model=str(hf_models["qwen3"]), max_model_len=256, dtype="float32",
                                            max_num_batched_tokens=32, speculative_config={}))
    caplog.set_level(logging.INFO, logger="lucebox.prefill")
    engine.add_request("long", {"prompt_token_ids": list(range(5, 105))}, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "lucebox.prefill"]
    assert lines[0] == "prefill long: 32 / 100 prompt tokens" and "100 / 100" in lines[-1]
    assert len(lines) == 4 and engine.progress.started == {}
