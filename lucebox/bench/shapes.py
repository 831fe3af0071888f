"""Named real model shapes with random weights, so speed can be measured without downloading them.

`build_random_model("qwen3-8b", "q4_k_m", device)` builds the model directly on the device: float
weights drawn from N(0, 0.02) (norms 1), or QuantLinear / QuantEmbedding modules holding valid
random GGUF blocks (random quant bytes, fp16 scales chosen so values have a std near 0.02). Speed
depends on shapes and storage types only, so these models run exactly the kernels and memory
traffic of the real checkpoints. An 8B model builds in seconds on a GPU (all generated there).
Shapes: dense Qwen3, the Qwen 3.5 / 3.6 hybrids (Gated DeltaNet + gated attention, dense or MoE),
Qwen3-MoE, Gemma 4 (31B dense, 26B-A4B MoE) and Laguna XS.2 (sliding-window and full attention
mixed); quantised stacked experts are QuantTensors (E, out, in).

Quant mixes follow llama.cpp's names. `q4_k_m` / `q5_k_m` approximate llama-quantize's mixes:
Q4_K / Q5_K everywhere except attn_v (and the DeltaNet's attn_qkv, which llama.cpp counts with
it), every ffn_down (dense, shared expert, experts) and the output head (the tied embedding when
the head is tied), which take Q6_K in every layer (llama.cpp gives Q6_K to only some layers'
attn_v / ffn_down, so real files are a little smaller than these). The router, the DeltaNet's
a / b projections and short conv, and 1-D tensors stay float (FLOAT_MATRICES).

Also here, for `lucebox bench speed`: the model under test (a checkpoint or a shape), its
transformers twin (the peer, which shares the lucebox model's tensors) and the record of a run
(device, versions, commit) for the JSON. Bytes and FLOPs a step needs: bench/limits.py.
"""
from __future__ import annotations

import datetime
import math
import platform
import shlex
import sys
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ..errors import RequestError
from ..kernels.dequant import IQ4_KVALUES
from ..model.assign import assign, empty_model, model_class
from ..model.config import ModelConfig
from ..model.loader import LoadedModel
from ..util import on_meta
from ..weights.quant import QuantEmbedding, QuantLinear, QuantTensor
from . import limits

_QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151936, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu", attention_bias=False)
# Qwen 3.5 / 3.6 hybrids: 3 Gated DeltaNet layers to 1 gated full-attention layer, partial rotary 0.25
# (mrope sections apply to vision positions only: text positions are plain RoPE).
_QWEN3_5 = dict(vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
                attention_bias=False, tie_word_embeddings=False, head_dim=256, full_attention_interval=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
SHAPES: dict[str, dict] = {  # HF config.json fields of the real models
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=12288, tie_word_embeddings=False),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=25600, tie_word_embeddings=False),
    # Source: Qwen/Qwen3.5-0.8B's published text config: 24 layers (6 x (3 DeltaNet + 1 attention)), hidden 1024,
    # 8 query / 2 KV heads of 256, FFN 3584, 16 DeltaNet key and value heads, the 248,320-row embedding tied.
    "qwen3.5-0.8b": dict(_QWEN3_5, model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584,
                         num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                         linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
    # Source: Qwen/Qwen3.6-27B (= Qwen3.5-27B architecture) config.json text_config.
    "qwen3.6-27b": dict(_QWEN3_5, model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        linear_num_key_heads=16, linear_num_value_heads=48),
    # Source: Qwen/Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B) config.json text_config; transformers'
    # Qwen3_5MoeTextConfig defaults are the same model.
    "qwen3.6-35b-a3b": dict(_QWEN3_5, model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
    # Source: Qwen/Qwen3-30B-A3B config.json (128 experts, top 8, no shared expert).
    "qwen3-30b-a3b": dict(_QWEN3, model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    # Tests and CPU runs: every dimension a multiple of 256, so the K-quants (256-value blocks) fit.
    "tiny": dict(_QWEN3, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512, vocab_size=512, max_position_embeddings=4096,
                 tie_word_embeddings=False),
}
# Gemma 4: five sliding-window layers (window 1024, head_dim 256) to one full-attention layer (head_dim
# 512, k = v, fewer KV heads, proportional RoPE over a quarter of each head); no per-layer inputs, no KV sharing.
_GEMMA4 = dict(model_type="gemma4_text", vocab_size=262144, max_position_embeddings=262144, rms_norm_eps=1e-6,
               hidden_activation="gelu_pytorch_tanh", attention_bias=False, tie_word_embeddings=True, head_dim=256,
               global_head_dim=512, sliding_window=1024, attention_k_eq_v=True, final_logit_softcapping=30.0,
               hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, bos_token_id=2,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1e6}})


