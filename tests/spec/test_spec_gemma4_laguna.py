"""Speculative decoding on Gemma 4 (dense: sliding windows shorter than the prompts, KV-shared layers,
per-layer inputs, soft-capped logits; and the MoE form) and Laguna (MoE, sliding + full layers).

Greedy output equals plain decoding for DFlash, draft-model and n-gram speculation in a continuous
batch whose verifies accept different lengths, with rejected drafts rolled back across the sliding
groups' block boundaries after blocks behind the window went back to the pool, and with a prefix-cache
hit. Sampled output follows the target's distribution (tests/spec/test_spec.py's chi-square test).

The DFlash drafter's block input and logits follow the published reference (PyPI `dflash` 0.1.0,
z-lab's DFlashDraftModel / dflash_generate): the block is the target's *raw* embedding rows times the
drafter config's `input_embedding_scale` (Gemma's sqrt(hidden) scaling and its per-layer inputs are
the target's forward, not the drafter's), and the logits are the target's LM head times
`output_multiplier`, soft-capped by the *drafter's* `final_logit_softcapping` (not the target's)."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from lucebox import LLM, SamplingParams
from tests.conftest import build_hf_model
from tests.model.test_gemma4 import DENSE, MOE, build
from tests.model.test_laguna import build_laguna
from tests.model.test_qwen3_5 import BLOCK_SIZE, prompts
from tests.spec_fixtures import write_dflash_drafter

K = 3  # drafts per verify: a verify row of 4 positions, one block


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tokenizer_dir) -> dict:
    """Built on first use: family -> checkpoint directory."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            if family == "laguna":
                made[family] = build_laguna(tmp_path_factory.mktemp("laguna"), tokenizer_dir)
            else:
                made[family] = build(tmp_path_factory, tokenizer_dir, family, DENSE if family == "gemma4" else MOE)[0]
        return made[family]
    return get


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

    def recording(seq, num_tokens, accepted=None):
        before = [list(t) for t in seq.window_tables]
        rollback(seq, num_tokens, accepted)
        if accepted is not None:  # after a verify
            released = sum(t.count(pool.released) for t, pool in zip(before, cache.window_pools))
            dropped = any(len(a) > len(b) for a, b in zip(before, seq.window_tables))
            seen.append((released, dropped))
    monkeypatch.setattr(cache, "rollback", recording)
    return seen


def spec_config(method: str, target, tmp_path, tokenizer_dir) -> dict:
    if method == "ngram":
        return {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": K, "adaptive": False}
    if method == "dflash":
        drafter = write_dflash_drafter(target, tmp_path / "dflash", taps=(0, 2), block_size=K + 1)
    else:
        drafter = build_hf_model("qwen3", tmp_path / "draft", tokenizer_dir, seed=5, num_hidden_layers=1)
    return {"method": method, "model": str(drafter), "num_speculative_tokens": K, "adaptive": False}


@pytest.mark.parametrize("family", ["gemma4", "gemma4-moe", "laguna"])
@pytest.mark.parametrize("method", ["dflash", "draft_model", "ngram"])
def test_greedy_speculation_in_a_continuous_batch_equals_plain_decoding(method, family, targets, tmp_path,
                                                                        tokenizer_dir, monkeypatch):
    """Four sequences past the sliding window; verifies accept none, some or all of their drafts, and
    rollbacks of rejected drafts drop window-group blocks after blocks behind the window were
    released. A second round extends each prompt with its output: a prefix-cache hit. Plain decoding
    without prefix caching is the reference for both rounds."""
    target = targets(family)
    plain = LLM(str(target), block_size=BLOCK_SIZE, max_num_seqs=4, enable_prefix_caching=False)
    first = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want_first = [o.outputs[0].token_ids for o in greedy(plain, first)]
    second = [p + w + [7] for p, w in zip(first, want_first)]  # the whole reply: its last window is held
    want_second = [o.outputs[0].token_ids for o in greedy(plain, second)]

    spec = LLM(str(target), block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=32,
               speculative_config=spec_config(method, target, tmp_path, tokenizer_dir))
    speculator, cache = spec.engine.speculator, spec.engine.scheduler.cache
    assert cache.window_pools, "the target mixes sliding-window and full attention"
    want = {tuple(p): w for p, w in zip(first + second, want_first + want_second)}
    corrupted_oracle(monkeypatch, speculator, want, spec.engine.loaded.config.vocab_size)
    rollbacks = record_window_rollbacks(monkeypatch, cache)
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
