"""Sampling inside a decode graph: the graph's draws follow the sampler's distribution, only rows of
simple parameters are sampled there, and the engine's plain steps and n-gram drafts use it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.engine.test_cuda_graphs import (  # noqa: I001  (sets TRITON_INTERPRET=1 first)
    BLOCK, gpu, prefilled, step_tokens, tiny_model)


from lucebox import LLM, SamplingParams
from lucebox.engine.cuda_graphs import CudaGraphRunner
from lucebox.engine.graph_settings import GraphSettings
from lucebox.engine.step_plan import StepPlan
from lucebox.sampling.graph_rows import graph_row, graph_samplable


# ----------------------------------------------------------------------------- sampling inside the graph

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_decode_graphs_that_sample_draw_from_the_samplers_distribution(device):
    """sampling.acceptance.accept_in_graph through the padded static decode batch: each row's tokens follow
    the distribution `Sampler.processed_probs` gives for its parameters (Pearson, p = 1e-3), and a
    greedy row in the same batch takes the argmax."""
    from collections import Counter

    from lucebox.sampling.sampler import Sampler, SamplingState

    from tests.spec.test_spec import chi_square_rejects
    settings = GraphSettings(64, max_batch=4, query_lens=(1,), capture=device == "cuda", sample=True)
    runner, tables, lens = prefilled(tiny_model(device), settings, 3)
    # Low temperatures: this model's logits span only 1-2.4, so at T = 1 every row is nearly uniform.
    params = [SamplingParams(temperature=0.3, top_k=12, top_p=0.9, min_p=0.02), SamplingParams(temperature=0.2),
              SamplingParams(temperature=0)]
    args = (step_tokens([1, 1, 1]), lens, tables)
    vocab = runner.model.config.vocab_size
    want = Sampler().processed_probs(runner.run_eager(StepPlan.forward(*args)).logits,
                                     [SamplingState(p, []) for p in params])
    n, counts = 3000, [Counter() for _ in params]
    for _ in range(n):
        result = runner.run(StepPlan.forward(*args, sample=[graph_row(p, vocab) for p in params]))
        assert result.logits is None and result.tokens is None
        for row, (accepted, token) in enumerate(result.verdicts):
            assert accepted == 0  # a decode has no drafts
            counts[row][token] += 1
    assert sum(runner.graphs.replays.values()) == n
    assert all((graph is not None) == (device == "cuda") for graph, _ in runner.graphs.graphs.values())
    for row in range(2):
        probs = {t: p for t, p in enumerate(want[row].tolist()) if p > 0}
        assert set(counts[row]) <= set(probs)  # filtered tokens never drawn
        rejects, stat, critical = chi_square_rejects(counts[row], probs, n)
        assert not rejects, (row, stat, critical)
    assert set(counts[2]) == {int(want[2].argmax())}
    assert len(counts[0]) < len(counts[1])  # the filters of row 0 bite


def test_graph_sampling_takes_only_rows_of_simple_parameters():
    assert graph_samplable(SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.1), 0)
    assert graph_samplable(SamplingParams(temperature=0), 0)
    for special in (dict(seed=3), dict(logprobs=1), dict(repetition_penalty=1.2), dict(logit_bias={1: 1.0}),
                    dict(min_tokens=2)):
        assert not graph_samplable(SamplingParams(temperature=0.8, **special), 0)
    assert graph_row(SamplingParams(temperature=0.8, top_k=0, top_p=1.0), 96) == (0.8, 96, 2.0, 0.0, False)


def test_the_engine_samples_plain_decode_steps_in_the_graph(hf_models):
    """Unseeded sampled decodes take the sampling graphs; a seeded request keeps its own generator
    (reproducible whatever the batch), so its steps sample on the host."""
    llm = LLM(str(hf_models["qwen3"]), device="cpu", block_size=BLOCK, cuda_graphs=True)
    runner = llm.engine.runner
    settings = replace(llm.engine._graph_settings(), capture=False)
    assert settings.sample
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block, settings)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    out = llm.generate(prompt, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    sampled = [key for key in runner.graphs.graphs if key[3]]
    assert sampled
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=7)
    runs = [llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_the_engine_accepts_n_gram_drafts_in_the_graph(hf_models):
    """With n-gram speculation, verify steps of sampled and greedy rows take the
    sampling graphs of their draft width (accept_in_graph), and the greedy request's output is
    token-identical to plain greedy decoding while its drafts are accepted."""
    path = str(hf_models["qwen3"])
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9] * 4}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = LLM(path, device="cpu", block_size=BLOCK).generate(prompt, greedy, use_tqdm=False)[0]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False}
    llm = LLM(path, device="cpu", block_size=BLOCK, cuda_graphs=True, speculative_config=spec)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                    replace(llm.engine._graph_settings(), capture=False))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt, prompt], [greedy, sampled], use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference.outputs[0].token_ids
    assert out[0].metrics.num_accepted_tokens > 0
    assert len(out[1].outputs[0].token_ids) == 12
    assert any(q > 1 and in_graph for _, q, _, in_graph, *_ in runner.graphs.graphs)
