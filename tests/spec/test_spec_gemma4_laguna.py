"""Speculative decoding on Gemma 4 (dense: sliding windows shorter than the prompts, KV-shared layers,
per-layer inputs, soft-capped logits; and the MoE form) and Laguna (MoE, sliding + full layers).

Greedy output equals plain decoding for DFlash, draft-model and n-gram speculation in a continuous
batch whose verifies accept different lengths, with rejected drafts rolled back across the sliding
groups' block boundaries after blocks behind the window went back to the pool, and with a prefix-cache
hit. Sampled output follows the target's distribution (tests/spec/test_spec.py's chi-square test).
The drafter against the published reference, and drafter training: tests/spec/test_dflash_gemma4.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucebox import LLM, SamplingParams
from tests.model.test_qwen3_5 import BLOCK_SIZE, prompts
from tests.spec_fixtures import write_dflash_drafter

K = 3  # drafts per verify: a verify row of 4 positions, one block


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Repeated phrases of different lengths, all longer than the sliding windows (5)."""
    a, b, c = prompts(vocab, [5, 3, 7], seed=11)
    return [a * 4, b * 5 + a, c + b * 3 + c, a + c * 2]


def greedy(llm, batch, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def corrupted_oracle(monkeypatch, spec, want: dict, vocab: int):
    """The proposer runs as usual, then its drafts (as many as it proposed) are replaced by the plain
    run's continuation with one token wrong at a place that moves from step to step and sequence to
    sequence: verifies in one batch accept 0..k drafts, whatever random weights would have proposed."""
    propose = spec.proposer.propose

    def oracle(seqs, ks):
        drafts = propose(seqs, ks)
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            n, k = len(seq.output_token_ids), len(draft.tokens)
            tokens = list(want[tuple(seq.prompt_token_ids)][n:n + k])
            wrong = (n + i) % (k + 1)
            if wrong < len(tokens):
                tokens[wrong] = (tokens[wrong] + 1) % vocab
            draft.tokens, draft.probs = tokens, None
        return drafts
    monkeypatch.setattr(spec.proposer, "propose", oracle)


def record_window_rollbacks(monkeypatch, cache) -> list:
    """Per rollback after a verify: (window-group entries already released to the pool, whether
    rejected drafts held a window group's block that the rollback dropped)."""
    seen = []
    rollback = cache.rollback

    def recording(seq, num_tokens, accepted=None, path=None):
        before = [list(t) for t in seq.window_tables]
        rollback(seq, num_tokens, accepted, path)
        if accepted is not None:  # after a verify
            released = sum(t.count(pool.released) for t, pool in zip(before, cache.window_pools))
            dropped = any(len(a) > len(b) for a, b in zip(before, seq.window_tables))
            seen.append((released, dropped))
    monkeypatch.setattr(cache, "rollback", recording)
    return seen


# Draft models of the other family: mixed-window drafts (their own KV, unbounded) beside the target's.
DRAFT_MODELS = {"gemma4": "laguna", "gemma4-moe": "gemma4", "laguna": "gemma4-moe"}


def spec_config(method: str, target, tmp_path, targets=None, family: str = "") -> dict:
    if method == "ngram":
        return {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": K, "adaptive": False}
    if method == "dflash":
        drafter = write_dflash_drafter(target, tmp_path / "dflash", taps=(0, 2), block_size=K + 1)
    else:
        drafter = targets(DRAFT_MODELS[family])
    return {"method": method, "model": str(drafter), "num_speculative_tokens": K, "adaptive": False}


@pytest.mark.parametrize("family", ["gemma4", "gemma4-moe", "laguna"])
@pytest.mark.parametrize("method", ["dflash", "draft_model", "ngram"])
def test_greedy_speculation_in_a_continuous_batch_equals_plain_decoding(method, family, targets, tmp_path,
                                                                        monkeypatch):
    """Four sequences past the sliding window; verifies accept none, some or all of their drafts, and
    rollbacks of rejected drafts drop window-group blocks after blocks behind the window were
    released. A second round extends each prompt with its output: a prefix-cache hit. Plain decoding
    without prefix caching is the reference for both rounds; transformers' hidden states for the
    taps DFlash is handed (every step's: mixed-window targets never recompute them)."""
    target = targets(family)
    check_lossless(target, spec_config(method, target, tmp_path, targets, family), monkeypatch,
                   check_taps=method == "dflash")


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")


@pytest.mark.parametrize("family", ["gemma4", "laguna"])
@pytest.mark.parametrize("graphs", ["static", pytest.param("captured", marks=gpu)])
def test_greedy_speculation_through_graphs_equals_plain_decoding(graphs, family, targets, tmp_path, monkeypatch):
    """The same through the padded graph batches of the target (window groups' tables) and of the
    drafter: on the CPU their static bodies run eagerly, on a GPU as captured CUDA graphs."""
    from tests.spec.test_dflash_graphs import static_graphs
    target = targets(family)
    device = "cuda" if graphs == "captured" else "cpu"

    def static_bodies(llm):  # CPU: the graph runners' padded static batches, run eagerly
        engine, prop = llm.engine, llm.engine.speculator.proposer
        assert engine.runner.graphs is None and prop.graphs is None  # nothing captured on the CPU
        engine.runner.attach_graphs(replace(engine._graph_settings(), capture=False))
        prop.graphs = static_graphs(prop, engine.runner.num_blocks, engine.max_model_len)
    spec = check_lossless(target, spec_config("dflash", target, tmp_path), monkeypatch,
                          static_bodies if graphs == "static" else None, device=device, dtype="float32",
                          cuda_graphs=True, kv_cache_memory=16 << 20)
    replays = spec.engine.runner.graphs.replays
    assert any(q == K + 1 for _, q in replays) and any(q == 1 for _, q in replays)  # verify and decode buckets
    assert spec.engine.speculator.proposer.graphs.replays > 0


def check_lossless(target, config: dict, monkeypatch, setup=None, check_taps: bool = False, **llm_args):
    """Two rounds of four prompts (the second extending the first with its whole output) through a
    speculative LLM equal plain decoding without prefix caching; returns the speculative LLM."""
    plain = LLM(str(target), block_size=BLOCK_SIZE, max_num_seqs=4, enable_prefix_caching=False, **llm_args)
    first = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want_first = [o.outputs[0].token_ids for o in greedy(plain, first)]
    second = [p + w + [7] for p, w in zip(first, want_first)]  # the whole reply: its last window is held
    want_second = [o.outputs[0].token_ids for o in greedy(plain, second)]
    del plain

    spec = LLM(str(target), block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=32,
               speculative_config=config, **llm_args)
    if setup is not None:
        setup(spec)
    speculator, cache = spec.engine.speculator, spec.engine.scheduler.cache
    assert cache.window_pools, "the target mixes sliding-window and full attention"
    want = {tuple(p): w for p, w in zip(first + second, want_first + want_second)}
    corrupted_oracle(monkeypatch, speculator, want, spec.engine.loaded.config.vocab_size)
    rollbacks = record_window_rollbacks(monkeypatch, cache)
    taps = record_taps(monkeypatch, speculator.proposer) if check_taps else None
    outs = greedy(spec, first)
    assert [o.outputs[0].token_ids for o in outs] == want_first
    hits = cache.blocks.hits
    outs += greedy(spec, second)
    assert [o.outputs[0].token_ids for o in outs[4:]] == want_second
    assert cache.blocks.hits > hits  # the second round found its prefixes

    metrics = [o.metrics for o in outs if o.metrics.num_drafts]
    assert sum(m.num_drafts - m.accepted_per_position[0] for m in metrics) > 0  # verifies accepting none
    assert sum(m.accepted_per_position[0] - m.accepted_per_position[-1] for m in metrics) > 0  # some
    assert sum(m.accepted_per_position[-1] for m in metrics) > 0  # all
    assert any(released and dropped for released, dropped in rollbacks), (len(rollbacks), rollbacks)
    if check_taps:
        assert speculator.every_step and speculator.policy.catch_up == 0
        assert_taps_are_the_targets(taps, outs, target)
    return spec


def record_taps(monkeypatch, proposer) -> dict:
    """Every (start, features) the drafter is handed, per sequence (by its prompt)."""
    seen: dict[tuple, list] = {}
    observe = proposer.observe

    def recording(seq, start, features):
        seen.setdefault(tuple(seq.prompt_token_ids), []).append((start, features.clone()))
        observe(seq, start, features)
    monkeypatch.setattr(proposer, "observe", recording)
    return seen


def assert_taps_are_the_targets(seen: dict, outputs, target):
    """Each chunk of taps equals transformers' hidden states after the tapped layers (0, 2) at its
    positions; chunks never overlap and reach the last computed position (a prefix-cache hit's
    cached positions come from the sequence that computed them)."""
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for out in outputs:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        chunks = seen[tuple(out.prompt_token_ids)]
        ends = [start + f.shape[0] for start, f in chunks]
        assert all(end <= start for end, (start, _) in zip(ends, chunks[1:])) and ends[-1] == len(tokens) - 1
        with torch.no_grad():
            hidden = reference(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        want = torch.cat([hidden[1][0], hidden[3][0]], dim=-1)
        for start, features in chunks:
            assert (features - want[start:start + features.shape[0]]).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------------------------
# Sampled speculation follows the target's distribution

SMALL_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6}}
# Windows of 3: the prompt (5 tokens) and the sampled tokens run past them.
SMALL = {
    "gemma4": ("gemma4_text", 4, {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 3, "global_head_dim": 16, "num_kv_shared_layers": 1, "hidden_size_per_layer_input": 4,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": SMALL_ROPE}),
    "laguna": ("laguna", 3, {
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"], "sliding_window": 3,
        "num_attention_heads_per_layer": [4, 2, 4], "mlp_layer_types": ["dense", "sparse", "sparse"],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16, "max_position_embeddings": 64}),
}


@pytest.mark.parametrize("family, method", [("gemma4", "dflash"), ("laguna", "draft_model"), ("laguna", "dflash")])
def test_sampled_tokens_follow_the_target_distribution(family, method, tmp_path):
    """tests/spec/test_spec.py's chi-square test of speculative sampling (a DFlash drafter's
    deterministic drafts, or a draft model's sampled ones with their residual resampling) on a
    small-vocabulary Gemma 4 and Laguna whose windows the samples run past."""
    from tests.spec.test_spec import (
        PROMPT,
        chi_square_rejects,
        exact_pair_distribution,
        sample_pairs,
    )
    from tests.spec_fixtures import peaked_model, small_vocab_tokenizer
    tok = small_vocab_tokenizer(tmp_path / "tok", ["a", "b", "c", "d", "e", "f"])
    model_type, layers, overrides = SMALL[family]
    target = peaked_model(tmp_path / "t", tok, layers=layers, seed=1, model_type=model_type, **overrides)
    if method == "dflash":
        drafter = write_dflash_drafter(target, tmp_path / "d", taps=(0, 2), block_size=3,
                                       **({"final_logit_softcapping": 30.0} if family == "gemma4" else {}))
    else:
        drafter = peaked_model(tmp_path / "d", tok, layers=1, seed=2)
    config = {"method": method, "num_speculative_tokens": 2, "adaptive": False, "model": str(drafter)}
    llm = LLM(str(target), speculative_config=config, max_num_seqs=1024, max_num_batched_tokens=8192)
    samples = 1000
    counts = sample_pairs(llm, PROMPT, samples)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), samples)
    assert not rejected, (stat, critical)
    assert llm.engine.step_counts["verify"] > 0
