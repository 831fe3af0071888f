"""Gemma 4 and Laguna shapes for `lucebox bench speed`: the real configs, random models of them, the bytes /
FLOPs a step needs (sliding-window layers read at most their window, routed experts only), and bench speed /
kv-quality on models mixing sliding-window and full attention (each KV cache group's tables)."""
from __future__ import annotations

import pytest
import torch

from lucebox.bench import kv_quality, kv_tables, limits, shapes, speed
from lucebox.config import EngineArgs
from lucebox.engine.engine import LLMEngine
from lucebox.model.cache_spec import PagedKVSpec, kv_bytes_per_token
from lucebox.weights.quant import QuantTensor

CPU = torch.device("cpu")
TINY = ("tiny-gemma4", "tiny-gemma4-moe", "tiny-laguna")



def test_gemma4_and_laguna_shapes_are_the_published_configs():
    g = shapes.shape_config("gemma4-31b")
    assert (g.family, g.num_layers, g.hidden_size, g.intermediate_size, g.vocab_size) == ("gemma4", 60, 5376, 21504,
                                                                                          262144)
    assert g.sliding_windows == ([1024] * 5 + [None]) * 10 and g.attention_k_eq_v and g.tie_word_embeddings
    assert g.layer_head_dims == ([256] * 5 + [512]) * 10 and g.layer_kv_heads == ([16] * 5 + [4]) * 10
    assert g.final_logit_softcapping == 30.0 and g.max_position_embeddings == 262144 and not any(g.moe_layers)
    m = shapes.shape_config("gemma4-26b-a4b")
    assert (m.num_layers, m.hidden_size, m.intermediate_size, m.num_heads) == (30, 2816, 2112, 16)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 8, 704) and all(m.moe_layers)
    assert m.layer_kv_heads == ([8] * 5 + [2]) * 5
    la = shapes.shape_config("laguna-xs-33b")
    assert (la.family, la.num_layers, la.hidden_size, la.num_kv_heads, la.head_dim, la.vocab_size) == (
        "laguna", 40, 2048, 8, 128, 100352)
    assert la.sliding_windows == [None, 512, 512, 512] * 10 and la.heads_per_layer == [48, 64, 64, 64] * 10
    assert (la.num_experts, la.num_experts_per_tok, la.moe_intermediate_size) == (256, 8, 512)
    assert la.moe_layers == [False] + [True] * 39 and la.routed_scaling_factor == 2.5 and la.gate_per_head
    # Published sizes: 31B has 30.7 billion weights; 26B-A4B multiplies about 3.8 billion a token; XS about 3
    assert 30.5e9 < limits.active_params(g) < 31e9
    assert 3.6e9 < limits.active_params(m) < 4.1e9 and 2.6e9 < limits.active_params(la) < 3.3e9


def _multiplied(model) -> int:
    """Weights the built model multiplies per token, counted from its tensors: every matrix but the
    embedding table and head, top_k / E of the stacked experts."""
    cfg, total = model.config, 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name in ("embed_tokens.weight", "lm_head.weight"):
            continue
        total += p.numel() * cfg.num_experts_per_tok // cfg.num_experts if ".experts." in name else p.numel()
    return total


@pytest.mark.parametrize("shape", TINY)
def test_random_window_models_build_and_their_matmul_count_matches_their_tensors(shape):
    model = shapes.build_random_model(shape, "f32", CPU).model
    specs = model.cache_specs()
    assert {s.window for s in specs if isinstance(s, PagedKVSpec)} == {None, 64}  # mixed windows
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.dim() == 1 and ("norm" in name or "scal" in name):
            assert (p == 1).all(), name
    layers, head = limits.matmul_params(model.config)
    assert layers == _multiplied(model) and head == model.config.hidden_size * model.config.vocab_size


