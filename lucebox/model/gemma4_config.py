"""The config.json fields of Gemma 4 text models (HF model_type `gemma4`, `gemma4_text`), by
transformers' Gemma4TextConfig rules:

  layer_types            "sliding_attention" (window `sliding_window`) or "full_attention" per layer
  per-layer sizes        full-attention layers use `global_head_dim` (default 512) and, where
                         `attention_k_eq_v`, `num_global_key_value_heads`; a saved config may spell
                         these as `per_layer_config` {layer: {head_dim, num_key_value_heads}} instead
  rope_parameters        one entry per layer type: "default", or "proportional" (the first
                         partial_rotary_factor of each head's frequencies turn, the rest stay 0)
  num_kv_shared_layers   the last N layers read the K/V of the last earlier layer of their type
  use_double_wide_mlp    those KV-shared layers' MLPs are twice intermediate_size wide
  hidden_size_per_layer_input, vocab_size_per_layer_input: per-layer input embeddings (0: none)
  enable_moe_block       every layer adds a routed MoE (num_experts, top_k_experts,
                         moe_intermediate_size) beside its dense MLP
  final_logit_softcapping  cap * tanh(logits / cap) (None: off)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CheckpointError, UnsupportedError
from .config import ModelConfig, RopeConfig, check_float, check_int

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
ROPE_KINDS = ("default", "proportional")


@dataclass
class RotaryConfig:
    """One layer type's RoPE: the frequencies of `rope` over head_dim, of which only the first
    `fraction` turn (proportional RoPE; 1.0 = all)."""
    rope: RopeConfig
    fraction: float = 1.0


@dataclass
class Gemma4Config(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    kv_sources: list[int] = field(default_factory=list)  # the layer whose K/V layer i reads (i: its own)
    attention_k_eq_v: bool = False  # full-attention layers: v is k's projection (no v_proj)
    rotary: dict[str, RotaryConfig] = field(default_factory=dict)  # per layer type
    double_wide_mlp: list[bool] = field(default_factory=list)
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    final_logit_softcapping: float | None = None

    def validate(self):
        act, self.hidden_act = self.hidden_act, "silu"  # ModelConfig knows SwiGLU only; GELU is checked here
        try:
            super().validate()
        finally:
            self.hidden_act = act
        if act not in GELU_TANH:
            raise UnsupportedError(f"model config: Gemma 4 activation {act!r} is not supported (gelu_pytorch_tanh)")
        for i, (dim, kv) in enumerate(zip(self.layer_head_dims, self.layer_kv_heads)):
            if dim % 2 or self.num_heads % kv:
                raise CheckpointError(f"model config: layer {i}: head_dim {dim} must be even and num_attention_heads "
                                      f"({self.num_heads}) a multiple of its {kv} key/value heads")

    def kind(self, layer: int) -> str:
        return self.layer_types[layer]


def is_gemma4(cfg) -> bool:
    return isinstance(cfg, Gemma4Config)


def gemma4_config(raw: dict) -> Gemma4Config:
    """The text model of a gemma4 (ConditionalGeneration) or gemma4_text config.json."""
    if raw.get("model_type") == "gemma4":
        from .hybrid_config import text_config
        raw = text_config(raw)

    def integer(key, limit, default=None):
        if raw.get(key) is None:
            if default is None:
                raise CheckpointError(f"missing field {key!r}")
            return default
        return check_int(raw[key], limit, key)

    if raw.get("use_bidirectional_attention") == "all":
        raise UnsupportedError("gemma4: use_bidirectional_attention 'all' is not a causal language model")
    layers = integer("num_hidden_layers", "num_layers")
    heads = integer("num_attention_heads", "num_heads")
    hidden = integer("hidden_size", "hidden_size")
    head_dim = integer("head_dim", "head_dim", 256)
    kv_heads = integer("num_key_value_heads", "num_kv_heads", heads)
    types = layer_types(raw, layers)
    dims, kvs = per_layer_sizes(raw, types, head_dim, kv_heads)
    window = integer("sliding_window", "sliding_window", 512)
    shared = integer("num_kv_shared_layers", "count", 0)
    sources = kv_sources(types, shared)
    eos = raw.get("eos_token_id", 1)
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    cap = raw.get("final_logit_softcapping")
    per_layer = integer("hidden_size_per_layer_input", "count", 0)
    return Gemma4Config(
        family="gemma4",
        vocab_size=integer("vocab_size", "vocab_size"),
        hidden_size=hidden,
        intermediate_size=integer("intermediate_size", "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=check_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", "rms_norm_eps"),
        max_position_embeddings=integer("max_position_embeddings", "max_position_embeddings", 131072),
        rope=rotary_configs(raw)[SLIDING if SLIDING in types else FULL].rope,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        sliding_windows=[window if kind == SLIDING else None for kind in types],
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=None if raw.get("bos_token_id") is None else check_int(raw["bos_token_id"], "token_id",
                                                                             "bos_token_id"),
        eos_token_ids=[check_int(i, "token_id", "eos_token_id") for i in eos_ids],
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        **moe_fields(raw, layers),
        layer_types=types,
        layer_head_dims=dims,
        layer_kv_heads=kvs,
        kv_sources=sources,
        attention_k_eq_v=bool(raw.get("attention_k_eq_v", False)),
        rotary={kind: rotary for kind, rotary in rotary_configs(raw).items() if kind in types},
        double_wide_mlp=[bool(raw.get("use_double_wide_mlp")) and sources[i] != i for i in range(layers)],
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=integer("vocab_size_per_layer_input", "vocab_size", 262144) if per_layer else 0,
        final_logit_softcapping=None if cap is None else check_float(cap, "rope_factor", "final_logit_softcapping"),
    )


def layer_types(raw: dict, layers: int) -> list[str]:
    types = raw.get("layer_types")
    if types is None:  # transformers' default: five sliding layers, then one full
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"layer_types must be a list of {layers} entries, got {types!r:.80}")
    for kind in types:
        if kind not in (SLIDING, FULL):
            raise UnsupportedError(f"layer_types: {kind!r} is not a Gemma 4 layer kind ({SLIDING}, {FULL})")
    return [*types[:-1], FULL]  # transformers forces the last layer to full attention


def per_layer_sizes(raw: dict, types: list[str], head_dim: int, kv_heads: int) -> tuple[list[int], list[int]]:
    """(head_dim, kv heads) per layer: the config's, overridden on full-attention layers."""
    overrides = raw.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": raw.get("global_head_dim", 512)}
        if raw.get("attention_k_eq_v", False) and raw.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = raw["num_global_key_value_heads"]
        overrides = {str(i): full for i, kind in enumerate(types) if kind == FULL}
    if not isinstance(overrides, dict):
        raise CheckpointError(f"per_layer_config must be an object, got {overrides!r:.80}")
    dims, kvs = [], []
    for i in range(len(types)):
        layer = overrides.get(str(i), overrides.get(i, {}))
        if not isinstance(layer, dict):
            raise CheckpointError(f"per_layer_config[{i}] must be an object, got {layer!r:.80}")
        dims.append(check_int(layer.get("head_dim", head_dim), "head_dim", f"layer {i} head_dim"))
        kvs.append(check_int(layer.get("num_key_value_heads", kv_heads), "num_kv_heads",
                             f"layer {i} num_key_value_heads"))
    return dims, kvs


