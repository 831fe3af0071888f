"""Tensor parallelism for Gemma 4 and Laguna layers (model/tensor_parallel.py shards the rest).

Laguna: attention split by heads like any attention, with this layer's own query-head count; the softplus
output gate (g_proj: one row per head, or per channel) follows its heads; dense MLP, experts and the
ungated shared expert as in the Qwen MoEs (one all-reduce for the MoE block).

Gemma 4: attention split by heads (q/k norms and v's unit norm are per head), with each layer's own head
size and KV heads (a full layer's single KV head kept by every rank); attention_k_eq_v layers have no
v_proj; KV-shared layers have no K/V projections and read their source's cache, split alike. The GeGLU
MLP is column/row-parallel. The MoE block's experts are split by intermediate width, their sum
all-reduced on its own (a norm follows it before it meets the dense MLP's output). The router and the
per-layer inputs (small: their gate and projection) are replicated.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .gemma4 import Gemma4Attention, Gemma4DecoderLayer
from .laguna import LagunaAttention
from .moe import Experts
from .tensor_parallel import (
    attention_heads,
    row_parallel,
    rows_at,
    shard_experts,
    shard_mlp,
)


def shard_laguna_attention(attn: LagunaAttention, rank: int, size: int) -> None:
    q_heads, kv_heads, first_kv = attention_heads(attn.num_heads, attn.num_kv_heads, rank, size)
    d = attn.head_dim
    queries = (rank * q_heads * d, (rank + 1) * q_heads * d)
    attn.q_proj = rows_at(attn.q_proj, [queries])
    attn.k_proj = rows_at(attn.k_proj, [(first_kv * d, (first_kv + kv_heads) * d)])
    attn.v_proj = rows_at(attn.v_proj, [(first_kv * d, (first_kv + kv_heads) * d)])
    attn.g_proj = rows_at(attn.g_proj, [(rank * q_heads, (rank + 1) * q_heads) if attn.gate_per_head else queries])
    attn.o_proj = row_parallel(attn.o_proj, *queries)
    attn.num_heads, attn.num_kv_heads = q_heads, kv_heads


def shard_gemma4_layer(layer: Gemma4DecoderLayer, rank: int, size: int) -> None:
    _shard_gemma4_attention(layer.self_attn, rank, size)
    shard_mlp(layer.mlp, rank, size)
    if layer.moe:
        shard_experts(layer.experts, rank, size)
        layer.experts = ReducedExperts(layer.experts)


def _shard_gemma4_attention(attn: Gemma4Attention, rank: int, size: int) -> None:
    q_heads, kv_heads, first_kv = attention_heads(attn.num_heads, attn.num_kv_heads, rank, size)
    d = attn.head_dim
    queries = (rank * q_heads * d, (rank + 1) * q_heads * d)
    attn.q_proj = rows_at(attn.q_proj, [queries])
    if not attn.shares:  # a KV-shared layer reads its source's (split) cache
        keys = [(first_kv * d, (first_kv + kv_heads) * d)]
        attn.k_proj = rows_at(attn.k_proj, keys)
        if attn.v_proj is not None:
            attn.v_proj = rows_at(attn.v_proj, keys)
    attn.o_proj = row_parallel(attn.o_proj, *queries)
    attn.num_heads, attn.num_kv_heads = q_heads, kv_heads


class ReducedExperts(nn.Module):
    """Experts keeping a slice of their intermediate width: each rank's partial sum, all-reduced."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, ids, weights)
        dist.all_reduce(y)
        return y