def _every(n: int, layers: int, first: str, rest: str, at: int) -> list[str]:
    """`first` where layer % n == at, else `rest` (Gemma 4: 5 sliding then 1 full; Laguna: 1 full then 3 sliding)."""
    return [first if i % n == at else rest for i in range(layers)]


# Source: google/gemma-4-31B-it config.json text_config, as quoted by public parsers/tests (vLLM/MLX ports):
# 60 layers, hidden 5376, intermediate 21504, 32 heads, 16 KV heads (4 on full layers), window 1024.
SHAPES["gemma4-31b"] = dict(_GEMMA4, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                            num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                            layer_types=_every(6, 60, "full_attention", "sliding_attention", 5))
# Source: google/gemma-4-26B-A4B-it config.json text_config (mlx-community/gemma-4-26b-a4b-it-4bit copy, quoted
# in public tests): 30 layers, hidden 2816, dense MLP 2112 beside 128 experts of 704, top 8, 2 global KV heads.
SHAPES["gemma4-26b-a4b"] = dict(_GEMMA4, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                                num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                                enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                                layer_types=_every(6, 30, "full_attention", "sliding_attention", 5))
# Source: Laguna XS 2.1's config.json as a public adapter test quotes it (transformers' LagunaConfig defaults,
# documented for poolside/laguna-XS.2, agree on every size): 40 layers, every 4th full attention (48 query
# heads) and the rest sliding (window 512, 64 query heads), 8 KV heads of 128, layer 0 dense, 256 experts of
# 512, top 8, a shared expert, routed scaling 2.5, per-head gate. Not found: XS.2's rope_parameters (taken
# from transformers' defaults: full theta 5e5 over half of each head, sliding theta 1e4, no YaRN).
SHAPES["laguna-xs-33b"] = dict(
    model_type="laguna", vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
    num_attention_heads=48, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
    hidden_act="silu", attention_bias=False, tie_word_embeddings=False, sliding_window=512, gating="per-head",
    layer_types=_every(4, 40, "full_attention", "sliding_attention", 0),
    num_attention_heads_per_layer=[48 if i % 4 == 0 else 64 for i in range(40)],
    mlp_layer_types=["dense"] + ["sparse"] * 39, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, moe_routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 1.0}})
# The tiny twins of the hybrid and MoE shapes: every kind of layer, head sizes llama.cpp's kernels take.
_TINY_HYBRID = dict(_QWEN3_5, vocab_size=512, max_position_embeddings=4096, hidden_size=256, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=64, linear_value_head_dim=64)
SHAPES["tiny-hybrid"] = dict(_TINY_HYBRID, model_type="qwen3_5_text", intermediate_size=512)
SHAPES["tiny-hybrid-moe"] = dict(_TINY_HYBRID, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=256, shared_expert_intermediate_size=256)
SHAPES["tiny-moe"] = dict(SHAPES["tiny"], model_type="qwen3_moe", num_attention_heads=2, num_key_value_heads=1,
                          head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                          norm_topk_prob=True)
# Tiny twins of the mixed-window shapes (window 64, so a few hundred tokens pass it; K-quant-sized matrices).
SHAPES["tiny-gemma4"] = dict(_GEMMA4, vocab_size=512, max_position_embeddings=4096, hidden_size=256,
                             intermediate_size=512, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                             num_global_key_value_heads=1, head_dim=128, global_head_dim=256, sliding_window=64,
                             layer_types=_every(6, 6, "full_attention", "sliding_attention", 5))
SHAPES["tiny-gemma4-moe"] = dict(SHAPES["tiny-gemma4"], enable_moe_block=True, num_experts=8, top_k_experts=2,
                                 moe_intermediate_size=256)
