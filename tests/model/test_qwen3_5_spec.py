"""Speculative decoding on a Qwen 3.5 hybrid: a verify row computes each DeltaNet layer's outputs for
the pending token and its drafts without writing the state, stashing their inputs; the commit after
the verdict advances the slot over the accepted ones, so greedy output equals plain decoding."""
from __future__ import annotations

import itertools

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.model.feature_ring import RingRows
from lucebox.model.loader import load_model
from tests.conftest import build_hf_model
from tests.spec_fixtures import write_dflash_drafter
from tests.model.test_qwen3_5 import (
    BLOCK_SIZE,
    HYBRID,
    KV,
    prompts,
    reference_logits,
    runner_for,
)

NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_5_spec"), tokenizer_dir, **HYBRID)


@pytest.fixture(scope="module")
def reference(hybrid_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hybrid_path, dtype=torch.float32).eval()


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Repeated phrases (the n-gram lookup proposes drafts from them) of different lengths."""
    a, b, c = prompts(vocab, [5, 3, 7], seed=11)
    return [a * 4, b * 5 + a, c + b * 3 + c, a + c * 2]


def test_verify_commit_leaves_the_state_after_each_accepted_length(hybrid_path, reference):
    """A 4-token verify row leaves the state alone; committing a accepted drafts and decoding on
    gives transformers' logits of the prompt plus the first a + 1 tokens."""
    loaded = load_model(str(hybrid_path), dtype="float32", device="cpu")  # its states are built on the CPU
    prompt, row = prompts(loaded.config.vocab_size, [11, 4], seed=7)
    runner, blocks = runner_for(loaded)
    layers = [loaded.model.layers[i].linear_attn for i in runner.recurrent_layers]
    states = [spec.build(4, 4, "cpu") for spec in (layer.cache_spec() for layer in layers)]
    runner.install_recurrent(states, None)
    table = []
    blocks.allocate(table, len(prompt) + len(row) + 1)
    for accepted in range(len(row)):
        runner.reset_states([3])
        runner.forward([prompt], [0], [table], state_slots=[3])
        verify = runner.run_eager(_verify_plan(row, len(prompt), table, slot=3))
        kept = prompt + row[:accepted + 1]
        assert (verify.logits - reference_logits(reference, prompt + row)[len(prompt):]).abs().max() <= 1e-4
        for state in states:
            state.commit(torch.tensor([3]), torch.tensor([accepted]))
        nxt = row[0] if accepted + 1 == len(row) else 5  # any next token
        got = runner.forward([[nxt]], [len(kept)], [table], state_slots=[3])
        want = reference_logits(reference, kept + [nxt])[-1]
        assert (got[0] - want).abs().max().item() <= 1e-4, accepted


def _verify_plan(tokens, start, table, slot):
    from lucebox.engine.step_plan import PlanRow, RowKind, StepPlan
    return StepPlan([PlanRow(list(tokens), start, table, RowKind.VERIFY)], all_logits=True, state_slots=[slot])


def greedy(llm, batch, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def test_ngram_speculation_is_token_identical_to_plain_decoding(hybrid_path):
    """One continuous batch of several sequences whose drafts are partly accepted, partly rejected."""
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4)
    batch = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 24)]
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, speculative_config=NGRAM)
    outs = greedy(spec, batch, 24)
    assert [o.outputs[0].token_ids for o in outs] == want
    metrics = [o.metrics for o in outs]
    # Verifies that accepted none of their drafts, some but not all (a commit mid-row), and all.
    rejected_all = sum(m.num_drafts - m.accepted_per_position[0] for m in metrics)
    partial = sum(m.accepted_per_position[0] - m.accepted_per_position[-1] for m in metrics)
    accepted_all = sum(m.accepted_per_position[-1] for m in metrics)
    assert rejected_all > 0 and partial > 0 and accepted_all > 0
    assert spec.engine.step_counts["verify"] > 0
    assert len(spec.engine.scheduler.cache.free_slots) == 4  # every slot back


DFLASH = {"method": "dflash", "num_speculative_tokens": 3, "adaptive": False}
TAPS = (0, 2)  # a DeltaNet layer's output and the one before the full-attention layer


@pytest.fixture(scope="module")
def drafter(hybrid_path, tmp_path_factory):
    return write_dflash_drafter(hybrid_path, tmp_path_factory.mktemp("hybrid_dflash"), taps=TAPS, block_size=4)


def record_taps(monkeypatch, proposer) -> dict:
    """Every (start, features) the drafter is handed, per sequence (by its prompt)."""
    seen: dict[tuple, list] = {}
    observe = proposer.observe

    def recording(seq, start, features):
        if isinstance(features, RingRows):  # a graph step's taps, in the ring until the next steps overwrite them
            features = proposer.feature_ring.gather([features])
        seen.setdefault(tuple(seq.prompt_token_ids), []).append((start, features.clone()))
        observe(seq, start, features)
    monkeypatch.setattr(proposer, "observe", recording)
    return seen


