"""ModelConfig: one arch-agnostic description of a decoder-only transformer.

Built from a HF config.json or from GGUF metadata; the transformer reads only this, so a new
family is a new `from_*` mapping, never a new model file.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, UnsupportedError

# HF model_type -> family. Each family differs only in flags below.
HF_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5": "qwen3_5",  # hybrid: Gated DeltaNet + gated attention (model/qwen3_5.py)
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",  # the same hybrid with a sparse MoE FFN in every layer
    "qwen3_5_moe_text": "qwen3_5_moe",
    "gemma4": "gemma4",  # sliding/full attention, shared KV, per-layer inputs, MoE (model/gemma4.py)
    "gemma4_text": "gemma4",
    "laguna": "laguna",  # Poolside Laguna: per-layer heads, gated attention, sigmoid-routed MoE (model/laguna.py)
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Ranges a checkpoint's numbers must fall in, wider than any real model's, so that a corrupt or
# hostile config fails here with its field named instead of hanging or allocating petabytes later.
INT_LIMITS = {
    "vocab_size": (1, (1 << 31) - 1), "hidden_size": (1, 1 << 18), "intermediate_size": (1, 1 << 20),
    "num_layers": (1, 1 << 12), "num_heads": (1, 1 << 12), "num_kv_heads": (1, 1 << 12), "head_dim": (2, 1 << 12),
    "max_position_embeddings": (1, 1 << 30), "sliding_window": (1, 1 << 30), "token_id": (0, (1 << 31) - 1),
    "count": (0, (1 << 31) - 1), "num_experts": (1, 1 << 14),
}
# (exclusive lower bound, inclusive upper bound); NaN and infinities never pass.
FLOAT_LIMITS = {"rms_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e15), "rope_factor": (0.0, 1e6),
                "rope_parameter": (-1e6, 1e6)}
# ModelConfig field -> config.json key, for messages that name what the file says.
HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
           "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "num_experts": "num_experts",
           "moe_intermediate_size": "moe_intermediate_size",
           "shared_expert_intermediate_size": "shared_expert_intermediate_size"}


def check_int(value, limit: str, field_name: str) -> int:
    """`value` as an int within INT_LIMITS[limit], or a CheckpointError naming `field_name`."""
    lo, hi = INT_LIMITS[limit]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CheckpointError(f"{field_name} must be an integer from {lo} to {hi}, got {value!r:.80}")
    return value


def check_float(value, limit: str, field_name: str) -> float:
    """`value` as a finite float within FLOAT_LIMITS[limit], or a CheckpointError naming `field_name`."""
    lo, hi = FLOAT_LIMITS[limit]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and lo < value <= hi):
        raise CheckpointError(f"{field_name} must be a finite number above {lo:g} and at most {hi:g}, "
                              f"got {value!r:.80}")
    return float(value)


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # Per layer: None (full attention) or the window size in tokens.
    sliding_windows: list[int | None] = field(default_factory=list)
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sparse mixture of experts (model/moe.py); num_experts 0 = every FFN dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert (Qwen3-MoE); Qwen3.5-MoE has one
    # Per layer: True where the FFN is the sparse MoE block.
    moe_layers: list[bool] = field(default_factory=list)
    # Hybrids (qwen3_5): per layer "full_attention" or "linear_attention" (Gated DeltaNet), empty
    # for plain transformers; the DeltaNet sizes; RoPE over head_dim * partial_rotary_factor dims.
    layer_types: list[str] = field(default_factory=list)
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self):
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        if not self.moe_layers:
            self.moe_layers = [False] * self.num_layers
        self.validate()

    def validate(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            check_int(getattr(self, name), name, f"model config: {name}")
        check_float(self.rms_norm_eps, "rms_norm_eps", "model config: rms_norm_eps")
        check_float(self.rope.theta, "rope_theta", "model config: rope_theta")
        check_float(self.rope.factor, "rope_factor", "model config: rope factor")
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                     "mscale_all_dim"):
            if getattr(self.rope, name) is not None:
                check_float(getattr(self.rope, name), "rope_parameter", f"model config: rope {name}")
        if self.rope.original_max_position_embeddings is not None:
            check_int(self.rope.original_max_position_embeddings, "max_position_embeddings",
                      "model config: rope original_max_position_embeddings")
        for window in self.sliding_windows:
            if window is not None:
                check_int(window, "sliding_window", "model config: sliding_window")
        for token in [self.bos_token_id, *self.eos_token_ids]:
            if token is not None:
                check_int(token, "token_id", "model config: bos/eos token id")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.sliding_windows) != self.num_layers:
            raise CheckpointError(
                f"model config: {len(self.sliding_windows)} layer types for {self.num_layers} layers")
        if len(self.moe_layers) != self.num_layers:
            raise CheckpointError(f"model config: {len(self.moe_layers)} MoE layer flags for {self.num_layers} layers")
        if any(self.moe_layers):
            check_int(self.num_experts, "num_experts", "model config: num_experts")
            check_int(self.moe_intermediate_size, "intermediate_size", "model config: moe_intermediate_size")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise CheckpointError(f"model config: num_experts_per_tok must be from 1 to num_experts "
                                      f"({self.num_experts}), got {self.num_experts_per_tok!r:.80}")
        if self.shared_expert_intermediate_size:
            check_int(self.shared_expert_intermediate_size, "intermediate_size",
                      "model config: shared_expert_intermediate_size")
        if self.rope.type not in ROPE_TYPES:
            raise UnsupportedError(f"model config: RoPE scaling type {self.rope.type!r} is not supported "
                                   f"(supported: {', '.join(ROPE_TYPES)})")
        if self.hidden_act not in ("silu", "swish"):
            raise UnsupportedError(f"model config: activation {self.hidden_act!r} is not supported (silu only)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{file}: config.json not found (is {path} a HF model directory?)")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file}: expected a JSON object")
        try:
            return cls.from_hf_dict(raw)
        except CheckpointError as e:
            raise CheckpointError(f"{file}: {e}") from None

    @classmethod
    def from_hf_dict(cls, raw: dict) -> "ModelConfig":
        if raw.get("model_type") in ("gemma4", "gemma4_text"):
            from .gemma4_config import gemma4_config
            return gemma4_config(raw)
        if raw.get("model_type") in ("qwen3_5", "qwen3_5_moe"):  # ConditionalGeneration: the text model's config
            from .hybrid_config import text_config
            raw = text_config(raw)
        model_type = raw.get("model_type")
        family = HF_FAMILIES.get(model_type)
        if family == "qwen3_5_moe":
            from .hybrid_config import moe_text_config
            raw = moe_text_config(raw)
        config_class, extra = cls, {}
        if family == "laguna":
            from .laguna_config import LagunaConfig, laguna_fields, laguna_raw
            config_class, extra, raw = LagunaConfig, laguna_fields(raw), laguna_raw(raw)
        if family is None:
            raise UnsupportedError(
                f"architecture model_type={model_type!r} ({raw.get('architectures')}) is not supported; "
                f"supported: {', '.join(HF_FAMILIES)}")

        def integer(key, limit, default=None):
            if key not in raw or raw[key] is None:
                if default is None:
                    raise CheckpointError(f"missing field {key!r}")
                return default
            return check_int(raw[key], limit, key)

        hidden = integer("hidden_size", "hidden_size")
        heads = integer("num_attention_heads", "num_heads")
        layers = integer("num_hidden_layers", "num_layers")
        head_dim = integer("head_dim", "head_dim") if raw.get("head_dim") else hidden // heads
        eos = raw.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        for key in ("hidden_act", "torch_dtype", "dtype"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise CheckpointError(f"{key} must be a string, got {raw[key]!r:.80}")
        return config_class(
            family=family,
            vocab_size=integer("vocab_size", "vocab_size"),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size", "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=integer("num_key_value_heads", "num_kv_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=check_float(1e-6 if raw.get("rms_norm_eps") is None else raw["rms_norm_eps"],
                                     "rms_norm_eps", "rms_norm_eps"),
            max_position_embeddings=integer("max_position_embeddings", "max_position_embeddings", 4096),
            rope=hf_rope(raw),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            qkv_bias=True if family == "qwen2" else bool(raw.get("attention_bias", False)),
            o_bias=False if family == "qwen2" else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_windows=hf_sliding_windows(raw, family, layers),
            hidden_act=raw.get("hidden_act", "silu"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=None if raw.get("bos_token_id") is None else check_int(raw["bos_token_id"], "token_id",
                                                                                 "bos_token_id"),
            eos_token_ids=[check_int(i, "token_id", "eos_token_id") for i in eos_ids],
            **hf_moe(raw, layers),
            **(hybrid_fields(raw, layers) if family in ("qwen3_5", "qwen3_5_moe") else {}),
            **extra,
        )


def hybrid_fields(raw: dict, layers: int) -> dict:
    from .hybrid_config import hybrid_fields as fields
    return fields(raw, layers)


def hf_rope(raw: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
    params = {}
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(raw.get(key) or {}, dict):
            raise CheckpointError(f"{key} must be an object, got {raw[key]!r:.80}")
        params.update(raw.get(key) or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if not isinstance(rope_type, str):
        raise CheckpointError(f"rope_type must be a string, got {rope_type!r:.80}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope = RopeConfig(theta=check_float(theta, "rope_theta", "rope_theta"), type=rope_type)
    if rope_type == "default":
        return rope
    rope.factor = check_float(params.get("factor") or 1.0, "rope_factor", "rope factor")
    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    rope.original_max_position_embeddings = check_int(orig or raw.get("max_position_embeddings", 4096),
                                                      "max_position_embeddings", "original_max_position_embeddings")
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                "mscale_all_dim"):
        if params.get(key) is not None:
            setattr(rope, key, check_float(params[key], "rope_parameter", f"rope {key}"))
    if "truncate" in params:
        rope.truncate = bool(params["truncate"])
    return rope


def rope_to_hf(rope: RopeConfig) -> dict | None:
    """The `rope_scaling` entry of a HF config.json for `rope` (None for plain RoPE): hf_rope's inverse,
    in the legacy spelling that transformers 4 and 5 and llama.cpp's converter all read."""
    if rope.type == "default":
        return None
    out = {"rope_type": rope.type, "factor": rope.factor}
    if rope.original_max_position_embeddings is not None:
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    defaults = RopeConfig()
    names = {"llama3": ("low_freq_factor", "high_freq_factor"),
             "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")}
    for name in names.get(rope.type, ()):
        value = getattr(rope, name)
        if rope.type == "llama3" or value != getattr(defaults, name):
            out[name] = value
    return out