SHAPES["tiny-laguna"] = dict(SHAPES["laguna-xs-33b"], vocab_size=512, max_position_embeddings=4096, hidden_size=256,
                             intermediate_size=512, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                             sliding_window=64, layer_types=_every(4, 4, "full_attention", "sliding_attention", 0),
                             num_attention_heads_per_layer=[2, 4, 4, 4], mlp_layer_types=["dense"] + ["sparse"] * 3,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                             shared_expert_intermediate_size=256)

FLOAT_QUANTS = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
# name -> (type of most matrices, type of attn_v / ffn_down / output head)
QUANT_MIXES = {
    "q8_0": (Q.Q8_0, Q.Q8_0), "q4_0": (Q.Q4_0, Q.Q4_0), "q4_k": (Q.Q4_K, Q.Q4_K), "q4_k_m": (Q.Q4_K, Q.Q6_K),
    "q5_k": (Q.Q5_K, Q.Q5_K), "q5_k_m": (Q.Q5_K, Q.Q6_K), "q6_k": (Q.Q6_K, Q.Q6_K), "iq4_xs": (Q.IQ4_XS, Q.IQ4_XS),
}
QUANTS = tuple(FLOAT_QUANTS) + tuple(QUANT_MIXES)
STD = 0.02


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise RequestError(f"--shape {name!r} is not a named shape; choose one of: {', '.join(SHAPES)}")
    return ModelConfig.from_hf_dict(SHAPES[name])


def check_quant(quant: str) -> str:
    key = quant.strip().lower()
    if key not in QUANTS:
        raise RequestError(f"--quant {quant!r} is not a weight type the random builder knows; "
                           f"choose one of: {', '.join(QUANTS)}")
    return key


def _uniform_rms(values) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def _k_quant_std(levels: int) -> float:
    """Std of d = 1 affine K-quant values, sc * q - mean(q) * m with sc, m, q uniform: that is
    sc * (q - mean q) + mean q * (sc - m), whose two terms are uncorrelated."""
    mean_q = (levels - 1) / 2
    return math.sqrt(_RMS_6BIT ** 2 * _uniform_rms([q - mean_q for q in range(levels)]) ** 2
                     + 2 * mean_q ** 2 * _uniform_rms([s - 31.5 for s in range(64)]) ** 2)


_RMS_6BIT = _uniform_rms(range(64))  # K-quant sub-block scales / mins: 6-bit, 0..63
_RMS_INT8 = _uniform_rms(range(-128, 128))
# qtype -> (byte offset of the fp16 super-scale d, std of d = 1 values, offset of dmin or None, mean q)
# The std of a symmetric value with d = 1 is the rms of its sub-scale times the rms of its quant;
# dmin is set to d * mean(q) so the affine K-quants come out centred on average.
_LAYOUT = {
    Q.Q8_0: (0, _RMS_INT8, None, 0.0),
    Q.Q4_0: (0, _uniform_rms(range(-8, 8)), None, 0.0),
    Q.Q5_0: (0, _uniform_rms(range(-16, 16)), None, 0.0),
    Q.IQ4_NL: (0, _uniform_rms(IQ4_KVALUES), None, 0.0),
    Q.Q4_K: (0, _k_quant_std(16), 2, 7.5),
    Q.Q5_K: (0, _k_quant_std(32), 2, 15.5),
    Q.Q6_K: (208, _RMS_INT8 * _uniform_rms(range(-32, 32)), None, 0.0),
    Q.IQ4_XS: (0, _uniform_rms(range(-32, 32)) * _uniform_rms(IQ4_KVALUES), None, 0.0),
}


