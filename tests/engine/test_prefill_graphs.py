"""Prefill graph buckets (EngineArgs.prefill_graphs): one sequence's short prefill through a padded static
batch computes what the eager prefill computes, the LM head over its last token alone.

As test_cuda_graphs.py: GraphSettings(capture=False) runs the very batches a graph would replay,
eagerly, so the padding, the static layout and the one-row head are checked on the CPU."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.cuda_graphs import CudaGraphRunner
from lucebox.engine.graph_settings import GraphSettings
from lucebox.engine.step_plan import StepPlan
from lucebox.model.feature_ring import FeatureRing, RingRows
from tests.engine.test_cuda_graphs import (
    BLOCK,
    prefilled,
    rel_err,
    step_tokens,
    tiny_model,
)
from tests.spec_fixtures import write_dflash_drafter

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


def test_no_prefill_bucket_is_longer_than_a_block_table_holds():
    """A bucket's padding sequence reads keys over its whole length through its block table: past the
    table's width they would be whatever lies beyond it (an illegal address on a GPU)."""
    settings = replace(SETTINGS, max_model_len=40)
    graphs = CudaGraphRunner(tiny_model(), BLOCK, 0, settings)
    assert graphs.width * BLOCK < 64 and graphs.prefill_lens == [16, 32]


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


@pytest.mark.parametrize("argmax", [False, True])
def test_a_chunk_short_of_the_prompts_end_takes_a_bucket_and_brings_nothing_back(argmax):
    runner, tables, lens = prefilled(tiny_model(), SETTINGS, 1, room=80)
    tokens = step_tokens([60])
    chunk = runner.run(StepPlan.forward([tokens[0][:30]], lens, tables, logits_rows=[], argmax=argmax))
    assert runner.graphs.replays[(1, 32)] == 1
    assert chunk.tokens == [] if argmax else chunk.logits.shape == (0, 96)
    got = runner.run(StepPlan.forward([tokens[0][30:]], [lens[0] + 30], tables)).logits  # the rest reads its K/V
    want = runner.run_eager(StepPlan.forward(tokens, lens, tables)).logits
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("choice", [{"logits_rows": [3]}, {"all_logits": True}, {"capture_layers": (0,)}])
def test_prefills_wanting_other_rows_or_taps_without_a_ring_run_eagerly(choice):
    runner, tables, lens = prefilled(tiny_model(), SETTINGS, 1, room=80)
    plan = StepPlan.forward(step_tokens([30]), lens, tables, **choice)
    assert runner.graphs.run(plan) is None


def test_a_prefill_bucket_writes_a_drafters_taps_into_its_ring_rows():
    runner, tables, lens = prefilled(tiny_model(), SETTINGS, 1, room=80)
    ring = FeatureRing(128, 2 * 64, torch.float32, "cpu")
    runner.set_feature_ring(ring)
    args = (step_tokens([30]), lens, tables)
    want = runner.run_eager(StepPlan.forward(*args, capture_layers=(0, 1)))
    got = runner.run(StepPlan.forward(*args, capture_layers=(0, 1), feature_rows=ring.reserve(30)))
    assert runner.graphs.replays[(1, 32)] == 1 and got.features == RingRows(0, 30)
    assert rel_err(got.logits, want.logits) <= 1e-5
    assert rel_err(ring.rows[:30], want.features) <= 1e-5 and not ring.rows[30:ring.trash].any()  # padding: the trash row
    ring.rows.zero_()
    runner.set_feature_ring(None)  # a drafter on a device of its own: its taps come back from an eager step
    assert runner.graphs.run(StepPlan.forward(*args, capture_layers=(0, 1))) is None


