"""CUDA-graph buckets under tensor parallelism, on the CPU (two gloo ranks): each step's plan names the bucket
rank 0 pads it to, and every rank runs that padded static batch (GraphSettings(capture=False): the batches a
graph would replay, eagerly), so the collectives of a padded step have one size on every rank. A rank padding
differently from rank 0 would fail the step (gloo refuses mismatched sizes)."""
from __future__ import annotations

from dataclasses import replace

from lucebox import LLM
from tests.engine.test_tensor_parallel import GREEDY, PROMPTS, engine_kwargs
from tests.engine.test_tensor_parallel_hybrid import GREEDY as HYBRID_GREEDY
from tests.engine.test_tensor_parallel_hybrid import hybrid_kwargs, models  # noqa: F401

THREE = [*PROMPTS, "Once upon a time there was"]  # three sequences: decode steps pad to a bucket of four


def tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(THREE, GREEDY, use_tqdm=False)]


def test_every_rank_pads_a_step_to_rank_0s_bucket_and_tokens_equal_tp1(hf_models):
    model = str(hf_models["llama"])
    want = tokens(LLM(model, speculative_config={}, **engine_kwargs()))
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, tensor_parallel_size=2,
              cuda_graphs=True, **engine_kwargs())
    try:
        settings = llm.engine._graph_settings()
        assert settings is not None and settings.prefill_lens  # prompts take prefill buckets too
        llm.engine.runner.attach_graphs(replace(settings, capture=False))  # the other rank attaches the same
        llm.engine.runner.capture_graphs()  # a no-op without capture, sent to the other rank all the same
        assert tokens(llm) == want
        replays = llm.engine.runner.graphs.replays
        assert replays[(4, 1)] > 0  # three decodes padded to four sequences on both ranks
        assert any(q > 1 for _, q in replays)  # verifies or prompts padded to longer buckets as well
    finally:
        llm.engine.shutdown()


def test_a_hybrid_under_tp2_replays_rank_0s_buckets_over_each_ranks_state(models):
    """Qwen 3.5 hybrid: each rank's DeltaNet state slots come in the plan, and its buckets read the
    recurrent pools it built before any bucket existed."""
    model = str(models["dense"])
    plain = hybrid_tokens(LLM(model, speculative_config={}, **hybrid_kwargs()))
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, tensor_parallel_size=2,
              cuda_graphs=True, **hybrid_kwargs())
    try:
        llm.engine.runner.attach_graphs(replace(llm.engine._graph_settings(), capture=False))
        assert hybrid_tokens(llm) == plain
        assert llm.engine.runner.graphs.replays[(4, 1)] > 0
    finally:
        llm.engine.shutdown()


def hybrid_tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(THREE, HYBRID_GREEDY, use_tqdm=False)]
