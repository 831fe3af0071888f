"""llama.cpp's metadata keys of the MoE and hybrid architectures (qwen3moe, qwen35, qwen35moe) -> ModelConfig,
and the keys the converter writes for them (the same spelling both ways).

  {arch}.expert_count / expert_used_count / expert_feed_forward_length   experts, top-k, expert width
  {arch}.expert_shared_feed_forward_length                               the shared expert's width (qwen35moe)
  {arch}.expert_weights_norm                                             renormalise the top-k weights (llama.cpp
                                                                         always does for these archs: default true)
  {arch}.attention.recurrent_layers | full_attention_interval            which layers are Gated DeltaNet
  {arch}.ssm.state_size / group_count / time_step_rank / inner_size      key head dim, key heads, value heads,
  {arch}.ssm.conv_kernel                                                 value heads x value head dim, conv width
  {arch}.rope.dimension_count                                            rotary dims (partial RoPE)
  {arch}.nextn_predict_layers                                            MTP blocks counted in block_count (skipped)
"""
from __future__ import annotations

import logging

from ..errors import CheckpointError, UnsupportedError
from .config import ModelConfig
from .gguf_config import HYBRID_ARCHITECTURES, Metadata, rope_config
from .gguf_laguna_config import write_laguna_keys
from .gguf_tensors import from_gguf_name

log = logging.getLogger("lucebox")


def hybrid_config_keys(arch: str) -> dict[str, str]:
    """ModelConfig field -> the metadata key it comes from (for messages)."""
    return {"vocab_size": f"{arch}.vocab_size (or the length of tokenizer.ggml.tokens)",
            "hidden_size": f"{arch}.embedding_length", "intermediate_size": f"{arch}.feed_forward_length",
            "num_layers": f"{arch}.block_count", "num_heads": f"{arch}.attention.head_count",
            "num_kv_heads": f"{arch}.attention.head_count_kv", "head_dim": f"{arch}.attention.key_length",
            "num_experts": f"{arch}.expert_count", "moe_intermediate_size": f"{arch}.expert_feed_forward_length",
            "shared_expert_intermediate_size": f"{arch}.expert_shared_feed_forward_length"}


