"""Quantised KV caches inside the engine: generation runs end to end and stays close to float32."""
from __future__ import annotations

import random

import pytest

from lucebox import LLM, SamplingParams
from lucebox.errors import RequestError

from tests.conftest import build_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer_dir):
    return str(build_hf_model("qwen3", tmp_path_factory.mktemp("qwen3-hd32"), tokenizer_dir, head_dim=32))


def agreement(base, other) -> float:
    fractions = []
    for a, b in zip(base, other):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        fractions.append(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) / len(x))
    return sum(fractions) / len(fractions)


def test_quantised_kv_greedy_agreement_with_float32(model_path):
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(380) for _ in range(rng.randint(8, 40))]} for _ in range(8)]
    base = LLM(model_path, block_size=4).generate(prompts, GREEDY, use_tqdm=False)
    report = {}
    for cache_type in ("bf16", "fp8", "q8_0", "q4_0"):
        for rotate in (False, True):
            llm = LLM(model_path, block_size=4, cache_type_k=cache_type, cache_type_v=cache_type,
                      cache_rotate_k=rotate)
            report[cache_type + ("+rot" if rotate else "")] = agreement(base, llm.generate(prompts, GREEDY,
                                                                                           use_tqdm=False))
    print("\ngreedy agreement with an f32 KV cache (tiny random model):",
          ", ".join(f"{k} {100 * v:.0f}%" for k, v in report.items()))
    # A cache that stored garbage would diverge at the first token; these formats keep >= 8 bits or more.
    assert report["bf16"] >= 0.9 and report["q8_0"] >= 0.75 and report["fp8"] >= 0.5
    assert report["q4_0"] > 0.1


def test_k_and_v_types_are_set_separately(model_path):
    llm = LLM(model_path, cache_type_k="q8_0", cache_type_v="fp8")
    attn = llm.engine.model.layers[0].self_attn
    assert (attn.k_cache.cache_type, attn.v_cache.cache_type) == ("q8_0", "fp8")
    assert llm.generate("def", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_smaller_cache_types_fit_more_tokens_in_the_same_memory(model_path):
    sizes = {t: LLM(model_path, kv_cache_memory=1 << 20, cache_type_k=t, cache_type_v=t).engine.kv_capacity_tokens
             for t in ("f32", "bf16", "q8_0", "q4_0")}
    assert sizes["f32"] < sizes["bf16"] < sizes["q8_0"] < sizes["q4_0"]


def test_unknown_cache_type_names_the_flag(model_path):
    with pytest.raises(RequestError, match="--cache-type-v.*q5_k"):
        LLM(model_path, cache_type_v="q5_k")


def test_engines_sharing_one_loaded_model_keep_their_own_kv(model_path):
    """Benchmarks build several engines on one loaded model; each installs its K/V caches in the
    model's layers. An engine built earlier must still run on its own caches after another was
    built and ran: its next step attends to the K/V it wrote itself."""
    import torch

    from lucebox.config import EngineArgs
    from lucebox.engine.engine import LLMEngine
    from lucebox.model.cache_spec import kv_bytes_per_token
    from lucebox.model.loader import load_model
    loaded = load_model(str(model_path), dtype="float32", device="cpu")
    rng = random.Random(3)
    prompt, other = ([rng.randrange(300) for _ in range(100)] for _ in range(2))

    def engine(blocks: int):
        memory = blocks * 4 * kv_bytes_per_token(loaded.model, "auto", "auto")
        e = LLMEngine(loaded, EngineArgs(model=str(model_path), block_size=4, max_model_len=116,
                                         kv_cache_memory=memory))
        table: list[int] = []
        e.scheduler.blocks.allocate(table, 101)
        return e.runner, table
    first, table = engine(64)
    whole = first.forward([prompt + [7]], [0], [table])  # the logits after the prompt and one more token
    first.forward([prompt], [0], [table])  # the prompt's K/V, in first's caches
    second, other_table = engine(32)
    second.forward([other], [0], [other_table])  # other K/V, in second's caches (the same block ids)
    assert torch.allclose(first.forward([[7]], [100], [table]), whole, atol=1e-4)