def test_greedy_dflash_speculation_with_prefill_graphs_equals_plain_decoding(hf_models, tmp_path, monkeypatch):
    """The prompts' taps reach the drafter through the ring from prefill buckets: drafts, and so the
    verified output, are those of eager prefills (greedy: plain decoding's tokens)."""
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "dflash")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate((40, 100))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(target), device="cpu", dtype="float32", block_size=BLOCK, kv_cache_memory=16 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=BLOCK, cuda_graphs=True, max_num_seqs=1,
              kv_cache_memory=16 << 20, speculative_config={"method": "dflash", "model": str(drafter),
                                                            "adaptive": False})
    engine = llm.engine
    settings = replace(engine._graph_settings(), capture=False)  # the static batches, run eagerly
    runner, prop = engine.runner, engine.speculator.proposer
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block, settings)
    prop.allocate(runner.num_blocks, BLOCK, engine.scheduler.blocks, settings)
    runner.set_feature_ring(prop.feature_ring)
    observed = []
    observe = prop.observe
    monkeypatch.setattr(prop, "observe", lambda seq, start, f: observed.append((start, type(f).__name__))
                        or observe(seq, start, f))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert runner.graphs.replays[(1, 64)] == 1 and runner.graphs.replays[(1, 128)] == 1
    assert (0, "RingRows") in observed and (0, "Tensor") not in observed  # every prompt's taps by ring rows


def test_greedy_generation_with_prefill_graphs_equals_eager(hf_models):
    """Prompts that take a prefill bucket (one past 512 tokens), a prompt too short for one, and a
    repeated prompt whose remainder after the prefix-cache hit takes a bucket."""
    prompts = [[(5 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate((40, 100, 7, 700, 100))]
    prompts[4] = prompts[1][:64] + prompts[4][:36]  # 64 cached tokens, 36 new
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs, replays = {}, None
    for graphs in (False, True):
        llm = LLM(str(hf_models["qwen3"]), device="cpu", max_model_len=1024, block_size=16,
                  cuda_graphs=True, prefill_graphs=graphs, speculative_config={})
        settings = llm.engine._graph_settings()
        assert settings.prefill_lens[-1:] == ((1024,) if graphs else ())  # none longer than max_model_len
        llm.engine.runner.attach_graphs(replace(settings, capture=False))
        # one at a time: a prefill bucket holds one sequence
        outputs[graphs] = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
        replays = llm.engine.runner.graphs.replays
    assert outputs[True] == outputs[False]
    assert replays[(1, 64)] >= 1 and replays[(1, 128)] >= 1 and replays[(1, 768)] == 1  # 40 and 36 new; 100; 700


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_prefill_graphs_feed_a_dflash_drafter_what_eager_prefills_do(hf_models, tmp_path):
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "dflash")
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 300 + 3 for j in range(n)]} for i, n in enumerate((40, 300))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target), device="cuda", dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20,
                speculative_config={})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20,
              max_num_seqs=1, speculative_config={"method": "dflash", "model": str(drafter), "adaptive": False})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = llm.engine.runner.graphs
    assert got == want
    assert graphs.replays[(1, 64)] >= 1 and graphs.replays[(1, 512)] >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("family", ["moe", "gemma4", "laguna"])
def test_captured_prefill_graphs_of_experts_and_windows_generate_what_eager_prefills_do(family, tmp_path,
                                                                                      tokenizer_dir):
    """Routed experts (Triton grouped kernels at hundreds of rows) and sliding-window groups in prefill buckets."""
    from tests.conftest import build_hf_model
    from tests.engine.test_placement import MOE
    from tests.model.test_gemma4 import DENSE
    from tests.model.test_laguna import build_laguna
    path = (build_laguna(tmp_path, tokenizer_dir) if family == "laguna"
            else build_hf_model("qwen3", tmp_path, tokenizer_dir, **(MOE if family == "moe" else DENSE)))
    prompts = [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate((40, 300))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for graphs in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=1024, prefill_graphs=graphs,
                  speculative_config={}, kv_cache_memory=64 << 20)
        outputs[graphs] = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
        if graphs:
            assert all(llm.engine.runner.graphs.replays[(1, q)] >= 1 for q in (64, 512))
        del llm
    assert outputs[True] == outputs[False]