def assert_taps_are_the_targets(seen: dict, outputs, reference):
    """The drafter saw each committed position's taps once, in order, equal to transformers' hidden
    states after the tapped layers: from prefill chunks, plain decodes and verifies alike."""
    for out in outputs:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        chunks = seen[tuple(out.prompt_token_ids)]
        starts = [start for start, _ in chunks]
        assert starts == sorted(starts) and starts[0] == 0
        features = torch.cat([f.cpu() for _, f in chunks])  # graph steps leave their taps on the device
        assert features.shape[0] == len(tokens) - 1  # the last token is never computed
        assert all(b == a + f.shape[0] for (a, f), b in zip(chunks, starts[1:]))  # no gap, no repeat
        with torch.no_grad():
            hidden = reference(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        want = torch.cat([hidden[layer + 1][0] for layer in TAPS], dim=-1)
        assert (features - want).abs().max().item() <= 1e-4


def corrupted_oracle(monkeypatch, spec, want: dict, every: int):
    """Run the drafter as usual, then replace its drafts by the plain run's continuation with one
    token wrong at a place that moves from step to step and sequence to sequence (accepting 0..k),
    drafting only every `every` steps: the drafter sleeps between (adaptive speculation's plain
    steps), and its taps must still be captured."""
    steps, propose, choose = itertools.count(), spec.proposer.propose, spec._choose
    monkeypatch.setattr(spec, "_choose", lambda *a: choose(*a) if next(steps) % every == 0 else 0)

    def oracle(seqs, ks):
        drafts = propose(seqs, ks)
        for i, (seq, k, draft) in enumerate(zip(seqs, ks, drafts)):
            n = len(seq.output_token_ids)
            tokens = list(want[tuple(seq.prompt_token_ids)][n:n + k])
            wrong = (n + i) % (k + 1)
            if wrong < len(tokens):
                tokens[wrong] = (tokens[wrong] + 1) % spec.proposer.target.config.vocab_size
            draft.tokens = tokens
        return drafts
    monkeypatch.setattr(spec.proposer, "propose", oracle)


@pytest.mark.parametrize("drafts", ["random drafter", "adaptive policy", "accepting 0..k, dormant between"])
def test_dflash_speculation_is_token_identical_to_plain_decoding(drafts, hybrid_path, reference, drafter,
                                                                 monkeypatch):
    """A continuous batch on the hybrid target with a DFlash drafter: output equals plain decoding,
    every position's taps come from the step that computed it (no catch-up recomputes anything),
    and verifies accept different lengths in one batch."""
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, max_num_batched_tokens=24)
    batch = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 16)]
    config = DFLASH | {"model": str(drafter), "adaptive": drafts == "adaptive policy"}
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, max_num_batched_tokens=24,
               speculative_config=config)
    speculator = spec.engine.speculator
    assert speculator.every_step
    seen = record_taps(monkeypatch, speculator.proposer)
    if drafts.startswith("accepting"):
        corrupted_oracle(monkeypatch, speculator, {tuple(p): w for p, w in zip(batch, want)}, every=2)
    outs = greedy(spec, batch, 16)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert spec.engine.step_counts["verify"] > 0 and not speculator.missing
    assert speculator.policy.catch_up == 0  # nothing was recomputed
    assert_taps_are_the_targets(seen, outs, reference)
    metrics = [o.metrics for o in outs]
    assert sum(m.num_draft_tokens for m in metrics) > 0
    if drafts.startswith("accepting"):
        assert sum(m.num_drafts - m.accepted_per_position[0] for m in metrics) > 0  # none accepted
        assert sum(m.accepted_per_position[0] - m.accepted_per_position[-1] for m in metrics) > 0  # some
        assert sum(m.accepted_per_position[-1] for m in metrics) > 0  # all
    assert len(spec.engine.scheduler.cache.free_slots) == 4


def test_a_step_without_taps_on_a_hybrid_is_an_internal_error(hybrid_path, drafter, monkeypatch):
    """Were a decode step to skip the drafter's taps, recomputing them later would advance the
    recurrent state twice: the engine stops with an internal error instead of corrupting it."""
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV,
               speculative_config=DFLASH | {"model": str(drafter)})
    monkeypatch.setattr(spec.engine.speculator, "taps_needed", lambda: False)
    monkeypatch.setattr(spec.engine.speculator, "_choose", lambda *a: 0)  # dormant: plain decodes
    with pytest.raises(RuntimeError, match="recurrent state twice"):
        greedy(spec, [[5, 6, 7, 8]], 4)


def test_recomputing_cached_positions_of_a_hybrid_is_refused(hybrid_path, drafter):
    """The catch-up pass (write_kv=False) itself refuses on a target with recurrent layers."""
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV,
               speculative_config=DFLASH | {"model": str(drafter)})
    engine = spec.engine
    seq = type("Seq", (), {"num_computed": 4, "block_table": [0, 1], "window_tables": [],
                           "token_slice": lambda self, a, b: [5] * (b - a)})()
    with pytest.raises(RuntimeError, match="twice"):
        list(engine._recompute_taps([(seq, 0)]))
    plan = next(engine.planner.catch_up(seq, 0))[1]
    with pytest.raises(RuntimeError, match="twice"):
        engine.runner.run(plan)


