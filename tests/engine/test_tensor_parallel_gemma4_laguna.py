"""Tensor parallelism over two gloo processes for Gemma 4 and Laguna: TP=2 computes what TP=1 computes.

Laguna: per-layer query-head counts, softplus output gates, sliding-window and full layers (two KV cache
groups), sigmoid-routed experts beside an ungated shared expert. Gemma 4: KV-shared layers reading
their source's split cache, k = v full layers with one KV head (kept by both ranks), per-layer inputs,
double-wide MLPs, and (26B-A4B-like) the MoE block beside the dense MLP, all-reduced on its own."""
from __future__ import annotations

import pytest

from lucebox import LLM
from tests.engine.test_tensor_parallel import PROMPTS
from tests.engine.test_tensor_parallel_hybrid import all_logits, hybrid_kwargs, outputs
from tests.model.test_gemma4 import DENSE, MOE, build
from tests.model.test_laguna import build_laguna
from tests.spec_fixtures import write_dflash_drafter


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir) -> dict:
    return {"laguna": build_laguna(tmp_path_factory.mktemp("laguna"), tokenizer_dir),
            "gemma4": build(tmp_path_factory, tokenizer_dir, "gemma4", DENSE)[0],
            "gemma4-moe": build(tmp_path_factory, tokenizer_dir, "gemma4-moe", MOE)[0]}


@pytest.mark.parametrize("name", ["laguna", "gemma4", "gemma4-moe"])
def test_tp2_equals_tp1_with_dflash_on_rank0(models, name, tmp_path):
    model = str(models[name])
    drafter = write_dflash_drafter(models[name], tmp_path / "dflash", taps=(0, 2), block_size=4)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False}
    plain = LLM(model, speculative_config={}, **hybrid_kwargs())
    ids = plain.tokenizer.encode(PROMPTS[0])
    logits, tokens = all_logits(plain, ids), outputs(plain)
    llm = LLM(model, speculative_config=spec, tensor_parallel_size=2, **hybrid_kwargs())
    try:
        cfg = llm.engine.loaded.config
        heads = [layer.self_attn.num_heads for layer in llm.engine.model.layers]
        assert heads == [n // 2 for n in getattr(cfg, "heads_per_layer", [cfg.num_heads] * cfg.num_layers)]
        assert (all_logits(llm, ids) - logits).abs().max().item() <= 1e-4
        assert outputs(llm) == tokens
        assert llm.engine.step_counts["verify"] > 0
    finally:
        llm.engine.shutdown()
