"""Sparse mixture-of-experts (qwen3_moe): the block against a per-token reference, the model against
transformers' Qwen3MoeForCausalLM through the engine, both checkpoint layouts, and bad files."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from lucebox import LLM, SamplingParams
from lucebox.convert import convert_hf_to_gguf
from lucebox.errors import CheckpointError
from lucebox.model import moe
from lucebox.model.config import ModelConfig
from lucebox.model.loader import load_model
from lucebox.model.moe import SparseMoE
from lucebox.weights.quant import QuantTensor

from tests.conftest import MOE_FAMILIES, build_hf_model
from tests.model.test_model import load, make_runner, prefill_logits, random_prompts, reference_logits
from tests.test_llm import prompts_for, reference_greedy
from tests.weights.test_quant import random_rows


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, tokenizer_dir):
    return {family: build_hf_model(family, tmp_path_factory.mktemp(family), tokenizer_dir)
            for family in MOE_FAMILIES}


# ------------------------------------------------------------------------------------ the block alone
def block_config(norm_topk_prob: bool, shared: int) -> ModelConfig:
    return ModelConfig(family="qwen3_moe", vocab_size=16, hidden_size=24, intermediate_size=40, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=20, norm_topk_prob=norm_topk_prob,
                       shared_expert_intermediate_size=shared, moe_layers=[True])


def naive_moe(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition."""
    out = torch.zeros_like(x)
    inter = block.experts.intermediate_size
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight @ x[t], dim=-1)
        top = torch.topk(probs, block.top_k)
        weights = top.values / top.values.sum() if block.norm_topk_prob else top.values
        for w, e in zip(weights, top.indices.tolist()):
            gate_up = block.experts.gate_up_proj[e] @ x[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += w * (block.experts.down_proj[e] @ act)
        if block.shared_expert is not None:
            s = block.shared_expert
            dense = s.down_proj.weight @ (torch.nn.functional.silu(s.gate_proj.weight @ x[t]) * (s.up_proj.weight @ x[t]))
            out[t] += torch.sigmoid(block.shared_expert_gate.weight @ x[t])[0] * dense
    return out


@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["decode", "gathered", "grouped"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("shared", [0, 16], ids=["no-shared", "shared-expert"])
def test_block_equals_per_token_reference_and_reads_only_routed_experts(tokens, norm_topk_prob, shared):
    torch.manual_seed(0)
    block = SparseMoE(block_config(norm_topk_prob, shared))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        block.gate.weight[4:] = -1.0  # positive inputs never route to experts 4 and 5
    block.fuse()
    x = torch.randn(tokens, 24).abs() + 0.1
    with torch.no_grad():
        expected = naive_moe(block, x)
        assert (block(x) - expected).abs().max().item() <= 1e-5
        # Experts no token routes to: poisoned, and the output must not notice.
        routed = set(block.route(x)[0].flatten().tolist())
        assert routed <= {0, 1, 2, 3} and (tokens == 1 or len(routed) > 2)
        for e in set(range(6)) - routed:
            block.experts.gate_up_proj[e] = float("nan")
            block.experts.down_proj[e] = float("nan")
        assert (block(x) - expected).abs().max().item() <= 1e-5


def test_gathered_and_grouped_paths_agree_and_an_empty_batch_works():
    block = SparseMoE(block_config(True, 0))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(20, 24)
    ids, weights = block.route(x)
    flat = ids.reshape(-1)
    gathered = block.experts._gathered(x, flat, 2)
    assert torch.allclose(gathered, block.experts._grouped(x, flat, 2), atol=1e-5)
    assert block(x[:0]).shape == (0, 24)


@pytest.mark.parametrize("tokens", [3, 40], ids=["gathered", "grouped"])
def test_quantised_experts_dequantise_only_the_routed_experts_on_the_reference_path(tokens):
    """Experts holding GGUF rows (QuantTensor [E, out, in]) compute what float experts holding their
    dequantised values compute; an expert no token routes to (NaN scales) never reaches the output."""
    rng = np.random.default_rng(0)
    quant = {name: QuantTensor(torch.from_numpy(random_rows(Q.Q4_K, 4 * n, k // 256, rng, small_scales=True)),
                               Q.Q4_K, (4, n, k))
             for name, n, k in (("gate_up_proj", 512, 256), ("down_proj", 256, 256))}
    floats = moe.Experts(4, 256, 256)
    with torch.no_grad():
        for name, w in quant.items():
            getattr(floats, name).copy_(w.dequantize())
    quantised = moe.Experts(4, 256, 256)
    for name, w in quant.items():
        delattr(quantised, name)
        setattr(quantised, name, w)
        w.data.view(4, w.shape[1], -1)[3].view(-1, 144)[:, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(1))
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(tokens)])  # experts 0..2
    weights = torch.rand(tokens, 2)
    with torch.no_grad():
        want = floats(x, ids, weights)
        got = quantised(x, ids, weights)
    assert torch.isfinite(got).all() and (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# ------------------------------------------------------------------------------ config.json mapping
def test_moe_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    base = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
                num_attention_heads=2, moe_intermediate_size=8, num_experts_per_tok=2)
    cfg = ModelConfig.from_hf_dict({**base, "num_experts": 4, "mlp_only_layers": [0, 3], "decoder_sparse_step": 1})
    assert cfg.moe_layers == [False, True, True, False, True, True] and not cfg.norm_topk_prob and cfg.qk_norm
    # transformers 5 writes num_local_experts; every second layer sparse from layer 1
    cfg = ModelConfig.from_hf_dict({**base, "num_local_experts": 4, "decoder_sparse_step": 2, "norm_topk_prob": True})
    assert cfg.moe_layers == [False, True, False, True, False, True] and cfg.norm_topk_prob
    assert cfg.num_experts == 4 and cfg.moe_intermediate_size == 8
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**base, "num_experts": 4, "num_experts_per_tok": 5})
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        ModelConfig.from_hf_dict({**base, "num_experts": 4, "moe_intermediate_size": 0})


