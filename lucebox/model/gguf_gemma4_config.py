"""llama.cpp's `gemma4` metadata -> Gemma4Config, and the keys the converter writes (same spelling both
ways; llama.cpp reads them in src/models/gemma4.cpp, its converter writes them in conversion/gemma.py).

  gemma4.attention.sliding_window_pattern      one bool per layer: sliding (true) or full attention
  gemma4.attention.key_length / value_length   the full-attention layers' head size;
  gemma4.attention.key_length_swa / _swa       the sliding layers'
  gemma4.attention.head_count_kv               one count, or one per layer (full layers may have fewer)
  gemma4.attention.shared_kv_layers            the last N layers keep no K/V (they read an earlier layer's)
  gemma4.feed_forward_length                   one width, or one per layer (double-wide MLPs of shared layers)
  gemma4.rope.freq_base / freq_base_swa        full / sliding RoPE theta
  gemma4.rope.dimension_count / _swa           rotary dims: the whole head (proportional RoPE travels as
                                               the rope_freqs tensor: factor 1 for pairs that turn, 1e30
                                               for those that stay put)
  gemma4.embedding_length_per_layer_input      per-layer input embedding width (0: none)
  gemma4.expert_count / expert_used_count / expert_feed_forward_length   the MoE block (26B-A4B)
  gemma4.final_logit_softcapping               logit soft-cap (absent: none)
"""
from __future__ import annotations

import logging

import numpy as np

from ..errors import CheckpointError, UnsupportedError
from .config import RopeConfig, check_int
from .gemma4_config import FULL, SLIDING, Gemma4Config, RotaryConfig, kv_sources
from .gguf_config import Metadata, rope_config

log = logging.getLogger("lucebox")

ARCH = "gemma4"
UNROTATED = 1e30  # llama.cpp's frequency factor of a pair that does not turn (proportional RoPE)


def gemma4_model_config(meta: Metadata, shapes: dict[str, tuple[int, ...]],
                        rope_freqs: np.ndarray | None) -> Gemma4Config:
    """Gemma4Config of a gemma4 file; `shapes`: GGUF tensor name -> shape; `rope_freqs`: that tensor's values."""
    def key(suffix):
        return f"{ARCH}.{suffix}"

    layers = meta.integer(key("block_count"), required=True, limit="num_layers")
    hidden = meta.integer(key("embedding_length"), required=True, limit="hidden_size")
    heads = meta.integer(key("attention.head_count"), required=True, limit="num_heads")
    types = _layer_types(meta, layers)
    full_dim = meta.integer(key("attention.key_length"), required=True, limit="head_dim")
    swa_dim = meta.integer(key("attention.key_length_swa"), full_dim, limit="head_dim")
    for suffix, want in (("", full_dim), ("_swa", swa_dim)):
        if meta.integer(key(f"attention.value_length{suffix}"), want, limit="head_dim") != want:
            raise UnsupportedError(f"{meta.path}: {key(f'attention.value_length{suffix}')} differs from "
                                   f"{key(f'attention.key_length{suffix}')} (Gemma 4 needs them equal)")
        if meta.integer(key(f"rope.dimension_count{suffix}"), want, limit="head_dim") != want:
            raise UnsupportedError(f"{meta.path}: {key(f'rope.dimension_count{suffix}')} is not the head size "
                                   f"({want}); Gemma 4's partial RoPE travels as rope_freqs, no other form is read")
    dims = [swa_dim if kind == SLIDING else full_dim for kind in types]
    kv_heads = _per_layer(meta, key("attention.head_count_kv"), layers, heads, "num_kv_heads")
    if any(heads % kv for kv in kv_heads):
        raise CheckpointError(f"{meta.path}: {key('attention.head_count')} ({heads}) must be a multiple of every "
                              f"layer's {key('attention.head_count_kv')}, got {kv_heads}")
    shared = meta.integer(key("attention.shared_kv_layers"), 0, limit="count")
    try:
        sources = kv_sources(types, shared)
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {key('attention.shared_kv_layers')} ({shared}): {e}") from None
    widths = _per_layer(meta, key("feed_forward_length"), layers, None, "intermediate_size")
    double = _double_wide(meta, widths, sources)
    context = meta.integer(key("context_length"), required=True, limit="max_position_embeddings")
    window = meta.integer(key("attention.sliding_window"), required=True, limit="sliding_window") \
        if SLIDING in types else None
    per_layer = meta.integer(key("embedding_length_per_layer_input"), 0, limit="count")
    cap = meta.number(key("final_logit_softcapping"), None, limit="rope_factor")
    vocab = (meta.integer(key("vocab_size"), None, limit="vocab_size") or meta.array_len("tokenizer.ggml.tokens")
             or shapes.get("token_embd.weight", (0,))[0])
    eos = [meta.integer(f"tokenizer.ggml.{k}_token_id", limit="token_id") for k in ("eos", "eot", "eom")]
    non_shared_full = [i for i, kind in enumerate(types) if kind == FULL and sources[i] == i]
    try:
        return Gemma4Config(
            family="gemma4", vocab_size=vocab, hidden_size=hidden, intermediate_size=widths[0], num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads[types.index(SLIDING) if SLIDING in types else 0],
            head_dim=dims[types.index(SLIDING) if SLIDING in types else 0], max_position_embeddings=context,
            rms_norm_eps=meta.number(key("attention.layer_norm_rms_epsilon"), required=True, limit="rms_norm_eps"),
            rope=RopeConfig(theta=_swa_theta(meta)), tie_word_embeddings="output.weight" not in shapes,
            sliding_windows=[window if kind == SLIDING else None for kind in types], hidden_act="gelu_pytorch_tanh",
            bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", limit="token_id"),
            eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
            qkv_bias="blk.0.attn_q.bias" in shapes, o_bias="blk.0.attn_output.bias" in shapes,
            **_moe_fields(meta, layers, shapes),
            layer_types=types, layer_head_dims=dims, layer_kv_heads=kv_heads, kv_sources=sources,
            # llama.cpp's rule (use_alternative_attention): a full layer without attn_v takes v from k
            attention_k_eq_v=bool(non_shared_full) and f"blk.{non_shared_full[0]}.attn_v.weight" not in shapes,
            rotary=_rotary(meta, types, full_dim, rope_freqs, context), double_wide_mlp=double,
            hidden_size_per_layer_input=per_layer,
            vocab_size_per_layer_input=shapes.get("per_layer_token_embd.weight", (vocab,))[0] if per_layer else 0,
            final_logit_softcapping=cap or None)
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {e}") from None


