"""ModelConfig: one arch-agnostic description of a decoder-only transformer.

Built from a HF config.json or from GGUF metadata; the transformer reads only this, so a new
family is a new `from_*` mapping, never a new model file.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, UnsupportedError

# HF model_type -> family. Each family differs only in flags below.
HF_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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

    def __post_init__(self):
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        self.validate()

    def validate(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.sliding_windows) != self.num_layers:
            raise CheckpointError(
                f"model config: {len(self.sliding_windows)} layer types for {self.num_layers} layers")
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
        model_type = raw.get("model_type")
        family = HF_FAMILIES.get(model_type)
        if family is None:
            raise UnsupportedError(
                f"architecture model_type={model_type!r} ({raw.get('architectures')}) is not supported; "
                f"supported: {', '.join(HF_FAMILIES)}")

        def need(key):
            if key not in raw:
                raise CheckpointError(f"missing field {key!r}")
            return raw[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        layers = need("num_hidden_layers")
        head_dim = raw.get("head_dim") or hidden // heads
        eos = raw.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=hf_rope(raw),
            qk_norm=family == "qwen3",
            qkv_bias=True if family == "qwen2" else bool(raw.get("attention_bias", False)),
            o_bias=False if family == "qwen2" else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_windows=hf_sliding_windows(raw, family, layers),
            hidden_act=raw.get("hidden_act", "silu"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def hf_rope(raw: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope = RopeConfig(theta=float(theta), type=rope_type)
    if rope_type == "default":
        return rope
    rope.factor = float(params.get("factor") or 1.0)
    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    rope.original_max_position_embeddings = int(orig or raw.get("max_position_embeddings", 4096))
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if params.get(key) is not None:
            setattr(rope, key, float(params[key]))
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            setattr(rope, key, float(params[key]))
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
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types")
    if types:
        if len(types) != layers:
            raise CheckpointError(f"layer_types has {len(types)} entries for {layers} layers")
        return [window if t == "sliding_attention" and window else None for t in types]
    if not window:
        return [None] * layers
    if family in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", 28)
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers
