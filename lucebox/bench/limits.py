"""What one step of a model must move and compute, for `lucebox bench speed`'s limits.

Decode (batch 1) reads every weight once, except the embedding table (one row) and the routed
experts of MoE layers: a token reads its top_k of E experts, so top_k / E of each stacked expert
tensor. To that come the KV of the attention layers over the context (a sliding-window layer reads
at most its window; a KV-shared layer reads its source layer's KV once more) and, per Gated DeltaNet
layer, its recurrent state and conv window, read and written back once a token. KV held per
sequence: full-attention layers the whole context, sliding-window layers their window's blocks.

Prefill FLOPs: 2 per weight a token multiplies (routed experts only), the LM head for the last token
only (as the runner computes it), causal attention (sliding-window layers: each query over at most its
window; per layer its own head count and size: Gemma 4, Laguna), and the DeltaNet
recurrence (6 dk dv per value head a token: the state's read-out for the delta, its update, the
output; the chunked form's intra-chunk products are left out, so this is a floor).
"""
from __future__ import annotations

from ..model.cache_spec import PagedKVSpec, RecurrentSpec, SharedKVSpec, window_blocks
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
    """Stacked routed experts (Qwen / Laguna `mlp.experts.*`, Gemma 4 `experts.*`), not their 1-D bias."""
    return ".experts." in name and not name.endswith("bias")


def weight_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: every matrix, norm and bias once, the LM head (the
    embedding table itself when tied), a single row of the embedding table, and of each MoE layer's
    stacked experts the top_k / E share that one token routes to."""
    sizes, cfg = weight_tensors(model), model.config
    embed = model.embed_tokens
    embed = getattr(embed, "table", embed)  # a tensor-parallel shard's rows of the table (VocabParallelEmbedding)
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
    """Weights a token multiplies in one layer's FFN (MoE: the router, top_k experts, the shared one;
    Gemma 4's MoE block runs beside its dense MLP, which may be double wide)."""
    h = cfg.hidden_size
    wide = 2 if cfg.family == "gemma4" and cfg.double_wide_mlp[layer] else 1
    dense = 3 * h * cfg.intermediate_size * wide
    if not cfg.moe_layers[layer]:
        return dense
    gate = 0 if cfg.family == "laguna" else h  # Qwen's shared expert has a sigmoid gate, Laguna's none
    shared = 3 * h * cfg.shared_expert_intermediate_size + gate if cfg.shared_expert_intermediate_size else 0
    routed = h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + shared
    return routed + (dense if cfg.family == "gemma4" else 0)