# ------------------------------------------------------------------------- the model against transformers
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_batched_prefill_logits_match_transformers(family, fused, moe_models):
    loaded = load(moe_models[family], fused)
    assert [type(layer.mlp).__name__ for layer in loaded.model.layers] == (
        ["MLP", "SparseMoE", "SparseMoE", "SparseMoE"] if family == "qwen3_moe" else ["MLP", "SparseMoE"] * 2)
    prompts = random_prompts(loaded.config.vocab_size)
    for prompt, got in zip(prompts, prefill_logits(loaded, prompts)):
        expected = reference_logits(moe_models[family], prompt)
        assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_chunked_prefill_and_decode_through_paged_cache_match_transformers(family, moe_models):
    loaded = load(moe_models[family], False)
    prompt = random_prompts(loaded.config.vocab_size, seed=2)[1]
    expected = reference_logits(moe_models[family], prompt)
    runner, blocks = make_runner(loaded)
    table: list[int] = []
    blocks.allocate(table, len(prompt))
    pos, rows = 0, []
    for step in (9, 1, 3, 1, 1, 2):  # chunks of the grouped path, then gathered few-token steps
        chunk = prompt[pos:pos + step]
        rows.append(runner.forward([chunk], [pos], [table], all_logits=True))
        pos += len(chunk)
    assert pos == len(prompt)
    assert (torch.cat(rows) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("budget", [None, 7], ids=["one-shot-prefill", "chunked-prefill"])
def test_batched_greedy_generation_equals_transformers(budget, moe_models):
    path = moe_models["qwen3_moe"]
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=budget) if budget else LLM(str(path), block_size=4)
    prompts = prompts_for(llm.engine.model.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(path, prompt, 16)


def test_stacked_expert_layout_loads_and_matches(moe_models, tmp_path):
    """The layout transformers holds in memory (experts.gate_up_proj [E, 2I, H], experts.down_proj)."""
    source = moe_models["qwen3_moe"]
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    stacked = dict(moe.stack_experts(tensors.items(), ModelConfig.from_hf_dir(source), "test"))
    assert stacked["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert not any(".experts.0." in name for name in stacked)
    save_file({k: v.contiguous() for k, v in stacked.items()}, tmp_path / "model.safetensors")
    prompt = random_prompts(300)[1]
    ours = load_model(str(tmp_path), dtype="float32")
    runner, blocks = make_runner(ours)
    table: list[int] = []
    blocks.allocate(table, len(prompt))
    got = runner.forward([prompt], [0], [table], all_logits=True)
    assert (got - reference_logits(source, prompt)).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------------------- bad files
def with_config(source, out, **changes):
    shutil.copytree(source, out, dirs_exist_ok=True)
    raw = json.loads((source / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("experts, message", [
    (6, r"num_experts is 6, but the weights hold 8 experts in layer 1 \(unexpected tensor "
        r"layers.1.mlp.experts.6.gate_proj.weight\)"),
    (10, r"num_experts is 10, but the weights hold 8 experts in layer 1 \(missing tensor "
         r"layers.1.mlp.experts.8.gate_proj.weight\)"),
])
def test_expert_count_not_matching_the_tensors_is_named(experts, message, moe_models, tmp_path):
    path = with_config(moe_models["qwen3_moe"], tmp_path, num_local_experts=experts)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(path), dtype="float32")


def test_router_not_matching_the_experts_is_named(moe_models, tmp_path):
    source = moe_models["qwen3_moe"]
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.1.mlp.gate.weight"] = tensors["model.layers.1.mlp.gate.weight"][:7].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor layers.1.mlp.gate.weight has shape \[7, 64\], "
                                              r"but num_experts \(8\) makes it \[8, 64\]"):
        load_model(str(tmp_path), dtype="float32")


def test_missing_expert_tensor_in_a_later_layer_is_named(moe_models, tmp_path):
    source = moe_models["qwen3_moe"]
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor layers.2.mlp.experts.5.up_proj.weight"):
        load_model(str(tmp_path), dtype="float32")


def test_stacked_experts_of_the_wrong_size_are_named(moe_models, tmp_path):
    source = moe_models["qwen3_moe"]
    path = with_config(source, tmp_path, moe_intermediate_size=16)
    tensors = load_file(source / "model.safetensors")
    stacked = dict(moe.stack_experts(tensors.items(), ModelConfig.from_hf_dir(source), "test"))
    save_file({k: v.contiguous() for k, v in stacked.items()}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor layers.1.mlp.experts.gate_up_proj has shape \[8, 64, 64\], "
                                              r"but num_experts \(8\) and moe_intermediate_size \(16\)"):
        load_model(str(path), dtype="float32")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_moe_with_dense_layers_converts_to_gguf_and_back(family, moe_models, tmp_path):
    """mlp_only_layers / decoder_sparse_step: llama.cpp's qwen3moe has no such layers, lucebox's files keep
    them (a dense FFN's tensors; the layer's router tells the sparse ones apart); norm_topk_prob travels as
    qwen3moe.expert_weights_norm."""
    path = convert_hf_to_gguf(moe_models[family], tmp_path / "moe.gguf", "f32")
    loaded, hf = load_model(str(path), dtype="float32"), load_model(str(moe_models[family]), dtype="float32")
    for field in ("moe_layers", "norm_topk_prob", "num_experts", "tie_word_embeddings"):
        assert getattr(loaded.config, field) == getattr(hf.config, field), field
    prompt = random_prompts(loaded.config.vocab_size)[1]
    got = prefill_logits(loaded, [prompt])[0]
    assert (got - reference_logits(moe_models[family], prompt)).abs().max().item() <= 1e-4