def random_quant_tensor(qtype: Q, rows: int, cols: int, device, name: str = "", std: float = STD) -> QuantTensor:
    """Valid random GGUF blocks of `qtype` for a [rows, cols] matrix: every byte random except the
    fp16 super-scales, which are drawn so the dequantised values have a std near `std`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise RequestError(f"{name}: {cols} columns are not a whole number of {qtype.name} blocks of {block}")
    offset, unit_std, dmin_offset, mean_q = _LAYOUT[qtype]
    blocks = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, device=device)
    d = (std / unit_std) * (0.5 + torch.rand(rows, cols // block, device=device))  # jitter: no two blocks alike
    blocks[..., offset:offset + 2] = d.to(torch.float16).view(torch.uint8).view(rows, -1, 2)
    if dmin_offset is not None:
        # mins are 6-bit like the scales, so mean(dmin * m) = mean(d * sc) * mean_q
        dmin = (d * mean_q).to(torch.float16)
        blocks[..., dmin_offset:dmin_offset + 2] = dmin.view(torch.uint8).view(rows, -1, 2)
    return QuantTensor(blocks.view(rows, -1), qtype, (rows, cols), name)


# Matrices llama.cpp keeps in float in its quantised files (its routers, Qwen's and Gemma 4's, the DeltaNet's
# per-head a / b projections and short conv; Laguna's per-head gate, a few rows, is assumed float too);
# 1-D tensors (norms, scales, A_log, dt_bias) are float everywhere.
FLOAT_MATRICES = ("mlp.gate.weight", "shared_expert_gate.weight", "linear_attn.in_proj_a.weight",
                  "linear_attn.in_proj_b.weight", "linear_attn.conv1d.weight", "router.proj.weight",
                  "self_attn.g_proj.weight")
# attn_v-like (llama.cpp counts attn_qkv as one), ffn_down of every kind: Q6_K in a Q4_K_M / Q5_K_M mix.
SPECIAL_MATRICES = ("self_attn.v_proj.weight", "linear_attn.in_proj_qkv.weight", "mlp.down_proj.weight",
                    "shared_expert.down_proj.weight", "experts.down_proj")
# 1-D multipliers that are 1 at rest (RMSNorm weights, Gemma 4's layer scalar and router scales).
_UNIT = ("norm", "scal")


def is_quantised(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF quant mix stores this (our-named) weight quantised: matrices and stacked experts."""
    return len(shape) >= 2 and not name.endswith(FLOAT_MATRICES)


# llama.cpp's quantiser stores a row that is not a whole number of 256-value super-blocks (Gemma 4
# 26B-A4B's 2,112-wide expert rows) in a 32-value type of about the same size
_ROW_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_0, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}


def weight_type(name: str, quant: str, tied: bool, cols: int) -> Q:
    """The GGUF type of a quantised weight of `cols` columns in the `quant` mix."""
    main, special = QUANT_MIXES[quant]
    head = name == "lm_head.weight" or (tied and name == "embed_tokens.weight")
    qtype = special if head or name.endswith(SPECIAL_MATRICES) else main
    if cols % GGML_QUANT_SIZES[qtype][0]:
        return _ROW_FALLBACK.get(qtype, qtype)
    return qtype


def random_tokenizer(vocab_size: int):
    """A real tokenizer over the whole vocabulary (token i is the word `t<i>`), so the engine's
    detokenizer does the work it does for a real model at every step."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from ..text.tokenizer import Tokenizer
    backend = Backend(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, name=f"random word-level vocabulary of {vocab_size}")


@torch.no_grad()
def build_random_model(shape: str, quant: str, device: torch.device, dtype: torch.dtype | None = None,
                       seed: int = 0) -> LoadedModel:
    """The named shape with random weights in `quant` storage, built on `device`.

    dtype: activation dtype; float quants (bf16 / f16 / f32) fix it, GGUF quants default to
    bfloat16 on GPU and float32 on CPU. Quantised stacked experts are QuantTensors (E, out, in)
    whose data is [E * out, row bytes], put in place by model/assign like a GGUF file's."""
    cfg = shape_config(shape)
    quant = check_quant(quant)
    device = torch.device(device)
    torch.manual_seed(seed)
    if quant in FLOAT_QUANTS:
        dtype = FLOAT_QUANTS[quant]
        model = empty_model(cfg, dtype, device)
        for name, p in model.named_parameters():
            if is_unit(name, p):
                p.fill_(1.0)
            else:
                p.normal_(0.0, STD)
    else:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        with on_meta():  # no float copy of the quantised matrices is ever allocated
            model = model_class(cfg)(cfg).to(dtype)
        tensors = _random_quant_tensors(model, cfg, quant, device, dtype)
        assign(model, tensors, f"random {shape} {quant}", dtype, device)
    model.eval()
    return LoadedModel(model, random_tokenizer(cfg.vocab_size), cfg, f"random {shape} ({quant})", "random")


