"""Hybrid (Qwen 3.5 / 3.6) and MoE shapes for `lucebox bench speed`: the real configs, random models of
them, and the bytes / FLOPs a step needs (routed experts only, recurrent state read and written)."""
from __future__ import annotations

import math

import pytest
import torch

from lucebox.bench import limits, shapes, speed
from lucebox.errors import RequestError
from lucebox.model.deltanet import GatedDeltaNet
from lucebox.model.moe import SparseMoE

CPU = torch.device("cpu")



def test_the_hybrid_and_moe_shapes_are_the_published_configs():
    c = shapes.shape_config("qwen3.6-27b")
    assert (c.family, c.hidden_size, c.num_layers, c.intermediate_size, c.vocab_size) == ("qwen3_5", 5120, 64, 17408,
                                                                                          248320)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.partial_rotary_factor) == (24, 4, 256, 0.25)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (16, 48, 128, 128, 4)
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert not any(c.moe_layers) and not c.tie_word_embeddings and c.rope.theta == 1e7
    m = shapes.shape_config("qwen3.6-35b-a3b")
    assert (m.family, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == ("qwen3_5_moe", 2048,
                                                                                                  40, 16, 2, 256)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.num_experts, m.num_experts_per_tok) == (16, 32, 256, 8)
    assert (m.moe_intermediate_size, m.shared_expert_intermediate_size, m.vocab_size) == (512, 512, 248320)
    assert all(m.moe_layers) and m.layer_types.count("full_attention") == 10
    q = shapes.shape_config("qwen3-30b-a3b")
    assert (q.family, q.hidden_size, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim) == ("qwen3_moe", 2048, 48,
                                                                                                  32, 4, 128)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.vocab_size) == (128, 8, 768, 151936)
    assert all(q.moe_layers) and q.norm_topk_prob and not q.shared_expert_intermediate_size
    # "A3B": about 3 billion weights multiplied a token; the dense 27B about 27 billion in all
    assert 2.8e9 < limits.active_params(m) < 3.4e9 and 2.8e9 < limits.active_params(q) < 3.4e9
    assert 26e9 < limits.active_params(c) + c.vocab_size * c.hidden_size < 28e9
    # Qwen3.5-0.8B (issue 33's small hybrid): its tied 248,320-row embedding is a third of its ~0.75B weights
    s = shapes.shape_config("qwen3.5-0.8b")
    assert (s.family, s.hidden_size, s.num_layers, s.intermediate_size, s.num_heads, s.num_kv_heads,
            s.head_dim) == ("qwen3_5", 1024, 24, 3584, 8, 2, 256)
    assert (s.linear_num_key_heads, s.linear_num_value_heads) == (16, 16) and s.tie_word_embeddings
    assert s.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 6
    assert 0.7e9 < limits.active_params(s) < 0.8e9


def test_random_hybrid_moe_model_has_every_module_kind_and_sane_weights():
    model = shapes.build_random_model("tiny-hybrid-moe", "bf16", CPU).model
    kinds = [type(layer.mixer).__name__ for layer in model.layers]
    assert kinds == ["GatedDeltaNet"] * 3 + ["GatedAttention"]
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if "norm" in name:
            assert (p == 1).all(), name
        elif p.numel() > 64:
            assert 0.015 < p.float().std().item() < 0.025, name


def test_quantised_hybrids_keep_the_small_deltanet_tensors_and_the_router_in_float():
    model = shapes.build_random_model("tiny-hybrid", "q4_k_m", CPU).model
    delta = model.layers[0].linear_attn
    assert isinstance(delta, GatedDeltaNet)
    assert type(delta.in_proj_a).__name__ == type(delta.in_proj_b).__name__ == "Linear"
    assert type(delta.in_proj_qkv).__name__ == "QuantLinear" and delta.in_proj_qkv.qtype.name == "Q6_K"
    assert delta.out_proj.qtype.name == "Q4_K" and model.layers[3].self_attn.v_proj.qtype.name == "Q6_K"


@pytest.mark.parametrize("shape", ["tiny-hybrid-moe", "tiny-moe"])
def test_quantised_experts_are_stacked_quant_tensors_where_the_model_holds_them(shape):
    try:
        model = shapes.build_random_model(shape, "q4_k_m", CPU).model
    except RequestError as e:
        assert "quantised experts" in str(e)
        pytest.skip(f"model/moe.py holds no quantised experts yet: {e}")
    cfg = model.config
    sizes = limits.weight_tensors(model)
    gate_up = sum(v for k, v in sizes.items() if k.startswith("layers.0.mlp.experts.") and "down" not in k)
    # Q4_K: 144 bytes a 256-value block; gate and up of every expert
    assert gate_up == cfg.num_experts * 2 * cfg.moe_intermediate_size * cfg.hidden_size // 256 * 144


def test_decode_reads_the_routed_experts_and_the_recurrent_state_once_a_token():
    model = shapes.build_random_model("tiny-hybrid-moe", "bf16", CPU).model
    cfg = model.config
    h, e, k, inter = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    experts = cfg.num_layers * e * 3 * inter * h * 2  # bf16
    table = cfg.vocab_size * h * 2
    total = limits.weight_bytes(model)
    assert total == sum(p.numel() * 2 for p in model.parameters())
    assert limits.weight_bytes_per_token(model) == total - experts + experts * k // e - table + h * 2
    linear = cfg.layer_types.count("linear_attention")
    heads, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = 2 * cfg.linear_num_key_heads * dk + heads * dv
    assert limits.state_bytes_per_token(model) == linear * 2 * 4 * (heads * dk * dv + conv * 3)


def test_prefill_flops_count_routed_experts_the_deltanet_and_full_attention_layers_only():
    cfg = shapes.shape_config("tiny-hybrid-moe")
    h, n = cfg.hidden_size, 64
    layers, head = limits.matmul_params(cfg)
    key, value, vh = 2 * 64, 4 * 64, 4
    deltanet = h * (2 * key + value) + h * value + 2 * h * vh + value * h
    attention = h * (2 * 2 * 256 + 2 * 256) + 2 * 256 * h  # q and its gate, k, v; o
    ffn = h * 8 + 2 * 3 * h * 256 + 3 * h * 256 + h  # router, top 2 experts, shared expert and its gate
    assert layers == 3 * deltanet + attention + 4 * ffn and head == h * cfg.vocab_size
    flops = limits.prefill_flops(cfg, n)
    assert flops == 2 * layers * n + 2 * head + 4 * (n * (n + 1) // 2) * 2 * 256 + 6 * vh * 64 * 64 * n * 3


def test_bench_speed_runs_a_hybrid_moe_shape_end_to_end():
    args = speed.default_args(shape="tiny-hybrid-moe", quant="f32", device="cpu", prompt_lens=[32], contexts=[32],
                              decode_tokens=4, repeats=1, skip=["reference", "spec"])
    result = speed.run(args)
    d, model = result["decode"][0], result["model"]
    assert model["state_bytes_per_token"] > 0 and d["state_bytes_per_token"] == model["state_bytes_per_token"]
    assert d["bytes_per_token"] == model["weight_bytes_per_token"] + d["state_bytes_per_token"] + \
        model["kv_bytes_per_token"] * (32 + 2.5)
    assert model["weight_bytes_per_token"] < model["weight_bytes"] / 2  # 2 of 8 experts a token
    v = result["verify"]
    assert v["q_len"] == 16 and math.isfinite(v["ratio"]) and v["ratio"] > 0
    assert result["forced"]["acceptance"] == 1.0
    assert "hybrids and MoE" in result["peer"]["skipped"]  # the transformers peer is for dense models
