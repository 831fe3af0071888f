"""Speculative decoding on a Qwen 3.5 hybrid: a verify row computes each DeltaNet layer's outputs for
the pending token and its drafts without writing the state, stashing their inputs; the commit after
the verdict advances the slot over the accepted ones, so greedy output equals plain decoding."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.errors import UnsupportedError
from lucebox.model.loader import load_model
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import (
    BLOCK_SIZE,
    HYBRID,
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
    loaded = load_model(str(hybrid_path), dtype="float32")
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
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_seqs=4)
    batch = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 24)]
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_seqs=4, speculative_config=NGRAM)
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


def test_dflash_on_a_hybrid_is_refused_by_name(hybrid_path, tmp_path):
    from tests.spec.test_spec import write_dflash_drafter
    drafter = write_dflash_drafter(hybrid_path, tmp_path / "d")
    with pytest.raises(UnsupportedError, match="DFlash"):
        LLM(str(hybrid_path), speculative_config={"method": "dflash", "model": str(drafter)})


def test_draft_model_speculation_is_token_identical_to_plain_decoding(hybrid_path, tmp_path, tokenizer_dir):
    """A dense draft model proposes for the hybrid target (its own KV, no recurrent state)."""
    draft = build_hf_model("qwen3", tmp_path / "draft", tokenizer_dir, seed=5, num_hidden_layers=1)
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_seqs=4)
    batch = repetitive_prompts(plain.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 16)]
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_seqs=4, speculative_config=config)
    outs = greedy(spec, batch, 16)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_sampled_tokens_follow_the_hybrid_target_distribution(tmp_path):
    """tests/spec/test_spec.py's chi-square test of speculative sampling (a sampling draft model),
    on a hybrid target; fewer samples (the DeltaNet reference steps sequences one by one)."""
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
    config = {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False,
              "model": str(peaked_model(tmp_path / "d", tok, layers=1, seed=2))}
    llm = LLM(str(target), speculative_config=config, max_num_seqs=1024, max_num_batched_tokens=8192)
    samples = 1000
    counts = sample_pairs(llm, PROMPT, samples)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), samples)
    assert not rejected, (stat, critical)
    assert llm.engine.step_counts["verify"] > 0