def _layer_types(meta: Metadata, layers: int) -> list[str]:
    name = f"{ARCH}.attention.sliding_window_pattern"
    pattern = meta.need(name)
    if not isinstance(pattern, list) or len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
        raise CheckpointError(f"{meta.path}: {name} should hold a boolean for each of the {layers} layers, "
                              f"got {pattern!r:.80}")
    return [SLIDING if p else FULL for p in pattern]


def _per_layer(meta: Metadata, name: str, layers: int, default: int | None, limit: str) -> list[int]:
    """A key given once or once per layer, as one value per layer."""
    value = meta.get(name, default)
    if value is None:
        raise CheckpointError(f"{meta.path}: required metadata key {name} is missing")
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise CheckpointError(f"{meta.path}: {name} has {len(values)} entries for {layers} layers")
    try:
        return [check_int(v, limit, f"every entry of metadata key {name}") for v in values]
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {e}") from None


def _double_wide(meta: Metadata, widths: list[int], sources: list[int]) -> list[bool]:
    """llama.cpp's per-layer FFN widths as transformers' use_double_wide_mlp: twice the width on KV-shared layers."""
    base = widths[0]
    double = [w == 2 * base and sources[i] != i for i, w in enumerate(widths)]
    if any(w != (2 * base if d else base) for w, d in zip(widths, double)):
        raise UnsupportedError(f"{meta.path}: {ARCH}.feed_forward_length {widths} is neither one width nor twice it "
                               "on the KV-shared layers (use_double_wide_mlp)")
    return double


def _swa_theta(meta: Metadata) -> float:
    full = meta.number(f"{ARCH}.rope.freq_base", 10_000.0, limit="rope_theta")
    return meta.number(f"{ARCH}.rope.freq_base_swa", full, limit="rope_theta")  # llama.cpp's default: the same


def _rotary(meta: Metadata, types: list[str], full_dim: int, freqs: np.ndarray | None, context: int) -> dict:
    rope = rope_config(meta, ARCH, context)
    if rope.type != "default":
        raise UnsupportedError(f"{meta.path}: RoPE scaling ({ARCH}.rope.scaling.type {rope.type}) is not supported "
                               "for gemma4")
    out = {}
    if SLIDING in types:
        out[SLIDING] = RotaryConfig(RopeConfig(theta=_swa_theta(meta)))
    if FULL in types:
        out[FULL] = RotaryConfig(rope, _turning_fraction(meta, freqs, full_dim))
    return out


