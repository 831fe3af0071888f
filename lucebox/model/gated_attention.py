"""Gated full attention (Qwen 3.5 "full_attention" layers).

Differs from model/transformer.Attention in three ways:
  q_proj yields, per head, [query (head_dim) | output gate (head_dim)]; the attention output is
  multiplied by sigmoid(gate) before o_proj;
  q and k are RMS-normalised per head (weights stored as 1 + w: Qwen 3.5 norms are zero-centred,
  the loader adds the 1 once);
  RoPE turns only the first rotary_dim = head_dim * partial_rotary_factor dims of each head.
K/V go to the same paged cache as every other attention layer.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.attention import paged_attention
from ..kernels.forward_batch import ForwardBatch
from ..kernels.linear import linears, output_gate_linear
from ..kernels.rope import rope_and_write_kv
from .cache_spec import PagedKVSpec
from .transformer import RMSNorm


class GatedAttention(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5
        self.sliding_window = None
        self.k_cache = None  # paged K/V stores, installed by the runner
        self.v_cache = None

    def cache_spec(self, model_dtype: torch.dtype, cache_type_k: str | None = "auto",
                   cache_type_v: str | None = "auto", rotate_k: bool = False) -> PagedKVSpec:
        return PagedKVSpec.of(self.num_kv_heads, self.head_dim, model_dtype, cache_type_k, cache_type_v, None,
                              rotate_k)

    def input_projections(self) -> tuple:
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows: h rounded to int8 by the norm, if it was (norm_rows): the products share it."""
        tokens = h.shape[0]
        q_and_gate, k, v = linears(h, self.input_projections(), rows)
        q, gate = q_and_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = rope_and_write_kv(q, k, v, cos, sin, self.k_cache, self.v_cache, batch.slot_mapping, qk_norm)
        o = paged_attention(q, self.k_cache, self.v_cache, batch, self.scale)
        return output_gate_linear(gate, o.reshape(tokens, -1), self.o_proj, "sigmoid")
