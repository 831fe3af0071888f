"""The config.json fields of Qwen 3.5 hybrids, dense and MoE (model/config.py's from_hf_dict calls these)."""
from __future__ import annotations

from ..errors import CheckpointError, UnsupportedError

LAYER_KINDS = ("linear_attention", "full_attention")
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")
# What config.json puts outside text_config that the text model still needs.
SHARED_KEYS = ("tie_word_embeddings", "torch_dtype", "dtype", "eos_token_id", "bos_token_id")


def text_config(raw: dict) -> dict:
    """A Qwen3_5(Moe)ForConditionalGeneration config's text model, as a qwen3_5(_moe)_text config."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"model_type {raw.get('model_type')} needs a text_config object (the text model's config)")
    out = dict(text)
    for key in SHARED_KEYS:
        if out.get(key) is None and raw.get(key) is not None:
            out[key] = raw[key]
    out["model_type"] = f"{raw['model_type']}_text"
    return out


def moe_text_config(raw: dict) -> dict:
    """A qwen3_5_moe_text config as hf_moe reads it, by transformers' Qwen3.5-MoE rules: every layer
    sparse (no mlp_only_layers / decoder_sparse_step), top-k weights always renormalised, a shared
    expert in every layer; no dense FFN, so intermediate_size (absent there) is the shared expert's."""
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if not raw.get(key):
            raise CheckpointError(f"model_type {raw.get('model_type')}: missing field {key!r}")
    out = {k: v for k, v in raw.items() if k not in ("mlp_only_layers", "decoder_sparse_step")}
    out["norm_topk_prob"] = True
    out.setdefault("intermediate_size", raw["shared_expert_intermediate_size"])
    return out


def hybrid_fields(raw: dict, layers: int) -> dict:
    """ModelConfig's hybrid fields: layer_types, DeltaNet sizes, partial_rotary_factor."""
    from .config import check_float, check_int

    types = raw.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th layer is full attention
        interval = check_int(raw.get("full_attention_interval", 4), "count", "full_attention_interval")
        types = ["full_attention" if (i + 1) % max(interval, 1) == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"layer_types must be a list of {layers} entries, got {types!r:.80}")
    for kind in types:
        if kind not in LAYER_KINDS:
            raise UnsupportedError(f"layer_types: {kind!r} is not a supported layer kind ({', '.join(LAYER_KINDS)})")
    fields = {key: check_int(raw.get(key), "num_heads", key) for key in LINEAR_KEYS}
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise CheckpointError(f"linear_num_value_heads ({fields['linear_num_value_heads']}) must be a multiple "
                              f"of linear_num_key_heads ({fields['linear_num_key_heads']})")
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return dict(layer_types=list(types), partial_rotary_factor=check_float(factor, "rope_factor",
                                                                           "partial_rotary_factor"), **fields)