def test_draft_model_speculation_is_token_identical_to_plain_decoding(hybrid_path, tmp_path, tokenizer_dir):
    """A dense draft model proposes for the hybrid target (its own KV, no recurrent state)."""
    draft = build_hf_model("qwen3", tmp_path / "draft", tokenizer_dir, seed=5, num_hidden_layers=1)
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4)
    batch = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 16)]
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, speculative_config=config)
    outs = greedy(spec, batch, 16)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


HYBRID_DRAFT = dict(HYBRID, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], seed=5)


def test_a_hybrid_draft_model_drafts_its_own_greedy_continuation_across_rejections(hybrid_path, tmp_path,
                                                                                  tokenizer_dir, monkeypatch):
    """A Qwen 3.5 hybrid drafting for its family: its recurrent state rolls back to the snapshot after
    rejected drafts, so every draft is what the draft model itself (transformers) continues the
    sequence with, and the output is plain decoding's."""
    from transformers import AutoModelForCausalLM

    from lucebox.spec.draft_model import DraftModelProposer
    draft = build_hf_model("qwen3", tmp_path / "draft", tokenizer_dir, **HYBRID_DRAFT)
    oracle = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4)
    batch = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 16)]
    checked, real = [], DraftModelProposer.propose

    def propose(self, seqs, num_tokens):
        drafts = real(self, seqs, num_tokens)
        for seq, d in zip(seqs, drafts):
            tokens = list(seq.token_ids)
            for t in d.tokens:
                assert t == reference_logits(oracle, tokens)[-1].argmax().item()
                tokens.append(t)
            checked.append(len(d.tokens))
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose", propose)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, speculative_config=config)
    outs = greedy(spec, batch, 16)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert sum(checked) == drafted > accepted  # drafts were rejected: the snapshot path ran
    proposer = spec.engine.speculator.proposer
    assert proposer.slots == {}  # finished sequences gave their slots back
    assert proposer.runner.recurrent_states[0].num_slots == 2 * 4  # a live and a snapshot slot a sequence
    assert proposer.fixed_bytes(4) > 0  # counted by the memory plan
    proposer.device = torch.device("meta")  # a draft on another device (--draft-device): not the target's bytes
    assert proposer.fixed_bytes(4) == 0


def test_a_hybrid_draft_model_through_graph_buckets_is_token_identical(hybrid_path, tmp_path, tokenizer_dir):
    """The draft runner's static batches (what its CUDA graphs replay, run eagerly on the CPU) read and
    advance the draft's state slots named by its steps."""
    from dataclasses import replace
    draft = build_hf_model("qwen3", tmp_path / "draft", tokenizer_dir, **HYBRID_DRAFT)
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4)
    batch = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 12)]
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, speculative_config=config,
               cuda_graphs=True)
    settings = replace(spec.engine._graph_settings(), capture=False)
    spec.engine.runner.attach_graphs(settings)
    runner = spec.engine.speculator.proposer.runner
    runner.attach_graphs(replace(settings, sample=False, prefill_lens=()))
    assert [o.outputs[0].token_ids for o in greedy(spec, batch, 12)] == want
    assert sum(runner.graphs.replays.values()) > 0


@pytest.mark.parametrize("method", ["draft_model", "hybrid_draft_model", "dflash"])
def test_sampled_tokens_follow_the_hybrid_target_distribution(method, tmp_path):
    """tests/spec/test_spec.py's chi-square test of speculative sampling (a sampling draft model, dense
    or hybrid, or a DFlash drafter's deterministic drafts), on a hybrid target; fewer samples (the
    DeltaNet reference steps sequences one by one)."""
    from tests.spec.test_spec import (
        PROMPT,
        chi_square_rejects,
        exact_pair_distribution,
        sample_pairs,
    )
    from tests.spec_fixtures import peaked_model, small_vocab_tokenizer
    tok = small_vocab_tokenizer(tmp_path / "tok", ["a", "b", "c", "d", "e", "f"])
    layout = {k: v for k, v in HYBRID.items() if k not in ("model_type", "num_hidden_layers", "head_dim")}
    target = peaked_model(tmp_path / "t", tok, layers=4, seed=1, model_type="qwen3_5_text", **layout)
    drafter = {"draft_model": lambda: peaked_model(tmp_path / "d", tok, layers=1, seed=2),
               "hybrid_draft_model": lambda: peaked_model(tmp_path / "d", tok, layers=2, seed=2,
                                                          model_type="qwen3_5_text", **dict(
                                                              layout, layer_types=HYBRID_DRAFT["layer_types"])),
               "dflash": lambda: write_dflash_drafter(target, tmp_path / "d", taps=TAPS, block_size=3)}[method]()
    config = {"method": method.removeprefix("hybrid_"), "num_speculative_tokens": 2, "adaptive": False,
              "model": str(drafter)}
    llm = LLM(str(target), speculative_config=config, max_num_seqs=1024, max_num_batched_tokens=8192,
              kv_cache_memory=KV)
    samples = 1000
    counts = sample_pairs(llm, PROMPT, samples)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), samples)
    assert not rejected, (stat, critical)
    assert llm.engine.step_counts["verify"] > 0
