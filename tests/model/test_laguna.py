"""Poolside Laguna computes what transformers' LagunaForCausalLM computes: full and sliding-window
layers (windows shorter than the prompts) with their own RoPE (YaRN on the full layers, partial
rotary dims), per-layer query-head counts, the softplus output gate per head and per channel, a dense
layer and sigmoid-routed MoE layers (selection bias, soft-capped logits, routed scaling, several
experts, the shared expert); through one-shot, batched and unaligned chunked prefill and decode, and
greedy generation through lucebox.LLM. Softmax routing and weights on the experts' input are not in
transformers' Laguna: their reference is transformers' model with its router's scores (resp. its
MoE block's weighting) switched as those options define."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.errors import CheckpointError, UnsupportedError
from lucebox.model.config import ModelConfig
from lucebox.model.loader import load_model
from lucebox.model.moe import SparseMoE
from tests.model.test_qwen3_5 import BLOCK_SIZE, prompts, reference_logits, runner_for

FULL, SLIDING = "full_attention", "sliding_attention"
LAGUNA = dict(
    num_hidden_layers=4, hidden_size=64, intermediate_size=96, head_dim=16, num_attention_heads=4,
    num_key_value_heads=2, num_attention_heads_per_layer=[4, 6, 2, 8], layer_types=[FULL, SLIDING, SLIDING, FULL],
    sliding_window=5, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=8, num_experts_per_tok=3,
    moe_intermediate_size=24, shared_expert_intermediate_size=40, moe_routed_scaling_factor=2.5,
    moe_router_logit_softcapping=1.5, max_position_embeddings=256, tie_word_embeddings=False,
    rope_parameters={FULL: {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5},
                     SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}})
# What transformers' LagunaConfig cannot take: written into config.json after saving.
SOFTMAX_ON_INPUT = {"moe_router_use_sigmoid": False, "moe_apply_router_weight_on_input": True}


def build_laguna(out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random transformers Laguna saved to `out`, with random norms and selection biases and a router
    wide enough (logits of a few units) that soft-capping and the scores' spread matter."""
    from transformers import AutoConfig, AutoModelForCausalLM
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = AutoConfig.for_model("laguna", **{**LAGUNA, "vocab_size": len(vocab) + 3,
                                               "eos_token_id": vocab["<|im_end|>"], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(20)
    model.save_pretrained(out, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, out / file)
    return out


def with_config(path: Path, out: Path, **changes) -> Path:
    """A copy of a checkpoint directory with config.json changed."""
    for file in path.iterdir():
        shutil.copy(file, out / file.name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def softmax_on_input(model):
    """transformers' Laguna with softmax router scores and the routing weights applied to each expert's
    input, as moe_router_use_sigmoid=false and moe_apply_router_weight_on_input=true define them."""
    from transformers.models.laguna.modeling_laguna import (
        LagunaSparseMoeBlock,
        LagunaTopKRouter,
    )
    for module in model.modules():
        if isinstance(module, LagunaTopKRouter):
            sigmoid_forward = module.forward
            module.forward = lambda h, f=sigmoid_forward: _with_softmax_scores(f, h)
        elif isinstance(module, LagunaSparseMoeBlock):
            module.forward = lambda h, block=module: _weights_on_input(block, h)
    return model


def _with_softmax_scores(forward, hidden):
    real_sigmoid = torch.sigmoid
    torch.sigmoid = lambda x: torch.softmax(x, dim=-1)  # the router's one sigmoid: its scores
    try:
        return forward(hidden)
    finally:
        torch.sigmoid = real_sigmoid


def _weights_on_input(block, hidden):
    batch, length, width = hidden.shape
    x = hidden.view(-1, width)
    _, weights, ids = block.gate(x)
    ones = torch.ones_like(weights[:, :1])
    routed = sum(block.experts(x * weights[:, j:j + 1], ids[:, j:j + 1], ones) for j in range(ids.shape[1]))
    return (routed * block.routed_scaling_factor + block.shared_experts(x)).view(batch, length, width)


@pytest.fixture(scope="module")
def laguna_path(tmp_path_factory, tokenizer_dir):
    return build_laguna(tmp_path_factory.mktemp("laguna"), tokenizer_dir)


@pytest.fixture(scope="module")
def per_element_path(tmp_path_factory, tokenizer_dir):
    """Per-channel gates; the layers' order of kinds reversed; softmax routing and weights on input."""
    path = build_laguna(tmp_path_factory.mktemp("laguna_per_element"), tokenizer_dir, seed=3, gating="per-element",
                        layer_types=[SLIDING, FULL, SLIDING, SLIDING], mlp_layer_types=["sparse", "dense", "sparse",
                                                                                        "sparse"])
    return path, with_config(path, tmp_path_factory.mktemp("laguna_softmax"), **SOFTMAX_ON_INPUT)


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == "LagunaForCausalLM"
    return model


@pytest.fixture(scope="module")
def reference(laguna_path):
    return transformers_model(laguna_path)


def reference_greedy(reference, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax tokens, EOS (token 2 here) included as lucebox's ignore_eos does: generate's
    min_new_tokens would rule EOS out instead."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference_logits(reference, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_config_and_model_take_the_laguna_shape(laguna_path):
    loaded = load_model(str(laguna_path), dtype="float32")
    cfg = loaded.config
    assert cfg.family == "laguna" and cfg.heads_per_layer == [4, 6, 2, 8] and cfg.gate_per_head
    assert cfg.sliding_windows == [None, 5, 5, None] and cfg.moe_layers == [False, True, True, True]
    assert (cfg.rope.type, cfg.partial_rotary_factor, cfg.sliding_rope.theta) == ("yarn", 0.5, 10000.0)
    assert (cfg.router_sigmoid, cfg.router_logit_softcap, cfg.routed_scaling_factor) == (True, 1.5, 2.5)
    layers = loaded.model.layers
    assert [layer.self_attn.q_proj.out_features for layer in layers] == [64, 96, 32, 128]
    assert [layer.self_attn.g_proj.out_features for layer in layers] == [4, 6, 2, 8]
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert_gate is None for layer in layers[1:])
    specs = loaded.model.cache_specs()
    assert [s.window for s in specs] == [None, 5, 5, None] and {s.num_kv_heads for s in specs} == {2}
    bias = layers[1].mlp.experts.e_score_correction_bias
    assert bias.abs().max() > 0  # read from the file's mlp.experts.e_score_correction_bias


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_batched_prefill_matches_transformers(laguna_path, reference, fused):
    """Prompts longer than the window (5) and than YaRN's original context's fraction the test reaches."""
    loaded = load_model(str(laguna_path), dtype="float32", device="cpu")
    if fused:
        loaded.model.fuse_projections()
        assert all(layer.self_attn.qkvg is not None for layer in loaded.model.layers)
    batch = prompts(loaded.config.vocab_size, [23, 3, 40])
    runner, blocks = runner_for(loaded)
    tables = [[] for _ in batch]
    for table, prompt in zip(tables, batch):
        blocks.allocate(table, len(prompt))
    logits = runner.forward(batch, [0] * 3, tables, all_logits=True)
    for prompt, got in zip(batch, logits.split([len(p) for p in batch])):
        assert (got - reference_logits(reference, prompt)).abs().max().item() <= 1e-4


def chunked_logits(loaded, prompt: list[int], steps) -> torch.Tensor:
    """The prompt's logits at every position from unaligned chunks and single-token decodes."""
    runner, blocks = runner_for(loaded)
    table = []
    blocks.allocate(table, len(prompt))
    rows, pos = [], 0
    for step in steps:
        rows.append(runner.forward([prompt[pos:pos + step]], [pos], [table], all_logits=True))
        pos += step
    assert pos == len(prompt)
    return torch.cat(rows)


def test_chunked_prefill_and_decode_match_transformers(laguna_path, reference):
    loaded = load_model(str(laguna_path), dtype="float32", device="cpu")
    (prompt,) = prompts(loaded.config.vocab_size, [31], seed=4)
    got = chunked_logits(loaded, prompt, (7, 1, 1, 9, 1, 3, 1, 6, 1, 1))
    assert (got - reference_logits(reference, prompt)).abs().max().item() <= 1e-4


def test_layers_with_different_kv_head_counts_keep_their_own_cache_shapes(laguna_path, reference):
    """The KV pool is per layer: layer 1's 2 KV heads expanded to one per query head (each repeated 3
    times: the same attention) give a pool of 2, 6, 2 and 2 KV heads and transformers' logits."""
    from lucebox.model.cache_spec import bytes_per_token
    loaded = load_model(str(laguna_path), dtype="float32", device="cpu")
    attn = loaded.model.layers[1].self_attn
    groups, width = attn.num_heads // attn.num_kv_heads, loaded.config.hidden_size
    for name in ("k_proj", "v_proj"):
        rows = getattr(attn, name).weight.detach().view(attn.num_kv_heads, -1, width)
        expanded = torch.nn.Linear(width, attn.num_heads * attn.head_dim, bias=False)
        expanded.weight = torch.nn.Parameter(rows.repeat_interleave(groups, dim=0).reshape(-1, width))
        setattr(attn, name, expanded)
    attn.num_kv_heads = attn.num_heads
    specs = loaded.model.cache_specs()
    assert [s.num_kv_heads for s in specs] == [2, 6, 2, 2]
    assert bytes_per_token(specs) == (2 + 6 + 2 + 2) * 16 * 2 * 4  # K and V, float32
    runner, _ = runner_for(loaded)
    assert [tuple(k.values.shape[2:]) for k, _ in runner.caches] == [(2, 16), (6, 16), (2, 16), (2, 16)]
    (prompt,) = prompts(loaded.config.vocab_size, [19], seed=9)
    got = chunked_logits(loaded, prompt, (8, 1, 6, 1, 1, 2))
    assert (got - reference_logits(reference, prompt)).abs().max().item() <= 1e-4


def test_per_element_gates_softmax_routing_and_weights_on_input_match_their_definition(per_element_path):
    sigmoid_path, path = per_element_path
    loaded = load_model(str(path), dtype="float32", device="cpu")
    cfg = loaded.config
    assert not cfg.gate_per_head and not cfg.router_sigmoid and cfg.router_weights_on_input
    assert loaded.model.layers[0].self_attn.g_proj.out_features == 4 * 16
    reference = transformers_model(sigmoid_path)  # transformers' LagunaConfig refuses weights on input
    (prompt,) = prompts(cfg.vocab_size, [29], seed=6)
    plain = reference_logits(reference, prompt)
    want = reference_logits(softmax_on_input(reference), prompt)
    assert (want - plain).abs().max() > 1e-2  # the options change the logits
    got = chunked_logits(loaded, prompt, (11, 1, 5, 1, 1, 10))
    assert (got - want).abs().max().item() <= 1e-4


def test_greedy_generation_in_a_continuous_batch_equals_transformers(laguna_path, reference):
    """Then next turns (prompt + reply + new text), their prefixes (past the window) served from the
    prefix cache: the window layers keep only a window, so a hit reaches where their last window is held."""
    llm = LLM(str(laguna_path), block_size=BLOCK_SIZE, max_num_batched_tokens=8, max_num_seqs=3,
              kv_cache_memory=64 << 20)
    batch = prompts(llm.engine.loaded.config.vocab_size, [15, 6, 11], seed=7)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    replies = [list(out.outputs[0].token_ids) for out in outs]
    turns = [batch[0] + replies[0] + [5, 6, 7], batch[2] + replies[2] + [9]]
    for round_ in (batch, turns):
        outs = llm.generate([{"prompt_token_ids": p} for p in round_], params, use_tqdm=False)
        for prompt, out in zip(round_, outs):
            assert list(out.outputs[0].token_ids) == reference_greedy(reference, prompt, 10)
    assert sum(o.num_cached_tokens for o in outs) >= 2 * 8


def test_router_options_route_as_defined():
    """Sigmoid scores with a selection bias choose by score + bias and weigh by score; soft-capping
    bounds the logits; routed scaling multiplies the routed part only."""
    from lucebox.model.moe import Routing
    logits = torch.tensor([[4.0, 0.0, -1.0, 2.0]])
    bias = torch.tensor([0.0, 0.9, 0.0, 0.0])
    ids, weights = Routing(2, scoring="sigmoid", selection_bias=True).choose(logits, bias)
    scores = torch.sigmoid(logits)[0]
    assert ids.tolist() == [[1, 0]]  # expert 1 only through its bias
    assert torch.allclose(weights, scores[[1, 0]] / scores[[1, 0]].sum())
    ids, weights = Routing(2, norm_topk_prob=False, scoring="sigmoid", logit_softcap=1.0).choose(logits)
    assert ids.tolist() == [[0, 3]] and torch.allclose(weights, torch.sigmoid(torch.tanh(logits[0, [0, 3]])))
    with pytest.raises(ValueError, match="softmax or sigmoid"):
        Routing(2, scoring="relu")


def test_config_forms_and_bad_fields(laguna_path):
    raw = json.loads((laguna_path / "config.json").read_text())
    default = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types", "mlp_layer_types",
                                                         "num_attention_heads_per_layer")}
    cfg = ModelConfig.from_hf_dict(default)  # transformers' defaults: all full, dense first, base heads
    assert cfg.attention_kinds == [FULL] * 4 and cfg.moe_layers == [False, True, True, True]
    assert cfg.heads_per_layer == [4] * 4 and cfg.rope.theta == 500000.0 and cfg.partial_rotary_factor == 0.5
    with pytest.raises(CheckpointError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_dict({**raw, "num_attention_heads_per_layer": [4, 5, 2, 8]})
    with pytest.raises(CheckpointError, match="no 'sliding_attention' entry"):
        ModelConfig.from_hf_dict({**raw, "rope_parameters": {FULL: raw["rope_parameters"][FULL]}})
    with pytest.raises(UnsupportedError, match="mlp_layer_types"):
        ModelConfig.from_hf_dict({**raw, "mlp_layer_types": ["dense", "moe", "sparse", "sparse"]})
    with pytest.raises(UnsupportedError, match="swa_attention_sink_enabled"):
        ModelConfig.from_hf_dict({**raw, "swa_attention_sink_enabled": True})


def test_missing_tensor_and_bad_shapes_name_the_tensor(laguna_path, tmp_path):
    from safetensors.torch import load_file, save_file
    path = with_config(laguna_path, tmp_path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.e_score_correction_bias"}, file,
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensors layers\.2\.mlp\.experts\.e_score_correction_bias"):
        load_model(str(path), dtype="float32")
    with_config(laguna_path, tmp_path, num_attention_heads_per_layer=[4, 6, 4, 8])
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.q_proj\.weight has shape \[32, 64\].*"
                                              r"num_attention_heads_per_layer\[2\] \(4\)"):
        load_model(str(path), dtype="float32")


def test_expert_count_mismatch_names_the_tensor(laguna_path, tmp_path):
    with_config(laguna_path, tmp_path, num_experts=6)
    with pytest.raises(CheckpointError, match=r"num_experts is 6.*layers\.1\.mlp\.experts\.6"):
        load_model(str(tmp_path), dtype="float32")


NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3, "adaptive": False}


def test_ngram_speculation_is_token_identical_to_plain_decoding(laguna_path):
    """A continuous batch whose drafts are partly accepted, partly rejected, past the sliding window."""
    def greedy(llm, batch):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

    plain = LLM(str(laguna_path), block_size=BLOCK_SIZE, max_num_seqs=4, kv_cache_memory=64 << 20)  # two engines live
    a, b, c = prompts(plain.engine.loaded.config.vocab_size, [5, 3, 7], seed=11)
    batch = [a * 4, b * 5 + a, c + b * 3 + c, a + c * 2]  # repeated phrases: the n-gram lookup drafts from them
    want = [o.outputs[0].token_ids for o in greedy(plain, batch)]
    spec = LLM(str(laguna_path), block_size=BLOCK_SIZE, max_num_seqs=4, speculative_config=NGRAM,
               kv_cache_memory=64 << 20)
    outs = greedy(spec, batch)
    assert [o.outputs[0].token_ids for o in outs] == want
    metrics = [o.metrics for o in outs]
    assert sum(m.num_drafts - m.accepted_per_position[0] for m in metrics) > 0  # verifies accepting none
    assert sum(m.accepted_per_position[0] - m.accepted_per_position[-1] for m in metrics) > 0  # some
    assert sum(m.accepted_per_position[-1] for m in metrics) > 0  # all
    assert spec.engine.step_counts["verify"] > 0