def is_unit(name: str, p) -> bool:
    return p.dim() == 1 and any(word in name for word in _UNIT)


def _random_quant_tensors(model, cfg: ModelConfig, quant: str, device, dtype):
    for name, p in list(model.named_parameters()):  # assign replaces parameters while this runs
        if is_quantised(name, tuple(p.shape)):
            rows, cols = math.prod(p.shape[:-1]), p.shape[-1]
            qt = random_quant_tensor(weight_type(name, quant, cfg.tie_word_embeddings, cols), rows, cols, device, name)
            if p.dim() > 2:  # stacked experts: (E, out, in) over [E * out, row bytes]
                yield name, QuantTensor(qt.data, qt.qtype, tuple(p.shape), name)
            else:
                yield name, (QuantEmbedding(qt, dtype) if name == "embed_tokens.weight" else QuantLinear(qt))
        elif is_unit(name, p):
            yield name, torch.ones(p.shape, dtype=dtype, device=device)
        else:  # the router, DeltaNet's a / b / conv / A_log / dt_bias, biases
            yield name, torch.randn(p.shape, device=device).mul_(STD).to(dtype)


# ---------------------------------------------------------------------------- the model under test
def load_under_test(model: str | None, shape: str | None, quant: str | None, dtype: str, device: torch.device,
                    seed: int = 0) -> tuple[LoadedModel, str]:
    """A checkpoint (--model; the default model when neither is given) or a random --shape.
    Returns the model and its weight label: bf16 / f16 / f32, a GGUF mix name, or `gguf`."""
    from ..model.loader import load_model, resolve_dtype
    if model and shape:
        raise RequestError("give --model or --shape, not both")
    if shape:
        quant = check_quant(quant or "bf16")
        act = None if dtype == "auto" else resolve_dtype(dtype, None, device)
        return build_random_model(shape, quant, device, act, seed=seed), quant
    if quant:
        raise RequestError("--quant applies to --shape; a --model keeps its checkpoint's weight types")
    if model is None:
        from ..default_model import default_model_path
        model = str(default_model_path())
    loaded = load_model(model, dtype=dtype, device=str(device))
    if any(isinstance(m, QuantLinear) for m in loaded.model.modules()):
        return loaded, "gguf"
    return loaded, {v: k for k, v in FLOAT_QUANTS.items()}[loaded.model.dtype]


def describe(loaded: LoadedModel, quant: str) -> dict:
    model, qtypes = loaded.model, {}
    for m in model.modules():
        held = [m.qtype] if isinstance(m, (QuantLinear, QuantEmbedding)) else []
        held += [v.qtype for v in vars(m).values() if isinstance(v, QuantTensor)]  # stacked quantised experts
        for qtype in held:
            qtypes[qtype.name] = qtypes.get(qtype.name, 0) + 1
    return {"source": loaded.source, "quant": quant, "quant_types": qtypes, "config": loaded.config.to_dict(),
            "dtype": str(model.dtype).removeprefix("torch."), "weight_bytes": limits.weight_bytes(model),
            "weight_bytes_per_token": limits.weight_bytes_per_token(model),
            "state_bytes_per_token": limits.state_bytes_per_token(model)}


# ---------------------------------------------------------------------------- the record of a run
def version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or a broken install
        return None


def _commit() -> str | None:
    """The checkout's commit, read from .git without running git (None on a copy without .git)."""
    git = Path(__file__).resolve().parents[2] / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head  # a detached HEAD names the commit itself
        ref = head.removeprefix("ref: ")
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        return next((x.split()[0] for x in (git / "packed-refs").read_text().splitlines() if x.endswith(" " + ref)),
                    None)
    except OSError:
        return None


def run_metadata(args, device: torch.device) -> dict:
    """Where and how a benchmark ran: device, versions, commit, date, the exact command and options."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": version("triton"), "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([_program(sys.argv[0]), shlex.join(sys.argv[1:])]), "args": dict(vars(args))}


def _program(argv0: str) -> str:
    """`python -m lucebox.cli` shows up as the path of cli.py: say it the way it was typed."""
    return "python -m lucebox.cli" if Path(argv0).parts[-2:] == ("lucebox", "cli.py") else argv0
