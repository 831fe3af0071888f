"""Overlapped decoding (EngineArgs.async_decode): a decode step launched ahead of the host's turn
generates what step-by-step decoding does, on the CPU through padded static batches and on a GPU
through captured graphs.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.engine.test_cuda_graphs import (  # noqa: I001  (sets TRITON_INTERPRET=1 first)
    BLOCK, GREEDY, PROMPT_LENS, gpu)


from lucebox import LLM, SamplingParams
from lucebox.engine.cuda_graphs import CudaGraphRunner
from lucebox.engine.overlap import AheadStep


def static_graph_llm(target, **kwargs) -> LLM:
    """An LLM on the CPU whose decode steps go through the padded static batches a graph replays."""
    llm = LLM(str(target), device="cpu", block_size=BLOCK, cuda_graphs=True, **kwargs)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                    replace(llm.engine._graph_settings(), capture=False))
    return llm


def count_ahead(engine, monkeypatch) -> dict:
    """Counts of decode steps launched ahead, and of those the next step used."""
    counts = {"launched": 0, "used": 0}
    launch = engine.overlap.launch_ahead
    monkeypatch.setattr(engine.overlap, "launch_ahead", lambda *a: (
        ahead := launch(*a), counts.__setitem__("launched", counts["launched"] + (ahead is not None)))[0])
    covers = AheadStep.covers
    monkeypatch.setattr(AheadStep, "covers", lambda self, *a: (
        hit := covers(self, *a), counts.__setitem__("used", counts["used"] + hit))[0])
    return counts


def test_overlapped_decoding_generates_what_step_by_step_decoding_does(hf_models, monkeypatch):
    """async_decode: each decode step is launched before the previous one's tokens are read, its
    input ids fed on the device. Greedy output equals step-by-step decoding for sequences that end
    at different lengths, on a stop string and on EOS; a sequence ending leaves the step launched
    for it unused, and the batch goes on."""
    target = hf_models["qwen3"]
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:4])]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 14, 20)]
    want = [o.outputs[0].token_ids for o in
            static_graph_llm(target, async_decode=False).generate(prompts, params, use_tqdm=False)]
    llm = static_graph_llm(target, async_decode=True)
    counts = count_ahead(llm.engine, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert counts["used"] > 10 and counts["launched"] > counts["used"]  # endings left launched steps unused
    assert llm.engine.step_counts["overlapped"] == counts["used"] and llm.engine.step_counts["unused ahead"] > 0
    stop = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)  # EOS allowed
    plain = static_graph_llm(target, async_decode=False).generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert stop[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_overlapped_decoding_lets_new_requests_join(hf_models, monkeypatch):
    """A request arriving mid-stream: the step launched ahead for the old batch goes unused (nothing
    is launched ahead while one waits), the prompt is prefilled and both decode on, as step by step."""
    target = hf_models["qwen3"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(async_decode: bool):
        engine = static_graph_llm(target, async_decode=async_decode).engine
        counts = count_ahead(engine, monkeypatch) if async_decode else None
        engine.add_request("a", {"prompt_token_ids": list(range(3, 14))}, params)
        outs, step = {}, 0
        while engine.has_unfinished():
            if step == 5:
                engine.add_request("b", {"prompt_token_ids": list(range(40, 47))}, params)
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            step += 1
        return outs, counts

    want, _ = run(False)
    got, counts = run(True)
    assert got == want and counts["used"] > 5


def test_overlapped_sampling_in_the_graph_keeps_its_lengths(hf_models, monkeypatch):
    target = hf_models["qwen3"]
    llm = static_graph_llm(target, async_decode=True)
    counts = count_ahead(llm.engine, monkeypatch)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 15))}] * 3,
                        SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 3 and counts["used"] > 5
    vocab = llm.engine.model.config.vocab_size
    assert all(0 <= t < vocab for o in outs for t in o.outputs[0].token_ids)


def test_a_dormant_drafters_plain_steps_are_launched_ahead(hf_models, tmp_path, monkeypatch):
    """Overlapped decoding with a speculator: while its policy is in a run of plain steps (the
    drafter dormant: plain steps capture no taps), each plain step is launched before the previous
    one's tokens are read, and the speculator is not even consulted for the run's steps; never the
    step before a draft, which needs the new tokens. Greedy output equals plain decoding and the
    drafts equal those of an engine that waits (and consults the speculator every step)."""
    from tests.spec_fixtures import write_dflash_drafter
    target, every = hf_models["qwen3"], 6
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:4])]
    plain = [o.outputs[0].token_ids for o in
             static_graph_llm(target, async_decode=False).generate(prompts, GREEDY, use_tqdm=False)]
    spec = {"method": "dflash", "model": str(write_dflash_drafter(target, tmp_path / "dflash")), "adaptive": False}

    def run(async_decode: bool):
        llm = static_graph_llm(target, speculative_config=spec, async_decode=async_decode)
        engine, speculator = llm.engine, llm.engine.speculator
        drafts, pending, proposes = [], [], []
        choose, propose, advance_plain = speculator._choose, speculator.proposer.propose, speculator.policy.advance_plain
        made = [0]  # choices made so far, evaluated or counted in a promised run

        def choose_every(*args):  # a draft every `every` decode steps, plain decoding between
            made[0] += 1
            return choose(*args) if (made[0] - 1) % every == 0 else 0

        def advance(steps=1):  # a promised run: choices of plain decoding made without evaluating
            made[0] += steps
            advance_plain(steps)

        def record(seqs, ks):
            pending.append(engine.overlap.ahead is not None)  # a step launched ahead of this drafted one
            return [drafts.append(d.tokens) or d for d in propose(seqs, ks)]
        monkeypatch.setattr(speculator, "_choose", choose_every)
        monkeypatch.setattr(speculator.policy, "plain_run", lambda: (every - made[0] % every) % every)
        monkeypatch.setattr(speculator.policy, "advance_plain", advance)
        monkeypatch.setattr(speculator.proposer, "propose", record)
        monkeypatch.setattr(speculator, "choose", lambda running, f=speculator.choose: proposes.append(1) or f(running))
        counts = count_ahead(engine, monkeypatch)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], drafts, pending, counts, len(proposes)

    waited, waited_drafts, _, _, waited_proposes = run(False)
    got, drafts, pending, counts, proposes = run(True)
    assert got == waited == plain
    assert drafts == waited_drafts and len(drafts) > 4 and not any(pending)
    assert counts["used"] > 10
    assert proposes == waited_proposes - counts["used"]  # no overlapped step consulted the speculator


def test_steps_after_an_empty_lookup_are_launched_ahead(hf_models, monkeypatch):
    """An n-gram speculator whose lookup finds nothing guesses the next step plain and launches it
    ahead, though its policy wants to draft (here: always); the next step asks again, and a match
    then drafts, the launched step going unused. Greedy output equals plain decoding."""
    import itertools
    target = hf_models["qwen3"]
    prompt = {"prompt_token_ids": [(7 * j) % 290 + 3 for j in range(40)]}
    want = static_graph_llm(target, async_decode=False).generate(prompt, GREEDY, use_tqdm=False)[0]
    llm = static_graph_llm(target, speculative_config={"method": "ngram", "adaptive": False})
    proposer, calls = llm.engine.speculator.proposer, itertools.count()
    lookup = proposer.lookup
    monkeypatch.setattr(proposer, "lookup", lambda seq, k: lookup(seq, k) if next(calls) % 4 == 3 else [])
    counts = count_ahead(llm.engine, monkeypatch)
    got = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.metrics.num_drafts > 0 and counts["used"] > 5 and counts["launched"] > counts["used"]


@gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_decoding_through_real_graphs(hf_models, monkeypatch, temperature):
    """async_decode with captured graphs, pinned copies and events: greedy output equals step-by-step
    decoding (sequences ending at different lengths); sampled output keeps its lengths; most steps
    were launched ahead and used."""
    target = hf_models["qwen3"]
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:4])]
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in (3, 9, 14, 20)]
    outputs = []
    for overlap in (False, True):
        llm = LLM(str(target), device="cuda", dtype="float32", block_size=BLOCK, kv_cache_memory=64 << 20,
                  async_decode=overlap)
        counts = count_ahead(llm.engine, monkeypatch) if overlap else None
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert [len(t) for t in outputs[1]] == [3, 9, 14, 20] and counts["used"] > 10
    if temperature == 0:
        assert outputs[1] == outputs[0]