@pytest.mark.parametrize("shape", ["tiny-gemma4-moe", "tiny-laguna"])
def test_quantised_window_moe_models_hold_stacked_quant_experts_and_float_routers(shape):
    loaded = shapes.build_random_model(shape, "q4_k_m", CPU)
    model = loaded.model
    held = [(prefix, v) for prefix, m in model.named_modules() for v in vars(m).values()
            if isinstance(v, QuantTensor)]
    assert held and all(v.shape[0] == model.config.num_experts for _, v in held)
    down = [v for prefix, v in held if v.name.endswith("experts.down_proj")]
    assert down and all(v.qtype.name == "Q6_K" for v in down)
    routers = [p for name, p in model.named_parameters() if name.endswith(("router.proj.weight", "mlp.gate.weight"))]
    assert routers and all(p.dtype == torch.float32 for p in routers)
    assert shapes.describe(loaded, "q4_k_m")["quant_types"]["Q4_K"] > 0
    # decode reads top_k / E of the experts: 2 of 8 here
    sizes = limits.weight_tensors(model)
    experts = sum(v for k, v in sizes.items() if ".experts." in k and not k.endswith("bias"))
    assert experts > 0
    assert limits.weight_bytes_per_token(model) < limits.weight_bytes(model) - experts * 3 // 4 + experts // 100


def test_sliding_layers_read_at_most_their_window_and_hold_only_its_blocks():
    model = shapes.build_random_model("tiny-gemma4", "f32", CPU).model
    specs = model.cache_specs()
    cfg = model.config
    sliding = 2 * cfg.layer_kv_heads[0] * cfg.layer_head_dims[0] * 4  # K and V, f32, per sliding layer
    full = kv_bytes_per_token(model) - 5 * sliding
    assert limits.kv_read_bytes(specs, 40) == kv_bytes_per_token(model) * 40
    assert limits.kv_read_bytes(specs, 1000) == 5 * sliding * 64 + full * 1000
    # held: whole blocks of the full layer, the sliding layers' 64-token window (4 blocks + the partial one)
    assert limits.kv_held_bytes(specs, 1000, 16) == full * 16 * 63 + 5 * sliding * 16 * 5
    assert limits.attended_pairs(10, None) == 55 and limits.attended_pairs(10, 4) == sum(min(t, 4) for t in
                                                                                           range(1, 11))
    flops = limits.prefill_flops(cfg, 100)
    layers, head = limits.matmul_params(cfg)
    heads = cfg.num_heads
    attention = 4 * heads * (5 * 128 * limits.attended_pairs(100, 64) + 256 * limits.attended_pairs(100, None))
    assert flops == 2 * layers * 100 + 2 * head + attention


@pytest.mark.parametrize("shape", ["tiny-gemma4", "tiny-laguna"])
def test_bench_speed_on_a_mixed_window_shape_holds_flat_window_kv_past_the_window(shape, capsys):
    args = speed.default_args(shape=shape, quant="f32", device="cpu", prompt_lens=[48], contexts=[400, 1008],
                              decode_tokens=4, repeats=1, skip=["reference", "spec", "peer"])
    result = speed.run(args)
    loaded = shapes.build_random_model(shape, "f32", CPU)
    specs = loaded.model.cache_specs()
    full = sum(s.bytes_per_token for s in specs if isinstance(s, PagedKVSpec) and s.window is None)
    at = {d["context"]: d for d in result["decode"]}
    # 400 and 1008 are whole blocks: the window groups hold the same blocks at both, the primary 38 more
    assert at[1008]["kv_held_bytes"] - at[400]["kv_held_bytes"] == round(full * 16) * (1008 - 400) // 16
    assert at[1008]["kv_held_bytes"] <= limits.kv_held_bytes(specs, 1008, 16)
    assert at[1008]["kv_held_bytes"] < kv_bytes_per_token(loaded.model) * 1008 / 2  # the windows are not held
    assert at[1008]["kv_read_bytes"] == limits.kv_read_bytes(specs, 1008 + 2.5)
    assert at[1008]["bytes_per_token"] == result["model"]["weight_bytes_per_token"] + at[1008]["kv_read_bytes"]
    assert result["verify"]["ratio"] > 0 and result["forced"]["acceptance"] == 1.0
    assert result["model"]["kv_unbounded_bytes_per_token"] == round(full)
    speed.print_report(result)
    out = capsys.readouterr().out
    assert f"{round(full):,} B of it in full-attention layers" in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.startswith("| decode at context 1,008 |"))
    assert f"KV held {at[1008]['kv_held_bytes'] / 2**20:.3g} MiB" in row


