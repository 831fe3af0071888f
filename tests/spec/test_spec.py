"""Speculative decoding is lossless: greedy output is token-identical to plain decoding with every
proposer, and sampled output has exactly the target's distribution."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from collections import Counter

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.cuda_graphs import CudaGraphRunner
from lucebox.errors import CheckpointError, RequestError

from tests.conftest import build_hf_model
from tests.spec_fixtures import peaked_model, small_vocab_tokenizer, write_dflash_drafter

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(hf_models):
    return hf_models["qwen3"]


@pytest.fixture(scope="module")
def configs(target, tokenizer_dir, tmp_path_factory):
    small_draft = build_hf_model("qwen3", tmp_path_factory.mktemp("draft"), tokenizer_dir, seed=5,
                                 num_hidden_layers=1)
    drafter = write_dflash_drafter(target, tmp_path_factory.mktemp("dflash"))
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "model": str(small_draft), "num_speculative_tokens": 3},
        "self_draft": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 5},
        "dflash": {"method": "dflash", "model": str(drafter)},
        "dflash+ngram": {"method": "dflash", "model": str(drafter), "ngram_first": True, "prompt_lookup_min": 2},
    }


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(380) for _ in range(rng.randint(3, 30))] * 2} for _ in range(n)]


@pytest.fixture(scope="module")
def plain(target):
    llm = LLM(str(target), block_size=4)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def spec_llm(target, config, **kwargs):
    return LLM(str(target), block_size=4, speculative_config=dict(config, adaptive=False), **kwargs)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_draft", "dflash", "dflash+ngram"])
def test_greedy_batched_output_equals_plain_decoding(method, target, configs, plain):
    llm = spec_llm(target, configs[method])
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # speculation actually happened
    if method == "dflash+ngram":  # both drafted: the repeated prompts give lookups, the rest not
        assert all(n > 0 for n in llm.engine.speculator.steps_by_source.values())
    blocks = llm.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("method", ["ngram", "self_draft", "dflash", "dflash+ngram"])
def test_greedy_single_sequence_with_chunked_prefill_and_prefix_hits(method, target, configs, plain):
    llm = spec_llm(target, configs[method], max_num_batched_tokens=5)
    for _ in range(2):  # the second pass is served from the prefix cache
        outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts()]
        assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("history", [{"repetition_penalty": 1.3}, {"min_tokens": 20}])
def test_dflash_drafts_that_read_their_own_history_stay_lossless(history, target, configs):
    """Penalties and an unmet min_tokens make each draft slot depend on the drafts before it: the
    drafter then processes slot by slot, and greedy output still equals plain decoding."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **history)
    plain = LLM(str(target), block_size=4).generate(prompts(), params, use_tqdm=False)
    outs = spec_llm(target, configs["dflash"]).generate(prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_self_draft_accepts_everything(target, configs):
    out = spec_llm(target, configs["self_draft"]).generate(prompts(1), GREEDY, use_tqdm=False)[0]
    m = out.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    assert m.mean_accepted_length > 3 and m.accepted_per_position[0] == m.num_drafts


def test_stop_token_and_stop_string_inside_an_accepted_block(target, configs, plain):
    llm = spec_llm(target, configs["self_draft"])
    reference = plain[0]
    stop_id = reference[7]
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[:reference.index(stop_id) + 1] and out.finish_reason == "stop"
    text = llm.tokenizer.decode(reference)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)] and out.stop_reason == stop


@pytest.mark.parametrize("method", ["self_draft", "ngram"])
def test_text_and_finish_reasons_equal_plain_decoding(method, target, configs, plain):
    """Accepted blocks are appended as runs (one detokenizer call): the text, the token ids and why
    each sequence ended must be what plain decoding gives, stop tokens and length limits inside a
    block included."""
    stop_ids = [plain[1][9], plain[3][4]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop_token_ids=stop_ids)
              for n in (24, 11, 5, 17, 24, 13)]
    want = LLM(str(target), block_size=4).generate(prompts(), params, use_tqdm=False)
    got = spec_llm(target, configs[method]).generate(prompts(), params, use_tqdm=False)
    fields = lambda o: (o.text, o.token_ids, o.finish_reason, o.stop_reason)  # noqa: E731
    assert [fields(o.outputs[0]) for o in got] == [fields(o.outputs[0]) for o in want]
    assert {o.outputs[0].finish_reason for o in want} == {"stop", "length"}
    assert sum(o.metrics.num_accepted_tokens for o in got) > len(prompts())  # blocks were accepted


def test_max_tokens_is_exact_with_speculation(target, configs, plain):
    llm = spec_llm(target, configs["self_draft"])
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain[0][:7] and out.finish_reason == "length"