def _attention_shape(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(query heads, head size) of an attention layer."""
    if cfg.family == "gemma4":
        return cfg.num_heads, cfg.layer_head_dims[layer]
    if cfg.family == "laguna":
        return cfg.heads_per_layer[layer], cfg.head_dim
    return cfg.num_heads, cfg.head_dim


def _mixer_params(cfg: ModelConfig, layer: int) -> int:
    h = cfg.hidden_size
    if layer_kind(cfg, layer) == LINEAR:
        key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return h * (2 * key + value) + h * value + 2 * h * cfg.linear_num_value_heads + value * h
    heads, dim = _attention_shape(cfg, layer)
    q = heads * dim
    if cfg.family == "gemma4":  # a KV-shared layer projects no K/V; k = v on full layers where configured
        own = cfg.kv_sources[layer] == layer
        kv_mats = 0 if not own else 1 if cfg.attention_k_eq_v and cfg.layer_types[layer] == "full_attention" else 2
        per_layer_input = 2 * h * cfg.hidden_size_per_layer_input
        return 2 * h * q + kv_mats * h * cfg.layer_kv_heads[layer] * dim + per_layer_input
    kv = cfg.num_kv_heads * dim
    if cfg.family == "laguna":  # its softplus output gate: one per head or per (head, channel)
        return h * (2 * q + 2 * kv + (heads if cfg.gate_per_head else q))
    gate = q if cfg.layer_types else 0  # Qwen 3.5's gated attention: q_proj yields the output gate too
    return h * (q + gate + 2 * kv) + q * h


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    types = getattr(cfg, "layer_types", None)
    return types[layer] if types else "full_attention"


def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(weights multiplied per token in the layers, weights of the LM head)."""
    layers = sum(_mixer_params(cfg, i) + _ffn_params(cfg, i) for i in range(cfg.num_layers))
    if cfg.family == "gemma4":  # per-layer inputs: one projection of the hidden state to every layer's
        layers += cfg.hidden_size * cfg.num_layers * cfg.hidden_size_per_layer_input
    return layers, cfg.hidden_size * cfg.vocab_size


def attended_pairs(length: int, window: int | None) -> int:
    """Query-key pairs of causal attention over `length` tokens, each query over at most `window` keys."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> int:
    """FLOPs of one prefill: 2 per weight per token, the LM head for the last token only, causal
    attention (QK^T and PV over the query-key pairs each layer attends) and the DeltaNet recurrence."""
    layers, head = matmul_params(cfg)
    attention = 0
    for i in range(cfg.num_layers):
        if layer_kind(cfg, i) != LINEAR:
            heads, dim = _attention_shape(cfg, i)
            attention += 2 * 2 * attended_pairs(prompt_len, cfg.sliding_windows[i]) * heads * dim
    full = sum(layer_kind(cfg, i) != LINEAR for i in range(cfg.num_layers))
    linear = cfg.num_layers - full
    recurrence = (6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * prompt_len
                  * linear) if linear else 0
    return 2 * layers * prompt_len + 2 * head + attention + recurrence


def row_flops(cfg: ModelConfig, context: float) -> float:
    """FLOPs one token row of a decode or verify step costs at `context` cached positions: 2 per weight it
    multiplies (its logits included: every verify row needs them), attention over the positions each layer
    sees (QK^T and PV) and the DeltaNet recurrence."""
    layers, head = matmul_params(cfg)
    attention = recurrence = 0
    for i in range(cfg.num_layers):
        if layer_kind(cfg, i) == LINEAR:
            recurrence += 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        else:
            heads, dim = _attention_shape(cfg, i)
            window = cfg.sliding_windows[i]
            attention += 2 * 2 * heads * dim * (context if window is None else min(context, window))
    return 2 * (layers + head) + attention + recurrence


def _kv_layers(specs):
    """(bytes a position costs, window) of every layer's KV read in a decode step: a KV-shared layer
    reads its source's cache again."""
    for spec in specs:
        if isinstance(spec, PagedKVSpec):
            yield spec.bytes_per_token, spec.window
        elif isinstance(spec, SharedKVSpec):
            yield specs[spec.source].bytes_per_token, spec.window


def kv_read_bytes(specs, context: float) -> int:
    """KV bytes one decode step reads at `context` cached positions (each layer over at most its window)."""
    return round(sum(size * (context if window is None else min(context, window)) for size, window in _kv_layers(specs)))


def kv_unbounded_bytes_per_token(specs) -> int:
    """KV bytes per context position read at any context: the layers without a window."""
    return round(sum(size for size, window in _kv_layers(specs) if window is None))


def kv_held_bytes(specs, positions: int, block_size: int) -> int:
    """KV bytes a sequence of `positions` holds between steps: whole blocks of the full-attention layers'
    context, a sliding-window layer's blocks its window of the next position reaches (the cache manager
    releases the ones behind it)."""
    blocks = -(-positions // block_size)
    total = 0
    for spec in specs:
        if isinstance(spec, PagedKVSpec):
            held = blocks if spec.window is None else min(blocks, window_blocks(spec.window, block_size, 1))
            total += round(spec.bytes_per_token * block_size) * held
    return total


def active_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies, the embedding row not counted ("A3B": about 3 billion)."""
    return sum(matmul_params(cfg))


__all__ = ["active_params", "attended_pairs", "kv_held_bytes", "kv_read_bytes", "kv_unbounded_bytes_per_token",
           "layer_kind", "matmul_params", "prefill_flops", "row_flops", "state_bytes_per_token", "weight_bytes",
           "weight_bytes_per_token", "weight_tensors"]
