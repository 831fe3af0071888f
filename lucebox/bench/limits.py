"""What one step of a model must move and compute, for `lucebox bench speed`'s limits.

Decode (batch 1) reads every weight once, except the embedding table (one row) and the routed
experts of MoE layers: a token reads its top_k of E experts, so top_k / E of each stacked expert
tensor. To that come the KV of the full-attention layers over the context and, per Gated DeltaNet
layer, its recurrent state and conv window, read and written back once a token.

Prefill FLOPs: 2 per weight a token multiplies (routed experts only), the LM head for the last token
only (as the runner computes it), causal attention of the full-attention layers, and the DeltaNet
recurrence (6 dk dv per value head a token: the state's read-out for the delta, its update, the
output; the chunked form's intra-chunk products are left out, so this is a floor).
"""
from __future__ import annotations

from ..model.cache_spec import RecurrentSpec
from ..model.config import ModelConfig
from ..weights.quant import QuantEmbedding, QuantTensor

LINEAR = "linear_attention"


def _bytes(t) -> int:
    if t is None:
        return 0
    return t.nbytes if isinstance(t, QuantTensor) else t.numel() * t.element_size()


def weight_tensors(model) -> dict[str, int]:
    """Bytes of every weight by name: parameters, persistent buffers (quantised blocks) and any
    QuantTensor a module holds as a plain attribute (stacked quantised experts)."""
    sizes = {name: _bytes(t) for name, t in model.state_dict(keep_vars=True).items()}
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, QuantTensor):
                sizes[f"{prefix}.{attr}" if prefix else attr] = value.nbytes
    return sizes


def weight_bytes(model) -> int:
    """Storage of every weight of the model (float parameters and quantised blocks)."""
    return sum(weight_tensors(model).values())


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def weight_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: every matrix, norm and bias once, the LM head (the
    embedding table itself when tied), a single row of the embedding table, and of each MoE layer's
    stacked experts the top_k / E share that one token routes to."""
    sizes, cfg = weight_tensors(model), model.config
    embed = model.embed_tokens
    table = _bytes(embed.qweight) if isinstance(embed, QuantEmbedding) else _bytes(embed.weight)
    row = table // embed.weight.shape[0]
    tied_head = table if cfg.tie_word_embeddings else 0
    experts = sum(size for name, size in sizes.items() if _is_expert(name))
    routed = experts * cfg.num_experts_per_tok // cfg.num_experts if experts else 0
    return sum(sizes.values()) - experts + routed - table + row + tied_head


def state_bytes_per_token(model) -> int:
    """Recurrent traffic of one decode step: each DeltaNet layer's state and conv window, read and written."""
    return 2 * sum(s.bytes_per_sequence(0) for s in model.cache_specs() if isinstance(s, RecurrentSpec))


def _ffn_params(cfg: ModelConfig, layer: int) -> int:
    """Weights a token multiplies in one layer's FFN (MoE: the router, top_k experts, the shared one)."""
    h = cfg.hidden_size
    if not cfg.moe_layers[layer]:
        return 3 * h * cfg.intermediate_size
    shared = 3 * h * cfg.shared_expert_intermediate_size + h if cfg.shared_expert_intermediate_size else 0
    return h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + shared


def _mixer_params(cfg: ModelConfig, layer: int) -> int:
    h = cfg.hidden_size
    if layer_kind(cfg, layer) == LINEAR:
        key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return h * (2 * key + value) + h * value + 2 * h * cfg.linear_num_value_heads + value * h
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gate = q if cfg.layer_types else 0  # Qwen 3.5's gated attention: q_proj yields the output gate too
    return h * (q + gate + 2 * kv) + q * h


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    return cfg.layer_types[layer] if cfg.layer_types else "full_attention"


def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(weights multiplied per token in the layers, weights of the LM head)."""
    layers = sum(_mixer_params(cfg, i) + _ffn_params(cfg, i) for i in range(cfg.num_layers))
    return layers, cfg.hidden_size * cfg.vocab_size


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> int:
    """FLOPs of one prefill: 2 per weight per token, the LM head for the last token only, causal
    attention (QK^T and PV over L(L+1)/2 query-key pairs) and the DeltaNet recurrence."""
    layers, head = matmul_params(cfg)
    pairs = prompt_len * (prompt_len + 1) // 2
    full = sum(layer_kind(cfg, i) != LINEAR for i in range(cfg.num_layers))
    attention = 2 * 2 * pairs * cfg.num_heads * cfg.head_dim * full
    linear = cfg.num_layers - full
    recurrence = (6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * prompt_len
                  * linear) if linear else 0
    return 2 * layers * prompt_len + 2 * head + attention + recurrence


def active_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies, the embedding row not counted ("A3B": about 3 billion)."""
    return sum(matmul_params(cfg))


__all__ = ["active_params", "layer_kind", "matmul_params", "prefill_flops", "state_bytes_per_token",
           "weight_bytes", "weight_bytes_per_token", "weight_tensors"]