def kv_sources(types: list[str], shared: int) -> list[int]:
    """Per layer, the layer whose K/V it attends to: itself, or for the last `shared` layers the last
    layer of the same type before them."""
    first = len(types) - shared
    if first < 1:
        raise CheckpointError(f"num_kv_shared_layers ({shared}) must leave at least one layer that keeps K/V")
    sources = list(range(first))
    for i in range(first, len(types)):
        own = [j for j in range(first) if types[j] == types[i]]
        if not own:
            raise CheckpointError(f"layer {i} ({types[i]}) shares K/V, but no earlier layer of that type keeps any")
        sources.append(own[-1])
    return sources


def rotary_configs(raw: dict) -> dict[str, RotaryConfig]:
    params = raw.get("rope_parameters")
    if params is None:  # transformers' defaults
        params = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                  FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    if not isinstance(params, dict):
        raise CheckpointError(f"rope_parameters must be an object, got {params!r:.80}")
    out = {}
    for kind in (SLIDING, FULL):
        entry = params.get(kind)
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise CheckpointError(f"rope_parameters[{kind!r}] must be an object, got {entry!r:.80}")
        rope_type = entry.get("rope_type", "default")
        if rope_type not in ROPE_KINDS:
            raise UnsupportedError(f"gemma4: rope_type {rope_type!r} for {kind} is not supported "
                                   f"({', '.join(ROPE_KINDS)})")
        theta = check_float(entry.get("rope_theta", 10_000.0), "rope_theta", f"{kind} rope_theta")
        if rope_type == "default":  # transformers' default RoPE of Gemma 4 turns every dim
            out[kind] = RotaryConfig(RopeConfig(theta=theta))
            continue
        factor = check_float(entry.get("factor", 1.0), "rope_factor", f"{kind} rope factor")
        fraction = check_float(entry.get("partial_rotary_factor", 1.0), "rope_factor", f"{kind} partial_rotary_factor")
        rope = RopeConfig(theta=theta, type="linear", factor=factor) if factor != 1.0 else RopeConfig(theta=theta)
        out[kind] = RotaryConfig(rope, min(fraction, 1.0))
    return out


def moe_fields(raw: dict, layers: int) -> dict:
    """ModelConfig's MoE fields: every layer has the routed block beside its MLP when enable_moe_block."""
    if not raw.get("enable_moe_block"):
        return {}
    fields = {}
    for ours, key, limit in (("num_experts", "num_experts", "num_experts"),
                             ("num_experts_per_tok", "top_k_experts", "num_experts"),
                             ("moe_intermediate_size", "moe_intermediate_size", "intermediate_size")):
        if raw.get(key) is None:
            raise CheckpointError(f"enable_moe_block needs field {key!r}")
        fields[ours] = check_int(raw[key], limit, key)
    return dict(fields, norm_topk_prob=True, moe_layers=[True] * layers)

