"""The offline API: batched generation equals the reference, vLLM-shaped outputs, sampling rules."""
from __future__ import annotations

import json

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.errors import ContextLengthError, RequestError

from tests.conftest import FAMILIES

PROMPT_LENGTHS = [3, 14, 8, 21]


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab - 3, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def reference_greedy(path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_generation_equals_transformers(family, hf_models):
    llm = LLM(str(hf_models[family]), block_size=4)
    prompts = prompts_for(llm.engine.model.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(hf_models[family], prompt, 32)
        assert out.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def qwen3(hf_models):
    return LLM(str(hf_models["qwen3"]), block_size=4)


def test_outputs_have_vllm_shape_with_text_and_logprobs(qwen3):
    out = qwen3.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                             ignore_eos=True), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert out.prompt == "def fibonacci(n):"
    assert out.prompt_token_ids == qwen3.tokenizer.encode("def fibonacci(n):")
    assert len(completion.token_ids) == 5 and len(completion.logprobs) == 5
    assert completion.text == qwen3.tokenizer.decode(completion.token_ids)
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token].rank == 1  # greedy picks the most likely token
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                              zip(completion.token_ids, completion.logprobs)))


def test_seeded_sampling_is_reproducible_and_n_samples_differ(qwen3):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=123, n=3, ignore_eos=True)
    first = qwen3.generate("import os", params, use_tqdm=False)[0]
    again = qwen3.generate(["x = 1", "import os"], params, use_tqdm=False)[1]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_stop_string_ends_generation_and_is_not_emitted(qwen3):
    free = qwen3.generate("class", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    assert len(free) > 6
    stop = free[3:6]
    out = qwen3.generate("class", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free[:free.index(stop)]


def test_stop_token_id_ends_generation(qwen3):
    free = qwen3.generate("class", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    out = qwen3.generate("class", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 stop_token_ids=[free[4]]), use_tqdm=False)[0].outputs[0]
    first = free.index(free[4])
    assert out.token_ids == free[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == free[4]


def test_min_tokens_blocks_eos_until_reached(qwen3):
    # Make EOS overwhelmingly likely with logit_bias; min_tokens still forces 4 tokens first.
    eos = next(iter(qwen3.engine.eos_token_ids))
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 100.0})
    out = qwen3.generate("def", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"


def test_generation_config_supplies_defaults_the_request_does_not_set(tokenizer_dir, tmp_path):
    from tests.conftest import build_hf_model
    path = build_hf_model("qwen3", tmp_path / "m", tokenizer_dir)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 5}))
    llm = LLM(str(path))
    engine = llm.engine
    engine.add_request("r", "def", SamplingParams(max_tokens=2))
    seq = engine.requests["r"][1][0]
    assert seq.params.temperature == 0 and seq.params.top_k == 5
    engine.add_request("s", "def", SamplingParams(max_tokens=2, temperature=0.5))
    assert engine.requests["s"][1][0].params.temperature == 0.5
    engine.abort("r"), engine.abort("s")


def test_chat_applies_the_template(qwen3):
    messages = [{"role": "user", "content": "hi"}]
    out = qwen3.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_longer_than_the_context_is_rejected_naming_the_limit(hf_models):
    llm = LLM(str(hf_models["qwen3"]), max_model_len=16)
    with pytest.raises(ContextLengthError, match="16"):
        llm.generate({"prompt_token_ids": list(range(20))}, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_generation_stops_at_the_context_window(hf_models):
    llm = LLM(str(hf_models["qwen3"]), max_model_len=16)
    out = llm.generate({"prompt_token_ids": list(range(10))},
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_a_bad_prompt_in_a_batch_adds_nothing(qwen3):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        qwen3.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [10**6]}], use_tqdm=False)
    assert not qwen3.engine.has_unfinished() and not qwen3.engine.scheduler.has_work()


def test_invalid_sampling_value_names_the_field():
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_preemption_under_a_tiny_kv_pool_keeps_greedy_outputs_identical(hf_models):
    path = str(hf_models["llama"])
    prompts = [{"prompt_token_ids": p} for p in prompts_for(380)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(path, block_size=4).generate(prompts, params, use_tqdm=False)
    # 64 tokens of KV hold one max_model_len sequence but not all four at once: sequences get preempted.
    tight = LLM(path, block_size=4, max_model_len=64, kv_cache_memory=64 * 2 * 2 * 2 * 16 * 4)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.scheduler.blocks.num_free_blocks == tight.engine.runner.num_blocks


def test_final_only_requests_are_reported_once_and_streaming_ones_every_step(qwen3):
    """output_kind "final_only" (what LLM.generate asks): the engine builds the request's output once,
    when it finishes, with the same content a cumulative request ends with; "cumulative" reports
    after every step. The caller's params object is left as it was."""
    engine = qwen3.engine
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    reports = {}
    for kind in ("cumulative", "final_only"):
        engine.add_request(kind, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                        output_kind=kind))
    while engine.has_unfinished():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    assert len(reports["cumulative"]) == 6 and [len(o.outputs[0].token_ids) for o in reports["cumulative"]] == \
        list(range(1, 7))
    (final,) = reports["final_only"]
    assert final.finished and final.outputs[0].token_ids == reports["cumulative"][-1].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert qwen3.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == final.outputs[0].token_ids
    assert params.output_kind == "cumulative"


def test_an_unknown_output_kind_is_refused_by_name():
    with pytest.raises(RequestError, match="output_kind"):
        SamplingParams(output_kind="delta")
