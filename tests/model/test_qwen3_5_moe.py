"""Qwen 3.5 MoE hybrids (Gated DeltaNet + gated attention, a sparse MoE FFN with a shared expert in
every layer) compute what transformers' Qwen3_5MoeForCausalLM computes: one-shot and chunked prefill,
decode, greedy generation through the engine; config forms and a wrong expert count."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.errors import CheckpointError
from lucebox.model.config import ModelConfig
from lucebox.model.loader import load_model
from lucebox.model.moe import SparseMoE
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import (
    BLOCK_SIZE,
    HYBRID,
    prompts,
    reference_logits,
    runner_for,
)

HYBRID_MOE = dict(HYBRID, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_5_moe"), tokenizer_dir, **HYBRID_MOE)


@pytest.fixture(scope="module")
def reference(moe_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    return model


def test_checkpoint_and_model_take_the_moe_shape(moe_path):
    saved = json.loads((moe_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3_5_moe_text"
    loaded = load_model(str(moe_path), dtype="float32")
    cfg = loaded.config
    assert cfg.family == "qwen3_5_moe" and cfg.moe_layers == [True] * 4 and cfg.norm_topk_prob
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (8, 2, 48)
    layers = loaded.model.layers
    assert [type(layer.mixer).__name__ for layer in layers] == ["GatedDeltaNet", "GatedAttention"] * 2
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None for layer in layers)


def test_prefill_in_one_shot_and_in_chunks_with_decodes_matches_transformers(moe_path, reference):
    loaded = load_model(str(moe_path), dtype="float32")
    a, b = prompts(loaded.config.vocab_size, [37, 23], seed=5)
    runner, blocks = runner_for(loaded)
    table_a, table_b = [], []
    blocks.allocate(table_a, len(a))
    blocks.allocate(table_b, len(b))
    runner.reset_states([0, 3])
    whole = runner.forward([a], [0], [table_a], all_logits=True, state_slots=[0])  # grouped experts
    assert (whole - reference_logits(reference, a)).abs().max().item() <= 1e-4
    # b in unaligned chunks and single-token decodes (few rows: the gathered expert path).
    rows, pos = [], 0
    for step in (5, 1, 1, 9, 1, 3, 1, 2):
        rows.append(runner.forward([b[pos:pos + step]], [pos], [table_b], all_logits=True, state_slots=[3]))
        pos += step
    assert pos == len(b)
    assert (torch.cat(rows) - reference_logits(reference, b)).abs().max().item() <= 1e-4


def test_greedy_generation_in_a_continuous_batch_equals_transformers(moe_path, reference):
    llm = LLM(str(moe_path), block_size=BLOCK_SIZE, max_num_batched_tokens=8, max_num_seqs=3)
    batch = prompts(llm.engine.loaded.config.vocab_size, [15, 6, 11], seed=7)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    for prompt, out in zip(batch, outs):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                      min_new_tokens=10)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == want


def test_conditional_generation_config_reads_the_text_model(moe_path):
    text = json.loads((moe_path / "config.json").read_text())
    text.pop("intermediate_size", None)  # Qwen3_5MoeTextConfig has no dense FFN width
    outer = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
             "tie_word_embeddings": False, "text_config": {k: v for k, v in text.items() if k != "tie_word_embeddings"}}
    # Qwen3.5-MoE always renormalises and makes every layer sparse, whatever these keys say.
    outer["text_config"].update(norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=2)
    cfg = ModelConfig.from_hf_dict(outer)
    assert cfg.family == "qwen3_5_moe" and cfg.moe_layers == [True] * 4 and cfg.norm_topk_prob
    assert cfg.layer_types == HYBRID_MOE["layer_types"]
    with pytest.raises(CheckpointError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf_dict({**text, "shared_expert_intermediate_size": None})


def test_expert_count_mismatch_names_the_tensor(moe_path, tmp_path):
    for file in moe_path.iterdir():
        shutil.copy(file, tmp_path / file.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts": 6}))
    with pytest.raises(CheckpointError, match=r"num_experts is 6.*layers\.0\.mlp\.experts\.6"):
        load_model(str(tmp_path), dtype="float32")