def test_logprobs_of_a_speculative_batch_match_plain_decoding(target, configs):
    """Sequences with and without logprobs verify in one batch; each committed token gets the
    target's logprobs at its own position."""
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=n) for n in (2, None, 0, 3)]
    reference = LLM(str(target), block_size=4).generate(prompts(4), params, use_tqdm=False)
    outs = spec_llm(target, configs["self_draft"]).generate(prompts(4), params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    for ref, out, p in zip(reference, outs, params):
        ref, out = ref.outputs[0], out.outputs[0]
        assert out.token_ids == ref.token_ids
        if p.logprobs is None:
            assert out.logprobs is None
            continue
        assert [list(d) for d in out.logprobs] == [list(d) for d in ref.logprobs]
        for got, want in zip(out.logprobs, ref.logprobs):
            assert [v.rank for v in got.values()] == [v.rank for v in want.values()]
            assert [v.logprob for v in got.values()] == pytest.approx([v.logprob for v in want.values()], abs=1e-4)


# ---------------------------------------------------------------------- sampling is lossless
@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    tok = small_vocab_tokenizer(tmp_path_factory.mktemp("tok6"), ["a", "b", "c", "d", "e", "f"])
    target = peaked_model(tmp_path_factory.mktemp("t6"), tok, layers=2, seed=1)
    draft = peaked_model(tmp_path_factory.mktemp("d6"), tok, layers=1, seed=2)
    return target, draft


def exact_pair_distribution(path, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(second, third generated token) under the target at temperature 1, by enumeration."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def next_probs(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].softmax(-1).double()

    vocab = model.config.vocab_size
    result: Counter = Counter()
    p1 = next_probs(prompt)
    for t1 in range(vocab):
        p2 = next_probs(prompt + [t1])
        for t2 in range(vocab):
            p3 = next_probs(prompt + [t1, t2])
            for t3 in range(vocab):
                result[(t2, t3)] += float(p1[t1] * p2[t2] * p3[t3])
    return result


def chi_square_rejects(counts: Counter, probs: dict, n: int) -> tuple[bool, float, float]:
    """Pearson's test at significance 1e-3 (cells with expected count < 5 pooled)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        expected = n * p
        if expected < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df = cells - 1
    z = 3.090  # the 0.999 normal quantile; Wilson-Hilferty turns it into the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical, stat, critical


def sample_pairs(llm, prompt, n: int) -> Counter:
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=n, seed=1234)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return Counter(tuple(o.token_ids[1:3]) for o in out.outputs)


SAMPLES = 4000
PROMPT = [0, 3, 1, 5, 2]


@pytest.mark.parametrize("method", ["draft_model", "ngram", "dflash", "dflash+ngram"])
def test_sampled_tokens_follow_the_target_distribution(method, small_pair, tmp_path):
    target, draft = small_pair
    dflash = {"method": "dflash", "model": str(write_dflash_drafter(target, tmp_path / "d", block_size=3)),
              "num_speculative_tokens": 2}
    config = {
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 2},
        "dflash": dflash,
        # Sampled drafts (q from the drafter) and deterministic lookups (one-hot q) mixed in one batch.
        "dflash+ngram": dict(dflash, ngram_first=True, prompt_lookup_min=1),
    }[method] | {"adaptive": False}
    llm = LLM(str(target), speculative_config=config, max_num_seqs=1024, max_num_batched_tokens=8192)
    counts = sample_pairs(llm, PROMPT, SAMPLES)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), SAMPLES)
    print(f"\n{method}: chi-square {stat:.1f} (reject above {critical:.1f})")
    assert not rejected
    if method == "dflash+ngram":
        assert all(n > 0 for n in llm.engine.speculator.steps_by_source.values())


def test_a_wrong_acceptance_rule_fails_the_same_test(small_pair, monkeypatch):
    """Accepting every draft makes the output follow the draft model: the test must notice."""
    from lucebox.sampling.sampler import exponential_race
    from lucebox.sampling import acceptance

    def always_accept(sampler, logits, seqs, drafts):
        verdicts, row = [], 0
        for seq, draft in zip(seqs, drafts):
            k = len(draft.tokens)
            p = sampler.processed_probs(logits[row:row + k + 1], acceptance.row_states(seq, draft.tokens))
            bonus = int(exponential_race(p[-1:], [seq])[0])
            verdicts.append(acceptance.Verdict(draft.tokens + [bonus], k))
            row += k + 1
        return verdicts

    monkeypatch.setattr("lucebox.engine.output_processor.accept_batch", always_accept)
    target, draft = small_pair
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                                "num_speculative_tokens": 2, "adaptive": False},
              max_num_seqs=1024, max_num_batched_tokens=8192)
    counts = sample_pairs(llm, PROMPT, SAMPLES)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), SAMPLES)
    print(f"\nalways-accept rule: chi-square {stat:.1f} (reject above {critical:.1f})")
    assert rejected


# ---------------------------------------------------------------------- bad input
def test_unknown_method_is_named(target):
    with pytest.raises(RequestError, match="eagle9"):
        LLM(str(target), speculative_config={"method": "eagle9"})


def test_ngram_first_without_a_drafter_model_is_refused(target):
    with pytest.raises(RequestError, match="ngram_first"):
        LLM(str(target), speculative_config={"method": "ngram", "ngram_first": True})


def test_drafter_hidden_size_mismatch_is_named(target, tmp_path):
    drafter = write_dflash_drafter(target, tmp_path / "d", hidden_size=32)
    with pytest.raises(CheckpointError, match="hidden size"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter)})


def test_drafter_taps_outside_the_target_are_named(target, tmp_path):
    drafter = write_dflash_drafter(target, tmp_path / "d", taps=(0, 9))
    with pytest.raises(CheckpointError, match="tap layer"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter)})


def test_mask_token_outside_the_embedding_is_named(target, tmp_path):
    drafter = write_dflash_drafter(target, tmp_path / "d", mask_token_id=10**6)
    with pytest.raises(CheckpointError, match="mask_token_id"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter)})


def test_draft_model_with_another_vocabulary_is_refused(target, tmp_path):
    tok = small_vocab_tokenizer(tmp_path / "tok", ["x", "y"])
    other = peaked_model(tmp_path / "other", tok, layers=1, seed=0)
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(other)})


@pytest.mark.parametrize("every", [4, 20])
@pytest.mark.parametrize("path", ["eager", "static graphs"])
def test_a_dormant_drafter_recomputes_its_taps_before_drafting_again(target, configs, plain, monkeypatch, path,
                                                                     every):
    """Decode steps skip the taps while the drafter is dormant; before it drafts again the missed
    positions' taps come from target passes that write no K/V. Greedy output still equals plain
    decoding (the cache was not touched) and every draft equals the draft of a drafter that never
    slept (its context K/V are the same), with the drafter drafting every `every` steps in both.
    "static graphs": the padded batches CUDA graphs replay, on the CPU: catch-ups of a few positions
    in the verify buckets, of ~20 in a catch-up bucket with its own static inputs."""
    def run(dormant: bool):
        llm = spec_llm(target, configs["dflash"], cuda_graphs=path != "eager")
        engine, spec = llm.engine, llm.engine.speculator
        if path != "eager":
            runner = engine.runner
            runner.graphs = CudaGraphRunner(runner.model, runner.block_size, runner.scratch_block,
                                            replace(engine._graph_settings(), capture=False))
            bucket, graph_catch_ups = runner.graphs.bucket, []
            monkeypatch.setattr(runner.graphs, "bucket", lambda *a, catch_up=False, **kw: (
                shape := bucket(*a, catch_up=catch_up, **kw), catch_up and graph_catch_ups.append(shape))[0])
        steps, drafts, catch_ups = itertools.count(), [], []
        choose, propose, late = spec._choose, spec.proposer.propose, spec.choose
        monkeypatch.setattr(spec, "_choose", lambda *a: choose(*a) if next(steps) % every == 0 else 0)
        monkeypatch.setattr(spec.proposer, "propose",
                            lambda seqs, ks: [drafts.append(d.tokens) or d for d in propose(seqs, ks)])
        monkeypatch.setattr(spec, "choose", lambda running: [
            catch_ups.append(seq.num_computed - start) or (seq, start) for seq, start in late(running)])
        if not dormant:  # every step captures the taps
            monkeypatch.setattr(spec, "taps_needed", lambda: True)
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert not spec.missing
        assert (spec.policy.catch_up > 0) == dormant  # what catching up took, for the probe budget
        if path != "eager" and dormant:  # every catch-up pass took a graph bucket; long ones a catch-up length
            assert None not in graph_catch_ups and len(graph_catch_ups) == len(catch_ups)
            longest = max(q for _, q in graph_catch_ups)
            assert longest > runner.graphs.query_lens[-1] if every == 20 else longest <= runner.graphs.query_lens[-1]
        return [o.outputs[0].token_ids for o in outs], drafts, catch_ups

    awake, awake_drafts, none = run(dormant=False)
    asleep, drafts, catch_ups = run(dormant=True)
    assert asleep == awake == plain
    assert drafts == awake_drafts and len(drafts) > (10 if every == 4 else 3)
    assert not none and len(catch_ups) > (3 if every == 4 else 1) and min(catch_ups) > 0
    assert max(catch_ups) > (2 if every == 4 else 17)
