"""llama.cpp's GGUF conventions: metadata keys -> ModelConfig, tensor names, the q/k row order.

Shared by the loader (weights/gguf.py) and the converter (convert.py), so both sides agree on one
spelling of every key and name.
"""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
from gguf import GGUFValueType

from ..errors import CheckpointError, UnsupportedError
from .config import ModelConfig, RopeConfig, check_float, check_int

# general.architecture -> ModelConfig.family. Mistral GGUFs say "llama": same graph.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# ModelConfig.family -> general.architecture written by the converter.
FAMILY_TO_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# The MoE and hybrid architectures (their tensors: model/gguf_tensors.py, metadata: model/gguf_hybrid_config.py).
HYBRID_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe",
                        "laguna": "laguna"}  # laguna's metadata: model/gguf_laguna_config.py
FAMILY_TO_HYBRID_ARCH = {family: arch for arch, family in HYBRID_ARCHITECTURES.items()}
# Architectures with their own loader module: general.architecture -> family.
OWN_ARCHITECTURES = {"gemma4": "gemma4"}  # model/gguf_gemma4.py

GLOBAL_TENSORS = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TO_GGUF = {ours: theirs for theirs, ours in LAYER_TENSORS.items()}
_GLOBAL_TO_GGUF = {ours: theirs for theirs, ours in GLOBAL_TENSORS.items()}
ROPE_FREQS = "rope_freqs.weight"
_GGUF_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_OUR_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")

# general.sampling.* -> generation-config names (what the engine reads from generation_config.json).
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}


def to_our_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Transformer parameter name; None for names this model has no use for."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    m = _GGUF_LAYER_NAME.fullmatch(gguf_name)
    if m and m[2] in LAYER_TENSORS:
        return f"layers.{m[1]}.{LAYER_TENSORS[m[2]]}.{m[3]}"
    return None


def to_gguf_name(our_name: str) -> str | None:
    if our_name in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[our_name]
    m = _OUR_LAYER_NAME.fullmatch(our_name)
    if m and m[2] in _LAYER_TO_GGUF:
        return f"blk.{m[1]}.{_LAYER_TO_GGUF[m[2]]}.{m[3]}"
    return None


def rows_permuted(arch: str, gguf_name: str) -> str | None:
    """Which head count ('q' or 'k') reorders this tensor's rows, for llama.cpp's llama layout."""
    if arch != "llama":
        return None
    m = _GGUF_LAYER_NAME.fullmatch(gguf_name)
    if m and m[2] == "attn_q":
        return "q"
    if m and m[2] == "attn_k":
        return "k"
    return None


def permute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half row order -> GGML's interleaved pairs (what llama.cpp's converter does to q/k
    of "llama" models). Works on any [rows, ...] array, e.g. raw quantised byte rows."""
    head_dim = rows.shape[0] // n_head
    return rows.reshape(n_head, 2, head_dim // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    head_dim = rows.shape[0] // n_head
    return rows.reshape(n_head, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class Metadata:
    """Typed access to a GGUFReader's key/value fields; errors name the key and the file."""

    def __init__(self, reader, path):
        self.fields = reader.fields
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{self.path}: metadata key {key} is unreadable ({e})") from None

    def need(self, key: str) -> Any:
        if key not in self.fields:
            raise CheckpointError(f"{self.path}: required metadata key {key} is missing")
        return self.get(key)

    def array_len(self, key: str) -> int | None:
        field = self.fields.get(key)
        return None if field is None else len(field.data)

    def integer(self, key: str, default: Any = None, required: bool = False, limit: str | None = None) -> int | None:
        """The key's integer value; with `limit`, also within config.INT_LIMITS[limit]."""
        value = self._integer(key, default, required)
        if limit is None or value is None:
            return value
        try:
            return check_int(value, limit, f"metadata key {key}")
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def _integer(self, key: str, default: Any, required: bool) -> int | None:
        value = self.need(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, list):  # some files give per-layer values; this model needs one
            if not value or any(v != value[0] for v in value):
                raise UnsupportedError(f"{self.path}: metadata key {key} varies per layer ({value[:8]}...), "
                                       "which lucebox does not support")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise CheckpointError(f"{self.path}: metadata key {key} should be an integer, got {value!r:.60}")
        return int(value)

    def number(self, key: str, default: float | None = None, required: bool = False,
               limit: str | None = None) -> float | None:
        """The key's numeric value; with `limit`, also finite and within config.FLOAT_LIMITS[limit]."""
        value = self._number(key, default, required)
        if limit is None or value is None:
            return value
        try:
            return check_float(value, limit, f"metadata key {key}")
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def _number(self, key: str, default: float | None, required: bool) -> float | None:
        value = self.need(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.path}: metadata key {key} should be a number, got {value!r:.60}")
        if key in self.fields and self.fields[key].types == [GGUFValueType.FLOAT32]:
            # The shortest decimal that rounds to this float32 is what the config said (1e-06, not
            # 9.99999997e-07), so float64 maths on it (RoPE tables) matches the HF checkpoint's.
            return float(str(np.float32(value)))
        return float(value)


def architecture(meta: Metadata) -> str:
    arch = meta.need("general.architecture")
    known = [*ARCHITECTURES, *HYBRID_ARCHITECTURES, *OWN_ARCHITECTURES]
    if arch not in known:
        raise UnsupportedError(
            f"{meta.path}: architecture {arch!r} (general.architecture) is not supported; lucebox loads "
            f"{', '.join(known)} GGUF files (Mistral files say 'llama')")
    return arch