def test_perplexity_forwards_in_chunks_through_every_window_table():
    loaded = shapes.build_random_model("tiny-laguna", "f32", CPU)
    specs = loaded.model.cache_specs()

    def make(step: int) -> LLMEngine:  # a KV budget of one sequence: the window groups hold a window and a step
        budget = kv_tables.pool_bytes(loaded.model, specs, 512, 16, step)
        return LLMEngine.from_args(EngineArgs(model=loaded.source, max_model_len=512, max_num_batched_tokens=step,
                                              enable_prefix_caching=False, max_num_seqs=1, kv_cache_memory=budget),
                                   loaded)
    ids = [(7 * i + 3) % loaded.config.vocab_size for i in range(300)]
    engine, whole = make(32), make(512)
    assert sum(p.num_blocks for p in engine.scheduler.cache.window_pools) < 512 // 16  # less than the context
    chunked = kv_tables.all_logits(engine, ids, 32)  # window blocks released between chunks
    once = kv_tables.all_logits(whole, ids, 300)
    assert chunked.shape == (300, loaded.config.vocab_size)
    torch.testing.assert_close(chunked, once, rtol=1e-4, atol=1e-4)
    assert all(pool.num_free_blocks == pool.num_blocks for pool in [engine.scheduler.blocks,
                                                                   *engine.scheduler.cache.window_pools])
    assert 1 < kv_quality.perplexity(engine, [ids[:200], ids[:90]]) < 10 * loaded.config.vocab_size


def test_kv_shared_layers_read_their_source_cache_and_project_no_kv(monkeypatch):
    types = ["sliding_attention", "full_attention"] * 3
    monkeypatch.setitem(shapes.SHAPES, "tiny-gemma4-shared", dict(shapes.SHAPES["tiny-gemma4"], layer_types=types,
                                                                  num_kv_shared_layers=2, use_double_wide_mlp=True))
    model = shapes.build_random_model("tiny-gemma4-shared", "f32", CPU).model
    assert model.config.kv_sources == [0, 1, 2, 3, 2, 3] and model.config.double_wide_mlp == [False] * 4 + [True] * 2
    layers, _ = limits.matmul_params(model.config)
    assert layers == _multiplied(model)  # no k/v projections in layers 4 and 5, their MLPs twice as wide
    specs = model.cache_specs()
    own = {i: s.bytes_per_token for i, s in enumerate(specs) if isinstance(s, PagedKVSpec)}
    assert sorted(own) == [0, 1, 2, 3] and kv_bytes_per_token(model) == round(sum(own.values()))
    # two own sliding and two own full layers, and layers 4 and 5 read layer 2's (windowed) and 3's KV again
    assert limits.kv_read_bytes(specs, 500) == round(3 * (own[0] * 64 + own[1] * 500))
    assert limits.kv_unbounded_bytes_per_token(specs) == round(3 * own[1])


def test_rows_of_no_whole_super_block_take_llama_cpps_32_value_fallback(monkeypatch):
    # Gemma 4 26B-A4B's expert rows are 2,112 wide: Q4_K_M stores them as Q5_0 / Q8_0, as llama.cpp does
    assert shapes.weight_type("layers.0.mlp.experts.down_proj", "q4_k_m", False, 2112).name == "Q8_0"
    assert shapes.weight_type("layers.0.mlp.experts.gate_up_proj", "q4_k_m", False, 2112).name == "Q5_0"
    assert shapes.weight_type("layers.0.mlp.experts.gate_up_proj", "iq4_xs", False, 2112).name == "IQ4_NL"
    assert shapes.weight_type("layers.0.mlp.experts.gate_up_proj", "q4_k_m", False, 2048).name == "Q4_K"
    monkeypatch.setitem(shapes.SHAPES, "tiny-gemma4-odd", dict(shapes.SHAPES["tiny-gemma4-moe"], moe_intermediate_size=352))
    loaded = shapes.build_random_model("tiny-gemma4-odd", "q4_k_m", CPU)
    down = [v for m in loaded.model.modules() for v in vars(m).values()
            if isinstance(v, QuantTensor) and v.name.endswith("experts.down_proj")]
    assert down and all(v.qtype.name == "Q8_0" and v.shape[-1] == 352 for v in down)
    engine = LLMEngine.from_args(EngineArgs(model=loaded.source, max_model_len=128, enable_prefix_caching=False,
                                            max_num_seqs=1, kv_cache_memory=8 << 20), loaded)
    logits = kv_tables.all_logits(engine, list(range(1, 40)), 16)
    assert logits.shape == (39, loaded.config.vocab_size) and torch.isfinite(logits).all()