def _turning_fraction(meta: Metadata, freqs: np.ndarray | None, head_dim: int) -> float:
    """rope_freqs [head_dim / 2] -> the fraction of the full layers' head that turns."""
    if freqs is None:
        raise CheckpointError(f"{meta.path}: missing tensor rope_freqs.weight (the full-attention layers' RoPE)")
    if freqs.shape != (head_dim // 2,):
        raise CheckpointError(f"{meta.path}: tensor rope_freqs.weight has shape {list(freqs.shape)}, but "
                              f"{ARCH}.attention.key_length ({head_dim}) makes it [{head_dim // 2}]")
    turning = int((freqs == 1.0).sum())
    if not (freqs[:turning] == 1.0).all() or not (freqs[turning:] >= UNROTATED / 10).all():
        raise UnsupportedError(f"{meta.path}: tensor rope_freqs.weight holds factors other than 1 (pairs that turn, "
                               "first) and 1e30 (pairs that stay put); lucebox reads only Gemma 4's proportional RoPE")
    return (2 * turning + 0.5) / head_dim  # a hair above, so the model's int(fraction * head_dim) // 2 is `turning`


def _moe_fields(meta: Metadata, layers: int, shapes) -> dict:
    experts = meta.integer(f"{ARCH}.expert_count", 0, limit="count")
    if not experts:
        return {}
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in shapes for i in range(layers)]
    return dict(num_experts=meta.integer(f"{ARCH}.expert_count", limit="num_experts"),
                num_experts_per_tok=meta.integer(f"{ARCH}.expert_used_count", required=True, limit="num_experts"),
                moe_intermediate_size=meta.integer(f"{ARCH}.expert_feed_forward_length", required=True,
                                                   limit="intermediate_size"),
                norm_topk_prob=True, moe_layers=sparse)


# ------------------------------------------------------------------------------------------- writing
def rope_freqs(cfg: Gemma4Config) -> np.ndarray | None:
    """The rope_freqs tensor of the full-attention layers (None without any)."""
    if FULL not in cfg.rotary:
        return None
    head_dim = cfg.layer_head_dims[cfg.layer_types.index(FULL)]
    half, turning = head_dim // 2, int(cfg.rotary[FULL].fraction * head_dim // 2)  # as gemma4.rope_table turns them
    return np.array([1.0] * turning + [UNROTATED] * (half - turning), dtype=np.float32)


def write_gemma4_keys(w, cfg: Gemma4Config) -> None:
    """The gemma4 keys over convert.write_shape_metadata's dense ones (which it replaces where Gemma 4's
    differ: head sizes and RoPE per layer type, per-layer K/V heads and FFN widths)."""
    for rotary in cfg.rotary.values():
        if rotary.rope.type != "default":
            raise UnsupportedError(f"gemma4: RoPE scaling ({rotary.rope.type}) has no gemma4 GGUF keys lucebox writes")
    first_shared = next((i for i, s in enumerate(cfg.kv_sources) if s != i), cfg.num_layers)
    llama_rule = [i if i < first_shared else first_shared - (2 if kind == SLIDING else 1)
                  for i, kind in enumerate(cfg.layer_types)]
    if llama_rule != cfg.kv_sources:
        log.warning("gemma4: the KV-shared layers read layers %s; lucebox reads that back, but llama.cpp assumes the "
                    "last two layers that keep K/V are sliding then full and reads %s", cfg.kv_sources, llama_rule)
    if cfg.hidden_size_per_layer_input and cfg.vocab_size_per_layer_input != cfg.vocab_size:
        log.warning("gemma4: the per-layer embedding has %d rows, the vocabulary %d; lucebox reads that back, but "
                    "llama.cpp expects one row per token", cfg.vocab_size_per_layer_input, cfg.vocab_size)
    types = cfg.layer_types
    full = cfg.layer_head_dims[types.index(FULL)] if FULL in types else cfg.head_dim
    swa = cfg.layer_head_dims[types.index(SLIDING)] if SLIDING in types else full
    widths = [cfg.intermediate_size * (2 if d else 1) for d in cfg.double_wide_mlp]
    replaced = ("attention.key_length", "attention.value_length", "attention.head_count_kv", "feed_forward_length",
                "rope.dimension_count", "rope.freq_base", "attention.sliding_window",
                "attention.sliding_window_pattern")
    for suffix in replaced:
        w.kv_data[0].pop(f"{ARCH}.{suffix}", None)
    w.add_key_length(full)
    w.add_value_length(full)
    w.add_key_length_swa(swa)
    w.add_value_length_swa(swa)
    w.add_head_count_kv(cfg.num_kv_heads if len(set(cfg.layer_kv_heads)) == 1 else list(cfg.layer_kv_heads))
    w.add_feed_forward_length(widths[0] if len(set(widths)) == 1 else widths)
    w.add_rope_dimension_count(full)
    w.add_rope_dimension_count_swa(swa)
    w.add_rope_freq_base(cfg.rotary[FULL].rope.theta if FULL in cfg.rotary else cfg.rope.theta)
    if SLIDING in cfg.rotary:
        w.add_rope_freq_base_swa(cfg.rotary[SLIDING].rope.theta)
    w.add_sliding_window(next((win for win in cfg.sliding_windows if win), 0))
    w.add_sliding_window_pattern([kind == SLIDING for kind in types])
    w.add_shared_kv_layers(cfg.num_layers - first_shared)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