def config_keys(arch: str) -> dict[str, str]:
    """ModelConfig field -> the metadata key it comes from (for messages naming what the file says)."""
    return {"vocab_size": f"{arch}.vocab_size (or the length of tokenizer.ggml.tokens)",
            "hidden_size": f"{arch}.embedding_length", "intermediate_size": f"{arch}.feed_forward_length",
            "num_layers": f"{arch}.block_count", "num_heads": f"{arch}.attention.head_count",
            "num_kv_heads": f"{arch}.attention.head_count_kv", "head_dim": f"{arch}.attention.key_length"}


def model_config(meta: Metadata, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """Build the ModelConfig from llama.cpp's `{arch}.*` keys; optional layers (biases, q/k norms,
    a separate LM head) are recognised from the tensors present; `shapes` maps each GGUF tensor
    name to its shape (outermost first)."""
    arch = architecture(meta)

    def key(suffix):
        return f"{arch}.{suffix}"

    hidden = meta.integer(key("embedding_length"), required=True, limit="hidden_size")
    layers = meta.integer(key("block_count"), required=True, limit="num_layers")
    heads = meta.integer(key("attention.head_count"), required=True, limit="num_heads")
    kv_heads = meta.integer(key("attention.head_count_kv"), heads, limit="num_kv_heads")
    head_dim = meta.integer(key("attention.key_length"), None, limit="head_dim") or hidden // heads
    value_dim = meta.integer(key("attention.value_length"), head_dim)
    if value_dim != head_dim:
        raise UnsupportedError(f"{meta.path}: key_length {head_dim} != value_length {value_dim} is not supported")
    rope_dims = meta.integer(key("rope.dimension_count"), head_dim)
    if rope_dims != head_dim:
        raise UnsupportedError(f"{meta.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    context = meta.integer(key("context_length"), required=True, limit="max_position_embeddings")
    vocab = (meta.integer(key("vocab_size"), None, limit="vocab_size") or meta.array_len("tokenizer.ggml.tokens")
             or shapes.get("token_embd.weight", (0,))[0])
    eos = [meta.integer(f"tokenizer.ggml.{k}_token_id", limit="token_id") for k in ("eos", "eot", "eom")]

    values = {
        "intermediate_size": meta.integer(key("feed_forward_length"), required=True, limit="intermediate_size"),
        "rms_norm_eps": meta.number(key("attention.layer_norm_rms_epsilon"), required=True, limit="rms_norm_eps"),
        "rope": rope_config(meta, arch, context),
        "sliding_windows": _sliding_windows(meta, arch, layers),
        "bos_token_id": meta.integer("tokenizer.ggml.bos_token_id", limit="token_id"),
    }

    def has(suffix):
        return f"blk.0.{suffix}" in shapes

    try:
        return ModelConfig(
            family=ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=context,
            qk_norm=arch == "qwen3" or has("attn_q_norm.weight"),
            qkv_bias=arch == "qwen2" or has("attn_q.bias"),
            o_bias=has("attn_output.bias"),
            mlp_bias=has("ffn_up.bias"),
            tie_word_embeddings="output.weight" not in shapes,
            eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
            **values,
        )
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {e}") from None


def yarn_mscale(factor: float) -> float:
    """YaRN's default attention scale. llama.cpp applies it and multiplies it by rope.scaling.attn_factor
    (llama-context.cpp), where HF's attention_factor replaces it: the key is attention_factor / this."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_config(meta: Metadata, arch: str, context: int) -> RopeConfig:
    prefix = f"{arch}.rope"
    theta = meta.number(f"{prefix}.freq_base", 10000.0, limit="rope_theta")
    kind = meta.get(f"{prefix}.scaling.type")
    if kind is None and meta.get(f"{prefix}.scale_linear") is not None:  # pre-2024 files
        return RopeConfig(theta=theta, type="linear", factor=meta.number(f"{prefix}.scale_linear", limit="rope_factor"))
    if kind in (None, "none"):
        return RopeConfig(theta=theta)
    factor = meta.number(f"{prefix}.scaling.factor", required=True, limit="rope_factor")
    if kind == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    if kind == "yarn":
        rope = RopeConfig(theta=theta, type="yarn", factor=factor,
                          original_max_position_embeddings=meta.integer(f"{prefix}.scaling.original_context_length",
                                                                        context))
        rope.beta_fast = meta.number(f"{prefix}.scaling.yarn_beta_fast", rope.beta_fast)
        rope.beta_slow = meta.number(f"{prefix}.scaling.yarn_beta_slow", rope.beta_slow)
        scale = meta.number(f"{prefix}.scaling.attn_factor", None)
        rope.attention_factor = None if scale is None else scale * yarn_mscale(factor)
        return rope
    raise UnsupportedError(f"{meta.path}: RoPE scaling type {kind!r} ({prefix}.scaling.type) is not supported "
                           "(supported: none, linear, yarn, and llama3 via a rope_freqs tensor)")


def _sliding_windows(meta: Metadata, arch: str, layers: int) -> list[int | None]:
    window = meta.integer(f"{arch}.attention.sliding_window", None)
    if window:
        window = meta.integer(f"{arch}.attention.sliding_window", None, limit="sliding_window")
    if not window:
        return [None] * layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is None:
        return [window] * layers
    if isinstance(pattern, list):  # one bool per layer: does it use the window
        if len(pattern) != layers:
            raise CheckpointError(f"{meta.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                                  f"entries for {layers} layers")
        return [window if p else None for p in pattern]
    # An integer n: every n-th layer attends fully, the others use the window (llama.cpp's rule).
    n = meta.integer(f"{arch}.attention.sliding_window_pattern", limit="count")
    return [window if n == 0 or i % n < n - 1 else None for i in range(layers)]
