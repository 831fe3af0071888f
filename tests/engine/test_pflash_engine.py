"""PFlash through the engine: keep ratio 1.0 is exact; a compressed prompt decodes at its original positions
(transformers with explicit position_ids on the kept tokens is the reference); no prefix-cache mixing."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.errors import RequestError, UnsupportedError

from tests.conftest import build_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("target"), tokenizer_dir, seed=5)


@pytest.fixture(scope="module")
def prompt(qwen3_path) -> list[int]:
    return torch.randint(0, 380, (240,), generator=torch.Generator().manual_seed(2)).tolist()


def reference_greedy(path, ids: list[int], positions: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of `ids` rotated at `positions` (generated tokens at positions[-1] + 1 + i...), and
    each generated token's logprob."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, positions, out, logprobs = list(ids), list(positions), [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0, -1]
            out.append(int(logits.argmax()))
            logprobs.append(float(logits.log_softmax(-1)[out[-1]]))
            ids.append(out[-1])
            positions.append(positions[-1] + 1)
    return out, logprobs


def got_logprobs(completion) -> list[float]:
    return [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]


def test_keep_ratio_one_is_token_identical_to_exact_prefill(qwen3_path, prompt):
    exact = LLM(str(qwen3_path), block_size=4).generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    llm = LLM(str(qwen3_path), block_size=4, prefill_keep_ratio=1.0, prefill_min_tokens=16)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == exact.outputs[0].token_ids
    assert out.metrics.prompt_tokens_kept == len(prompt) and exact.metrics.prompt_tokens_kept is None
    assert out.prompt_token_ids == prompt


def test_compressed_prompt_decodes_at_original_positions(qwen3_path, prompt):
    llm = LLM(str(qwen3_path), block_size=4, prefill_keep_ratio=0.5, prefill_min_tokens=16,
              max_num_batched_tokens=24)  # chunked prefill of the kept tokens
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    compression = llm.engine.speculative_prefill().compress(prompt)
    kept = compression.kept_positions
    assert kept == list(range(32)) + list(range(160, 240))  # the head chunk, a gap, the 3 tail chunks
    assert out.metrics.prompt_tokens_kept == len(kept) and out.prompt_token_ids == prompt
    # the reference: the kept tokens at their original positions, decoding from len(prompt) on
    tokens, logprobs = reference_greedy(qwen3_path, compression.kept_ids, kept, 8)
    assert out.outputs[0].token_ids == tokens
    assert got_logprobs(out.outputs[0]) == pytest.approx(logprobs, abs=1e-4)
    # renumbered positions (what a contiguous re-prompt would do) give other probabilities
    _, renumbered = reference_greedy(qwen3_path, compression.kept_ids, list(range(len(kept))), 8)
    assert max(abs(a - b) for a, b in zip(renumbered, logprobs)) > 1e-3


def test_compressed_prompts_never_touch_the_prefix_cache(qwen3_path, prompt):
    llm = LLM(str(qwen3_path), block_size=4, prefill_min_tokens=16)
    exact = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    squeezed = llm.generate({"prompt_token_ids": prompt, "prefill_keep_ratio": 0.5}, GREEDY, use_tqdm=False)[0]
    assert squeezed.num_cached_tokens == 0 and squeezed.metrics.prompt_tokens_kept < len(prompt)
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == exact.outputs[0].token_ids
    short = llm.generate({"prompt_token_ids": prompt[:10], "prefill_keep_ratio": 0.5}, GREEDY, use_tqdm=False)[0]
    assert short.metrics.prompt_tokens_kept is None  # under prefill_min_tokens: exact


def test_a_scorer_that_does_not_fit_beside_the_pool_is_a_clear_error(qwen3_path, prompt, monkeypatch):
    """Not planned at start, the scorer is built on the first request that asks for PFlash: on a GPU the KV
    pool has taken the card by then. That request gets an error naming the flags; the engine goes on."""
    from lucebox.engine.pflash import prefill

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")
    llm = LLM(str(qwen3_path), block_size=4, prefill_min_tokens=16)
    monkeypatch.setattr(prefill.SpeculativePrefill, "__init__", out_of_memory)
    with pytest.raises(UnsupportedError, match="--prefill-keep-ratio or --prefill-scorer"):
        llm.generate({"prompt_token_ids": prompt, "prefill_keep_ratio": 0.5}, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    out = llm.generate({"prompt_token_ids": prompt, "prefill_keep_ratio": 0.5}, GREEDY, use_tqdm=False)[0]
    assert out.metrics.prompt_tokens_kept < len(prompt) and len(out.outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("ratio", [0, 1.5, "half", True])
def test_bad_keep_ratios_are_refused(qwen3_path, prompt, ratio):
    llm = LLM(str(qwen3_path), block_size=4, prefill_min_tokens=16)
    with pytest.raises(RequestError, match="prefill_keep_ratio must be a number in"):
        llm.generate({"prompt_token_ids": prompt, "prefill_keep_ratio": ratio}, GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="prefill_keep_ratio"):
        LLM(str(qwen3_path), prefill_keep_ratio=ratio)


@pytest.mark.parametrize("window", [-1, 2.5, True])
def test_bad_scorer_windows_are_refused(qwen3_path, window):
    with pytest.raises(RequestError, match="prefill_scorer_window must be a non-negative integer"):
        LLM(str(qwen3_path), prefill_scorer_window=window)


@pytest.mark.parametrize("spec", ["ngram", "dflash", "dflash-tree"])
def test_speculation_over_a_compressed_prompt_is_lossless(qwen3_path, prompt, tmp_path, spec):
    """Greedy verification with drafts (chains and trees) rotates them past the kept prompt like plain decoding."""
    from tests.spec_fixtures import write_dflash_drafter
    kwargs = dict(block_size=4, prefill_keep_ratio=0.5, prefill_min_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(qwen3_path), **kwargs).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    config = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    if spec != "ngram":
        drafter = write_dflash_drafter(qwen3_path, tmp_path / "drafter", taps=(0, 1), block_size=4)
        config = {"method": "dflash", "model": str(drafter), "adaptive": False}
        if spec == "dflash-tree":
            config["tree_budget"] = 6
    llm = LLM(str(qwen3_path), speculative_config=config, **kwargs)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.metrics.prompt_tokens_kept == plain.metrics.prompt_tokens_kept < len(prompt)
    assert out.metrics.num_drafts > 0


def test_a_hybrid_target_with_a_separate_scorer(qwen3_path, prompt, tmp_path_factory, tokenizer_dir):
    """A Gated DeltaNet target cannot score itself: a plain scorer (its own tokenizer, re-tokenised text)
    picks its kept tokens; ratio 1.0 stays token-identical to exact prefill, prefix caching on or not."""
    from tests.model.test_qwen3_5 import HYBRID
    hybrid = build_hf_model("qwen3", tmp_path_factory.mktemp("hybrid-target"), tokenizer_dir, **HYBRID)
    text = " ".join(f"item{i}" for i in range(60))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    exact = LLM(str(hybrid), block_size=4).generate(text, params, use_tqdm=False)[0]
    with pytest.raises(Exception, match="name another scorer with --prefill-scorer"):
        LLM(str(hybrid), block_size=4, prefill_min_tokens=16).generate(
            {"prompt": text, "prefill_keep_ratio": 0.5}, params, use_tqdm=False)
    llm = LLM(str(hybrid), block_size=4, prefill_min_tokens=16, prefill_scorer=str(qwen3_path))
    same = llm.generate({"prompt": text, "prefill_keep_ratio": 1.0}, params, use_tqdm=False)[0]
    assert same.outputs[0].token_ids == exact.outputs[0].token_ids
    assert same.metrics.prompt_tokens_kept == len(exact.prompt_token_ids)
    half = llm.generate({"prompt": text, "prefill_keep_ratio": 0.5}, params, use_tqdm=False)[0]
    assert half.metrics.prompt_tokens_kept < 0.75 * len(exact.prompt_token_ids)
    assert len(half.outputs[0].token_ids) == 6 and half.num_cached_tokens == 0


def test_compressed_sequences_survive_preemption_in_a_continuous_batch(qwen3_path, prompt):
    """Two compressed prompts in a pool too small for both: the newest is preempted and recomputed from its
    kept tokens at their positions, and each output equals the one it gets alone."""
    kwargs = dict(block_size=4, prefill_keep_ratio=0.9, prefill_min_tokens=16, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt[:200]}, {"prompt_token_ids": prompt[::-1][:200]}]  # 6 of 7 chunks kept
    alone = [LLM(str(qwen3_path), **kwargs).generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    per_token = LLM(str(qwen3_path), **kwargs).engine.runner.caches[0][0].bytes_per_token * 2 * 2  # K+V, 2 layers
    llm = LLM(str(qwen3_path), kv_cache_memory=per_token * 264, max_num_batched_tokens=32, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.metrics.prompt_tokens_kept == 32 * 5 + 8 for o in outs)  # the short last chunk among them


def test_gemma4_target_keeps_original_positions(tmp_path_factory, tokenizer_dir, qwen3_path, prompt):
    """A family with its own RoPE tables and sliding windows (Gemma 4): ratio 1.0 is exact, and a compressed
    prompt decodes as transformers does with position_ids on the kept tokens (windows over what is stored)."""
    from tests.model.test_gemma4 import DENSE, build
    path, _ = build(tmp_path_factory, tokenizer_dir, "gemma4-pflash", DENSE)
    ids = LLM(str(qwen3_path)).tokenizer.encode(" ".join(f"item{i}" for i in range(60)))  # re-tokenised alike
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    exact = LLM(str(path), block_size=4).generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    llm = LLM(str(path), block_size=4, prefill_min_tokens=16, prefill_scorer=str(qwen3_path))
    same = llm.generate({"prompt_token_ids": ids, "prefill_keep_ratio": 1.0}, params, use_tqdm=False)[0]
    assert same.outputs[0].token_ids == exact.outputs[0].token_ids
    half = llm.generate({"prompt_token_ids": ids, "prefill_keep_ratio": 0.5}, params, use_tqdm=False)[0]
    compression = llm.engine.speculative_prefill().compress(ids, 0.5)
    assert half.metrics.prompt_tokens_kept == len(compression.kept_positions) < len(ids)
    tokens, logprobs = reference_greedy(path, compression.kept_ids, compression.kept_positions, 6)
    assert half.outputs[0].token_ids == tokens
    assert got_logprobs(half.outputs[0]) == pytest.approx(logprobs, abs=1e-4)