def with_yarn(raw: dict, context: int) -> dict:
    """A HF config.json dict extended by YaRN to `context` positions: factor = context / its
    max_position_embeddings, which becomes original_max_position_embeddings (rope_theta +
    rope_scaling, read alike by transformers and hf_rope)."""
    original = int(raw.get("max_position_embeddings", 0))
    if not 0 < original < context:
        raise CheckpointError(f"extending to {context} positions: the model's context ({original}) must be shorter")
    rope = hf_rope(raw)
    if rope.type != "default":
        raise UnsupportedError(f"the model already scales RoPE ({rope.type}); extend one with plain RoPE")
    rope.type, rope.factor, rope.original_max_position_embeddings = "yarn", context / original, original
    out = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    out.update(rope_theta=rope.theta, rope_scaling=rope_to_hf(rope), max_position_embeddings=context)
    return out


def hf_sliding_windows(raw: dict, family: str, layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if window:
        window = check_int(window, "sliding_window", "sliding_window")
    types = raw.get("layer_types")
    if types:
        if not isinstance(types, list):
            raise CheckpointError(f"layer_types must be a list, got {types!r:.80}")
        if len(types) != layers:
            raise CheckpointError(f"layer_types has {len(types)} entries for {layers} layers")
        return [window if t == "sliding_attention" and window else None for t in types]
    if not window:
        return [None] * layers
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        first = check_int(raw.get("max_window_layers", 28), "count", "max_window_layers")
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers


def hf_moe(raw: dict, layers: int, norm_topk_prob: bool = False) -> dict:
    """The MoE fields of ModelConfig from a Qwen MoE config.json ({} for a dense model). Layer i is sparse
    unless listed in mlp_only_layers, and then only every decoder_sparse_step-th layer (transformers' rule).
    `norm_topk_prob`: the default where the file has no such key (False in Qwen3MoeConfig; Qwen3.5-MoE
    always renormalises)."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))  # transformers 5 writes num_local_experts
    if not experts:
        return {}
    experts = check_int(experts, "num_experts", "num_experts")
    step = check_int(raw.get("decoder_sparse_step", 1), "num_layers", "decoder_sparse_step")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list):
        raise CheckpointError(f"mlp_only_layers must be a list of layer indices, got {dense!r:.80}")
    dense = {check_int(i, "count", "mlp_only_layers") for i in dense}
    return dict(
        num_experts=experts,
        num_experts_per_tok=check_int(raw.get("num_experts_per_tok"), "num_experts", "num_experts_per_tok"),
        moe_intermediate_size=check_int(raw.get("moe_intermediate_size"), "intermediate_size",
                                        "moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", norm_topk_prob)),
        shared_expert_intermediate_size=check_int(raw.get("shared_expert_intermediate_size") or 0, "count",
                                                  "shared_expert_intermediate_size"),
        moe_layers=[i not in dense and (i + 1) % step == 0 for i in range(layers)],
    )
