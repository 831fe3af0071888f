"""Tensor parallelism for the Qwen 3.5 / 3.6 hybrids: one rank's shard of a Gated DeltaNet layer, a gated
attention layer and a SparseMoE with a shared expert (model/tensor_parallel.py shards the rest).

Gated DeltaNet splits by heads: rank r keeps key heads [r*Hk/N, (r+1)*Hk/N) and the value heads that read
them, [r*Hv/N, (r+1)*Hv/N) (value head h reads key head h // (Hv/Hk), so the groups never straddle
ranks). Its rows of in_proj_qkv (its q, k and v channels), of in_proj_z / b / a, its conv1d channels and
its entries of A_log and dt_bias follow; the per-head gated norm is replicated; out_proj is row-parallel
(one all-reduce). Each rank's recurrent state pool then holds its heads only (the module's head counts
size the RecurrentSpec). Gated attention splits like plain attention, each query head's output gate
(its half of q_proj's rows) with it. The shared expert splits like a dense MLP; its sigmoid gate reads
the full hidden state (replicated), so gate * (sum of partials) is the sum of gated partials: SparseMoE's
own forward then yields this rank's partial sum of routed and shared output, and model/tensor_parallel's
ParallelMoE adds them up in one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from .deltanet import GatedDeltaNet
from .gated_attention import GatedAttention
from .moe import SparseMoE
from .tensor_parallel import (
    RowParallel,
    attention_heads,
    row_parallel,
    rows_at,
    shard_mlp,
)


def shard_deltanet(net: GatedDeltaNet, rank: int, size: int) -> None:
    """net's heads of this rank (see the module docstring), in place, before fuse()."""
    hk, hv, dk, dv = net.num_k_heads // size, net.num_v_heads // size, net.head_k_dim, net.head_v_dim
    q = (rank * hk * dk, (rank + 1) * hk * dk)
    k = (net.key_dim + q[0], net.key_dim + q[1])
    v = (2 * net.key_dim + rank * hv * dv, 2 * net.key_dim + (rank + 1) * hv * dv)
    heads = (rank * hv, (rank + 1) * hv)
    values = (rank * hv * dv, (rank + 1) * hv * dv)
    channels = torch.cat([torch.arange(*q), torch.arange(*k), torch.arange(*v)])
    net.in_proj_qkv = rows_at(net.in_proj_qkv, [q, k, v])
    net.in_proj_z = rows_at(net.in_proj_z, [values])
    net.in_proj_b = rows_at(net.in_proj_b, [heads])
    net.in_proj_a = rows_at(net.in_proj_a, [heads])
    net.conv1d.weight = nn.Parameter(net.conv1d.weight.detach()[channels].clone(), requires_grad=False)
    net.A_log = nn.Parameter(net.A_log.detach()[slice(*heads)].clone(), requires_grad=False)
    net.dt_bias = nn.Parameter(net.dt_bias.detach()[slice(*heads)].clone(), requires_grad=False)
    net.out_proj = row_parallel(net.out_proj, *values)
    net.num_k_heads, net.num_v_heads = hk, hv
    net.key_dim, net.value_dim = hk * dk, hv * dv
    net.conv_dim = 2 * net.key_dim + net.value_dim


def shard_gated_attention(attn: GatedAttention, rank: int, size: int) -> None:
    """Query heads (each one's [query | gate] rows of q_proj) and KV heads as model/tensor_parallel's
    attention; o_proj row-parallel."""
    q_heads, kv_heads, first_kv = attention_heads(attn.num_heads, attn.num_kv_heads, rank, size)
    d = attn.head_dim
    attn.q_proj = rows_at(attn.q_proj, [(rank * q_heads * 2 * d, (rank + 1) * q_heads * 2 * d)])
    attn.k_proj = rows_at(attn.k_proj, [(first_kv * d, (first_kv + kv_heads) * d)])
    attn.v_proj = rows_at(attn.v_proj, [(first_kv * d, (first_kv + kv_heads) * d)])
    attn.o_proj = row_parallel(attn.o_proj, rank * q_heads * d, (rank + 1) * q_heads * d)
    attn.num_heads, attn.num_kv_heads = q_heads, kv_heads


def shard_shared_expert(moe: SparseMoE, rank: int, size: int) -> None:
    """The shared expert's slice of its width, its down projection left unreduced (a partial sum the
    MoE's all-reduce adds up; a bias kept on rank 0 alone, so it is added once)."""
    mlp = moe.shared_expert
    shard_mlp(mlp, rank, size)
    down: RowParallel = mlp.down_proj
    local = down.local
    if down.bias is not None and rank == 0:
        local.bias = nn.Parameter(down.bias, requires_grad=False) if isinstance(local, nn.Linear) else down.bias
    mlp.down_proj = local