def hybrid_model_config(meta: Metadata, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """ModelConfig of a qwen3moe / qwen35 / qwen35moe file; `shapes`: GGUF tensor name -> shape."""
    arch = meta.need("general.architecture")

    def key(suffix):
        return f"{arch}.{suffix}"

    blocks = meta.integer(key("block_count"), required=True, limit="num_layers")
    mtp = meta.integer(key("nextn_predict_layers"), 0, limit="count")
    layers = blocks - mtp
    if layers < 1:
        raise CheckpointError(f"{meta.path}: {key('nextn_predict_layers')} ({mtp}) leaves no layers of "
                              f"{key('block_count')} ({blocks})")
    hidden = meta.integer(key("embedding_length"), required=True, limit="hidden_size")
    heads = meta.integer(key("attention.head_count"), required=True, limit="num_heads")
    head_dim = meta.integer(key("attention.key_length"), None, limit="head_dim") or hidden // heads
    if meta.integer(key("attention.value_length"), head_dim) != head_dim:
        raise UnsupportedError(f"{meta.path}: {key('attention.value_length')} != {key('attention.key_length')} "
                               "is not supported")
    context = meta.integer(key("context_length"), required=True, limit="max_position_embeddings")
    vocab = (meta.integer(key("vocab_size"), None, limit="vocab_size") or meta.array_len("tokenizer.ggml.tokens")
             or shapes.get("token_embd.weight", (0,))[0])
    eos = [meta.integer(f"tokenizer.ggml.{k}_token_id", limit="token_id") for k in ("eos", "eot", "eom")]
    values = dict(_moe_fields(meta, arch, layers, shapes), **_hybrid_fields(meta, arch, layers, head_dim))
    dense = meta.integer(key("feed_forward_length"), None, limit="intermediate_size")
    # No dense FFN width in the file: no layer has a dense FFN, and ModelConfig still wants a number.
    intermediate = dense or values.get("shared_expert_intermediate_size") or values.get("moe_intermediate_size")
    if not intermediate:
        raise CheckpointError(f"{meta.path}: required metadata key {key('feed_forward_length')} is missing")
    names = {our for name in shapes if (found := from_gguf_name(arch, name)) for our in [found[0]]}
    try:
        return ModelConfig(
            family=HYBRID_ARCHITECTURES[arch], vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
            num_layers=layers, num_heads=heads,
            num_kv_heads=meta.integer(key("attention.head_count_kv"), heads, limit="num_kv_heads"),
            head_dim=head_dim, max_position_embeddings=context,
            rms_norm_eps=meta.number(key("attention.layer_norm_rms_epsilon"), required=True, limit="rms_norm_eps"),
            rope=rope_config(meta, arch, context),
            qk_norm=arch == "qwen3moe",  # as the HF config maps it; the hybrids' gated attention always has them
            qkv_bias=any(n.endswith("self_attn.q_proj.bias") for n in names),
            o_bias=any(n.endswith("self_attn.o_proj.bias") for n in names),
            tie_word_embeddings="output.weight" not in shapes,
            bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", limit="token_id"),
            eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
            **values)
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {e}") from None


def _moe_fields(meta: Metadata, arch: str, layers: int, shapes) -> dict:
    if arch == "qwen35":
        return {}
    experts = meta.integer(f"{arch}.expert_count", required=True, limit="num_experts")
    norm = meta.get(f"{arch}.expert_weights_norm", True)
    if not isinstance(norm, bool):
        raise CheckpointError(f"{meta.path}: metadata key {arch}.expert_weights_norm should be a boolean, "
                              f"got {norm!r:.60}")
    # qwen35moe: every layer sparse; qwen3moe: llama.cpp's files too, lucebox's may keep dense layers
    # (mlp_only_layers), told apart by their router tensor.
    sparse = [arch == "qwen35moe" or f"blk.{i}.ffn_gate_inp.weight" in shapes for i in range(layers)]
    return dict(num_experts=experts,
                num_experts_per_tok=meta.integer(f"{arch}.expert_used_count", required=True, limit="num_experts"),
                moe_intermediate_size=meta.integer(f"{arch}.expert_feed_forward_length", required=True,
                                                   limit="intermediate_size"),
                norm_topk_prob=arch == "qwen35moe" or norm,
                shared_expert_intermediate_size=meta.integer(f"{arch}.expert_shared_feed_forward_length", 0,
                                                             limit="count") if arch == "qwen35moe" else 0,
                moe_layers=sparse)


def _hybrid_fields(meta: Metadata, arch: str, layers: int, head_dim: int) -> dict:
    rope_dims = meta.integer(f"{arch}.rope.dimension_count", head_dim, limit="head_dim")
    if rope_dims > head_dim:
        raise CheckpointError(f"{meta.path}: {arch}.rope.dimension_count ({rope_dims}) exceeds the head dim "
                              f"({head_dim})")
    if arch == "qwen3moe":
        if rope_dims != head_dim:
            raise UnsupportedError(f"{meta.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported "
                                   f"for {arch}")
        return {}
    ssm = {name: meta.integer(f"{arch}.ssm.{name}", required=True, limit="num_heads" if name != "inner_size"
                              else "intermediate_size")
           for name in ("state_size", "group_count", "time_step_rank", "inner_size", "conv_kernel")}
    value_heads = ssm["time_step_rank"]
    if ssm["inner_size"] % value_heads:
        raise CheckpointError(f"{meta.path}: {arch}.ssm.inner_size ({ssm['inner_size']}) is not a multiple of "
                              f"{arch}.ssm.time_step_rank ({value_heads}, the value heads)")
    factor = rope_dims / head_dim
    if int(head_dim * factor) != rope_dims:  # a float product a hair below the integer
        factor = (rope_dims + 0.5) / head_dim
    return dict(layer_types=_layer_types(meta, arch, layers), partial_rotary_factor=factor,
                linear_num_key_heads=ssm["group_count"], linear_num_value_heads=value_heads,
                linear_key_head_dim=ssm["state_size"], linear_value_head_dim=ssm["inner_size"] // value_heads,
                linear_conv_kernel_dim=ssm["conv_kernel"])


def _layer_types(meta: Metadata, arch: str, layers: int) -> list[str]:
    """llama.cpp's rule: the per-layer recurrent flags, else every full_attention_interval-th layer attends."""
    flags = meta.get(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) < layers or not all(isinstance(f, bool) for f in flags):
            raise CheckpointError(f"{meta.path}: {arch}.attention.recurrent_layers should hold a boolean for each "
                                  f"of the {layers} layers, got {flags!r:.80}")
        return ["linear_attention" if flags[i] else "full_attention" for i in range(layers)]
    interval = meta.integer(f"{arch}.full_attention_interval", 4, limit="count")
    if interval < 1:
        raise CheckpointError(f"{meta.path}: {arch}.full_attention_interval must be at least 1, got {interval}")
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


# ------------------------------------------------------------------------------------------- writing
def write_hybrid_keys(w, cfg: ModelConfig, arch: str, mrope_sections: list[int] | None) -> None:
    """The `{arch}.*` keys beyond the dense transformer's (convert.write_shape_metadata writes those)."""
    if arch == "laguna":
        return write_laguna_keys(w, cfg)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        if arch == "qwen3moe":
            w.add_expert_weights_norm(cfg.norm_topk_prob)
            if not cfg.norm_topk_prob:
                log.warning("norm_topk_prob is false: lucebox reads it back from %s.expert_weights_norm, but "
                            "llama.cpp renormalises qwen3moe's top-k weights regardless", arch)
    if arch == "qwen3moe":
        return
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_array(f"{arch}.attention.recurrent_layers", [kind == "linear_attention" for kind in cfg.layer_types])
    full = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
    if full and all((i + 1) % (full[0] + 1) == 0 for i in full) and len(full) == cfg.num_layers // (full[0] + 1):
        w.add_full_attention_interval(full[0] + 1)  # older llama.cpp reads only this
    w.add_rope_dimension_sections(mrope_sections_for(cfg, mrope_sections))


def mrope_sections_for(cfg: ModelConfig, sections: list[int] | None) -> list[int]:
    """{arch}.rope.dimension_sections: llama.cpp's interleaved MRoPE turns rotary pair i with the t, h or w
    position as i % 3 is 0, 1 or 2, while i < 3 * that section; a pair outside every section is turned by
    a position that is 0 for text. Sections that cover every pair (HF's [11, 11, 10] for 32 pairs) make
    it plain RoPE on text, whatever the split; other sizes get the same interleaved split."""
    pairs = int(cfg.head_dim * cfg.partial_rotary_factor) // 2
    if sections and sum(sections[:3]) == pairs:
        return (list(sections) + [0, 0, 0, 0])[:4]
    t, h = -(-pairs // 3), -(-(pairs - 1) // 3)
    return [t, h, pairs - t - h, 0]
