"""The limit of a batched decode step, for `lucebox bench throughput`.

Bandwidth: a step of B sequences reads the weights once (an MoE layer the experts that at least one of the
B tokens routes to: E (1 - (1 - k/E)^B) of E on average for uniform routing, which random weights approach;
one embedding row a sequence) and every sequence's KV over its context (sliding-window layers at most their
window) and recurrent state. At the GEMV bandwidth measured in the same run that gives the most tok/s the
batch can decode: B x bandwidth / bytes a step. A speculative step reads the same and commits tau tokens a
sequence: tau times that.

Compute: every token row of a step (a verify's drafts included) costs limits.row_flops; at the bf16 matmul
rate measured in the same run, rows a second times the tokens a row commits. The limit is the lower of the
two (a wide verify batch is compute-bound long before its bytes are).
"""
from __future__ import annotations

from ..weights.quant import QuantEmbedding
from . import limits


def expert_share(model, batch: int) -> float:
    """Expected share of each MoE layer's experts a step of `batch` tokens reads (uniform routing)."""
    cfg = model.config
    if not getattr(cfg, "num_experts", None):
        return 0.0
    return 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch


def weight_bytes_per_step(model, batch: int) -> int:
    """Weight bytes one decode step of `batch` sequences reads."""
    sizes = limits.weight_tensors(model)
    one = limits.weight_bytes_per_token(model)
    experts = sum(size for name, size in sizes.items() if limits._is_expert(name))
    routed_one = experts * model.config.num_experts_per_tok // model.config.num_experts if experts else 0
    embed = model.embed_tokens
    table = embed.qweight if isinstance(embed, QuantEmbedding) else embed.weight
    row = table.numel() * table.element_size() // embed.weight.shape[0]
    return round(one - routed_one + experts * expert_share(model, batch) + (batch - 1) * row)


def limit(model, batch: int, prompt_len: int, output_len: int, ref: dict | None, cache_type: str = "auto") -> dict:
    """Bytes a step of `batch` sequences reads at the run's mean context (prompt + half the output) and,
    with a measured GEMV bandwidth, the tok/s that bounds."""
    specs = model.cache_specs(cache_type, cache_type)
    context = prompt_len + (output_len + 1) / 2
    weights = weight_bytes_per_step(model, batch)
    kv = batch * (limits.kv_read_bytes(specs, context) + limits.state_bytes_per_token(model))
    row = {"weight_bytes_per_step": weights, "kv_bytes_per_step": kv, "mean_context": context}
    if ref:
        row["bandwidth_limit_tok_s"] = batch * ref["gemv_gb_s"] * 1e9 / (weights + kv)
    return row


def bound(bandwidth_tok_s: float, model, context: float, tokens_per_row: float, ref: dict) -> dict:
    """The lower of a step's bandwidth limit (tok/s) and its compute limit at `tokens_per_row` committed
    tokens a computed row (1 plain; a speculative step's tokens over its rows), with the one that binds."""
    compute = ref["matmul_tflops"] * 1e12 / limits.row_flops(model.config, context) * tokens_per_row
    return {"bandwidth_limit_tok_s": bandwidth_tok_s, "compute_limit_tok_s": compute,
            "limit_tok_s": min(bandwidth_tok_s, compute), "limit_bound": "bandwidth" if bandwidth_tok_s <= compute
            else "compute"}
