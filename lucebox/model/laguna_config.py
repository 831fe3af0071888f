"""The config.json fields of Poolside's Laguna (HF model_type `laguna`), as transformers' LagunaConfig
reads them (model/config.py's from_hf_dict calls these).

Beyond the generic fields: per-layer query-head counts (`num_attention_heads_per_layer`; KV heads are
shared by all layers), the attention output gate's granularity (`gating`), RoPE parameters per layer
kind (`rope_parameters` keyed by `full_attention` / `sliding_attention`, each with its own
`partial_rotary_factor`, YaRN where set), dense or sparse FFN per layer (`mlp_layer_types`) and the
router: sigmoid scores (softmax where `moe_router_use_sigmoid` is false), an expert-selection bias,
logit soft-capping, a routed scaling factor, weights applied on the experts' input.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CheckpointError, UnsupportedError
from .config import ROPE_TYPES, ModelConfig, RopeConfig, check_float, check_int, hf_rope
from .moe import Routing

FULL, SLIDING = "full_attention", "sliding_attention"
MLP_KINDS = ("dense", "sparse")
# transformers' defaults where config.json has no rope_parameters.
DEFAULT_ROPE = {FULL: {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}


@dataclass
class LagunaConfig(ModelConfig):
    """ModelConfig plus Laguna's per-layer fields. `rope` / `partial_rotary_factor` are the full-attention
    layers' RoPE; `sliding_rope` / `sliding_partial_rotary_factor` the sliding-window layers'."""
    attention_kinds: list[str] = field(default_factory=list)  # per layer: full_attention / sliding_attention
    heads_per_layer: list[int] = field(default_factory=list)  # query heads of each layer
    gate_per_head: bool = True  # softplus output gate: one per head, or one per (head, channel)
    sliding_rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_partial_rotary_factor: float = 1.0
    router_sigmoid: bool = True
    router_logit_softcap: float = 0.0
    routed_scaling_factor: float = 1.0
    router_weights_on_input: bool = False

    def validate(self):
        super().validate()
        if len(self.attention_kinds) != self.num_layers or len(self.heads_per_layer) != self.num_layers:
            raise CheckpointError(f"model config: layer_types and num_attention_heads_per_layer need "
                                  f"{self.num_layers} entries each")
        for i, heads in enumerate(self.heads_per_layer):
            check_int(heads, "num_heads", f"num_attention_heads_per_layer[{i}]")
            if heads % self.num_kv_heads:
                raise CheckpointError(f"num_attention_heads_per_layer[{i}] ({heads}) must be a multiple of "
                                      f"num_key_value_heads ({self.num_kv_heads})")
        if self.sliding_rope.type not in ROPE_TYPES:
            raise UnsupportedError(f"model config: RoPE scaling type {self.sliding_rope.type!r} (sliding_attention) "
                                   f"is not supported (supported: {', '.join(ROPE_TYPES)})")

    def is_sliding(self, layer: int) -> bool:
        return self.attention_kinds[layer] == SLIDING

    def rope_of(self, kind: str) -> tuple[RopeConfig, float]:
        """(RoPE parameters, partial rotary factor) of a layer kind."""
        if kind == SLIDING:
            return self.sliding_rope, self.sliding_partial_rotary_factor
        return self.rope, self.partial_rotary_factor

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, self.norm_topk_prob,
                       "sigmoid" if self.router_sigmoid else "softmax", self.router_logit_softcap,
                       selection_bias=True, routed_scaling_factor=self.routed_scaling_factor,
                       weights_on_input=self.router_weights_on_input)


def laguna_raw(raw: dict) -> dict:
    """The config as the generic reader takes it: the full-attention layers' RoPE as `rope_parameters`,
    `mlp_layer_types` as Qwen-MoE's `mlp_only_layers`, top-k weights renormalised unless said otherwise."""
    layers = check_int(raw.get("num_hidden_layers"), "num_layers", "num_hidden_layers")
    kinds = _per_layer(raw, "mlp_layer_types", ["dense"] + ["sparse"] * (layers - 1), layers, MLP_KINDS)
    out = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta", "partial_rotary_factor")}
    out["rope_parameters"] = _rope_params(raw, _attention_kinds(raw, layers))[0][0]
    out["mlp_only_layers"] = [i for i, kind in enumerate(kinds) if kind == "dense"]
    out["decoder_sparse_step"] = 1
    out.setdefault("norm_topk_prob", True)
    return out


