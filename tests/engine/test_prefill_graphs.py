"""Prefill graph buckets (EngineArgs.prefill_graphs): one sequence's short prefill through a padded static
batch computes what the eager prefill computes, the LM head over its last token alone.

As test_cuda_graphs.py: GraphSettings(capture=False) runs the very batches a graph would replay,
eagerly, so the padding, the static layout and the one-row head are checked on the CPU."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.cuda_graphs import CudaGraphRunner, GraphSettings
from lucebox.engine.step_plan import StepPlan
from tests.engine.test_cuda_graphs import (
    BLOCK,
    prefilled,
    rel_err,
    step_tokens,
    tiny_model,
)

SETTINGS = GraphSettings(256, max_batch=4, query_lens=(1, 4), prefill_lens=(16, 32, 64), capture=False)


@pytest.mark.parametrize("q_lens, bucket", [
    ([9], (1, 16)),  # a prefill: the smallest prefill bucket that holds it
    ([17], (1, 32)),
    ([40], (1, 64)),
    ([7], None),  # 16 padded tokens for 7 real ones: cheaper eagerly
    ([65], None),  # longer than any prefill bucket
    ([9, 9], None),  # prefill buckets hold one sequence
    ([3], (1, 4)),  # a verify-sized row stays in the step buckets
])
def test_a_prefill_takes_the_smallest_prefill_bucket_that_holds_it(q_lens, bucket):
    graphs = CudaGraphRunner(tiny_model(), BLOCK, 0, SETTINGS)
    tables = [list(range(1, 20))] * len(q_lens)
    assert graphs.bucket(step_tokens(q_lens), [5] * len(q_lens), tables) == bucket


@pytest.mark.parametrize("new_tokens", [12, 30, 50])
@pytest.mark.parametrize("argmax", [False, True])
def test_a_prefill_bucket_gives_the_eager_last_token_logits(new_tokens, argmax):
    """On a cached context (a prefix-cache hit, a chunk after the first) and on the sliding-window layer."""
    runner, tables, lens = prefilled(tiny_model(), SETTINGS, 1, room=80)
    args = (step_tokens([new_tokens]), lens, tables)
    got = runner.run(StepPlan.forward(*args, argmax=argmax))
    want = runner.run_eager(StepPlan.forward(*args, argmax=argmax))
    assert sum(runner.graphs.replays.values()) == 1  # it did take the static path
    if argmax:
        assert got.tokens == want.tokens and len(got.tokens) == 1
    else:
        assert got.logits.shape == want.logits.shape == (1, 96) and rel_err(got.logits, want.logits) <= 1e-5


@pytest.mark.parametrize("choice", [{"logits_rows": []}, {"all_logits": True}, {"capture_layers": (0,)}])
def test_prefills_wanting_other_rows_or_taps_run_eagerly(choice):
    runner, tables, lens = prefilled(tiny_model(), SETTINGS, 1, room=80)
    plan = StepPlan.forward(step_tokens([30]), lens, tables, **choice)
    assert runner.graphs.run(plan) is None


def test_greedy_generation_with_prefill_graphs_equals_eager(hf_models):
    """Prompts that take a prefill bucket, a prompt too short for one, one too long (eager), and a
    repeated prompt whose remainder after the prefix-cache hit takes a bucket."""
    prompts = [[(5 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate((40, 100, 7, 700, 100))]
    prompts[4] = prompts[1][:64] + prompts[4][:36]  # 64 cached tokens, 36 new
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs, replays = {}, None
    for graphs in (False, True):
        llm = LLM(str(hf_models["qwen3"]), device="cpu", max_model_len=1024, block_size=16,
                  cuda_graphs=True, prefill_graphs=graphs, speculative_config={})
        llm.engine.runner.attach_graphs(replace(llm.engine._graph_settings(), capture=False))
        # one at a time: a prefill bucket holds one sequence
        outputs[graphs] = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
        replays = llm.engine.runner.graphs.replays
    assert outputs[True] == outputs[False]
    assert replays[(1, 64)] >= 1 and replays[(1, 128)] >= 1  # 40 and 36 new tokens; 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_prefill_graphs_generate_what_eager_prefills_do(hf_models):
    prompts = [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate((40, 100, 300, 700))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for graphs in (False, True):
        llm = LLM(str(hf_models["qwen3"]), device="cuda", dtype="float32", max_model_len=1024,
                  prefill_graphs=graphs, speculative_config={}, kv_cache_memory=64 << 20)
        outputs[graphs] = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
        runner = llm.engine.runner
        if graphs:
            assert all(runner.graphs.replays[(1, q)] >= 1 for q in (64, 128, 512))
            assert all(graph is not None for key, (graph, _) in runner.graphs.graphs.items() if key[-1])
        del llm, runner
    assert outputs[True] == outputs[False]