def laguna_fields(raw: dict) -> dict:
    """LagunaConfig's own fields (and the full-attention layers' partial rotary factor)."""
    layers = check_int(raw.get("num_hidden_layers"), "num_layers", "num_hidden_layers")
    for key, supported in (("swa_attention_sink_enabled", False), ("rope_style", "rotate-half")):
        if raw.get(key, supported) != supported:
            raise UnsupportedError(f"laguna: {key}={raw[key]!r} is not supported")
    kinds = _attention_kinds(raw, layers)
    (_, full_factor), (sliding, sliding_factor) = _rope_params(raw, kinds)
    heads = raw.get("num_attention_heads_per_layer")
    if heads is None:
        heads = [raw.get("num_attention_heads")] * layers
    if not isinstance(heads, list) or len(heads) != layers:
        raise CheckpointError(f"num_attention_heads_per_layer must be a list of {layers} entries, got {heads!r:.80}")
    gating = raw.get("gating", True)
    if gating not in (True, False, "per-head", "per-element"):
        raise UnsupportedError(f"laguna: gating={gating!r} is not supported (true, per-head or per-element)")
    softcap = raw.get("moe_router_logit_softcapping") or 0.0
    return dict(
        attention_kinds=kinds, heads_per_layer=[check_int(h, "num_heads", "num_attention_heads_per_layer")
                                                for h in heads],
        gate_per_head=gating in (True, "per-head"),  # transformers: anything else is per element
        partial_rotary_factor=full_factor, sliding_rope=sliding, sliding_partial_rotary_factor=sliding_factor,
        router_sigmoid=bool(raw.get("moe_router_use_sigmoid", True)),
        router_logit_softcap=check_float(softcap, "rope_parameter", "moe_router_logit_softcapping") if softcap else 0.0,
        routed_scaling_factor=check_float(raw.get("moe_routed_scaling_factor", 1.0), "rope_factor",
                                          "moe_routed_scaling_factor"),
        router_weights_on_input=bool(raw.get("moe_apply_router_weight_on_input", False)),
    )


def _attention_kinds(raw: dict, layers: int) -> list[str]:
    return _per_layer(raw, "layer_types", [FULL] * layers, layers, (FULL, SLIDING))


def _per_layer(raw: dict, key: str, default: list[str], layers: int, allowed: tuple[str, ...]) -> list[str]:
    kinds = raw.get(key)
    if kinds is None:
        return default
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise CheckpointError(f"{key} must be a list of {layers} entries, got {kinds!r:.80}")
    for kind in kinds:
        if kind not in allowed:
            raise UnsupportedError(f"{key}: {kind!r} is not a supported kind ({', '.join(allowed)})")
    return list(kinds)


def _rope_params(raw: dict, kinds: list[str]) -> tuple[tuple[dict, float], tuple[RopeConfig, float]]:
    """((the full-attention layers' rope_parameters, their partial rotary factor), (the sliding layers'
    RopeConfig, their factor)); a kind no layer has falls back to the other's."""
    params = raw.get("rope_parameters")
    if params is None:
        params = DEFAULT_ROPE
    if not isinstance(params, dict):
        raise CheckpointError(f"rope_parameters must be an object, got {params!r:.80}")
    by_kind = {}
    for kind in (FULL, SLIDING):
        entry = params.get(kind)
        if entry is None and kind in kinds:
            raise CheckpointError(f"rope_parameters has no {kind!r} entry, but layer_types has {kind} layers")
        if entry is not None and not isinstance(entry, dict):
            raise CheckpointError(f"rope_parameters[{kind!r}] must be an object, got {entry!r:.80}")
        by_kind[kind] = entry
    full = by_kind[FULL] or by_kind[SLIDING]
    sliding = by_kind[SLIDING] or full

    def factor(entry: dict) -> float:
        return check_float(entry.get("partial_rotary_factor", 1.0), "rope_factor", "partial_rotary_factor")

    context = {"max_position_embeddings": raw.get("max_position_embeddings")}
    sliding_rope = hf_rope({**context, "rope_parameters": sliding})
    return (full, factor(full)), (sliding_rope, factor(sliding))
