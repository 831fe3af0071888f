"""Poolside Laguna (HF model_type `laguna`: Laguna XS.2 / XS 2.1, S 2.1), as transformers' LagunaForCausalLM.

Per layer (`layer_types`), full or sliding-window attention, each kind with its own RoPE (theta,
partial rotary dims, YaRN where configured). Attention has its own query-head count per layer
(`num_attention_heads_per_layer`; the KV heads are the same in every layer), RMS-normalised q and k
per head, and a softplus output gate (`g_proj`, one gate per head or per channel) before o_proj.
The FFN is a dense SwiGLU MLP or, per `mlp_layer_types`, a SparseMoE (model/moe.py) routed by
sigmoid scores with a selection bias, soft-capped logits and a routed scaling factor, plus an
ungated shared expert. Checkpoint names are transformers' saved ones (`mlp.shared_expert.`,
`mlp.experts.e_score_correction_bias`, one matrix per expert), minus the leading `model.`.

Sliding-window layers declare their window in their PagedKVSpec; with full-attention layers beside
them every paged block is kept (model/cache_spec.release_window).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import CheckpointError
from ..kernels.attention import paged_attention
from ..kernels.forward_batch import ForwardBatch
from ..kernels.linear import linears, norm_linear, output_gate_linear
from ..kernels.rope import rope_and_write_kv
from .cache_spec import PagedKVSpec
from .config import HF_KEYS
from .laguna_config import LagunaConfig
from .moe import SparseMoE
from .rope import RopeTable, rotary_dim
from .tensor_check import check_config_against_tensors
from .transformer import MLP, RMSNorm, Transformer, fuse_linears


class LagunaAttention(nn.Module):
    def __init__(self, cfg: LagunaConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.heads_per_layer[layer], cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.gate_per_head = cfg.gate_per_head
        self.g_proj = nn.Linear(cfg.hidden_size, self.num_heads if cfg.gate_per_head else q_size, bias=False)
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim ** -0.5
        self.k_cache = None  # paged K/V stores, installed by the runner
        self.v_cache = None
        self.kv_group = 0  # the KV cache group whose tables this layer reads (set by the runner; mixed windows)
        self.qkvg = None  # q, k, v and the gate as one projection, after fuse()

    def cache_spec(self, model_dtype: torch.dtype, cache_type_k: str | None = "auto",
                   cache_type_v: str | None = "auto", rotate_k: bool = False) -> PagedKVSpec:
        return PagedKVSpec.of(self.num_kv_heads, self.head_dim, model_dtype, cache_type_k, cache_type_v,
                              self.sliding_window, rotate_k)

    def fuse(self) -> None:
        self.qkvg = self.qkvg or fuse_linears([self.q_proj, self.k_proj, self.v_proj, self.g_proj])

    def project(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """(q, k, v, gate, stream) of norm(x + residual)."""
        projections = (self.qkvg,) if self.qkvg is not None else (self.q_proj, self.k_proj, self.v_proj, self.g_proj)
        outs, residual = norm_linear(x, residual, norm.weight, norm.eps, projections)
        if len(outs) == 1:
            sizes = [m.out_features for m in (self.q_proj, self.k_proj, self.v_proj, self.g_proj)]
            outs = outs[0].split(sizes, dim=-1)
        return (*outs, residual)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention over the normalised input h (a bare call; the layer uses project + attend)."""
        projections = (self.q_proj, self.k_proj, self.v_proj, self.g_proj)
        return self.attend(*linears(h, projections), cos, sin, batch)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens, batch = q.shape[0], batch.group(self.kv_group)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = rope_and_write_kv(q, k, v, cos, sin, self.k_cache, self.v_cache, batch.slot_mapping, qk_norm)
        o = paged_attention(q, self.k_cache, self.v_cache, batch, self.scale, self.sliding_window)
        heads = (gate.unsqueeze(-1).expand(tokens, self.num_heads, self.head_dim) if self.gate_per_head
                 else gate.reshape(tokens, self.num_heads, self.head_dim))
        return output_gate_linear(heads, o.reshape(tokens, -1), self.o_proj, "softplus")


class LagunaDecoderLayer(nn.Module):
    def __init__(self, cfg: LagunaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.kind = cfg.attention_kinds[layer]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LagunaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, cfg.routing(), shared_expert_gated=False) if cfg.moe_layers[layer] else MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: dict, sin: dict, batch: ForwardBatch):
        """DecoderLayer's contract; cos/sin hold each layer kind's RoPE rows (LayerKindRope)."""
        q, k, v, gate, residual = self.self_attn.project(self.input_layernorm, x, residual)
        if self.layer - 1 in batch.capture_layers:
            batch.captured[self.layer - 1] = residual
        h = self.self_attn.attend(q, k, v, gate, cos[self.kind], sin[self.kind], batch)
        return self.mlp.after_norm(self.post_attention_layernorm, h, residual)


class LayerKindRope:
    """One RopeTable per layer kind; lookup gives {kind: cos}, {kind: sin} (Transformer.forward hands
    them to every layer, which takes its kind's)."""

    def __init__(self, cfg: LagunaConfig):
        self.tables = {}
        for kind in dict.fromkeys(cfg.attention_kinds):
            rope, factor = cfg.rope_of(kind)
            self.tables[kind] = RopeTable(rope, rotary_dim(cfg.head_dim, factor))

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None) -> tuple[dict, dict]:
        if bound is None:  # once for all tables
            bound = int(positions.max()) + 1 if positions.numel() else 0
        rows = {kind: table.lookup(positions, dtype, bound) for kind, table in self.tables.items()}
        return {kind: r[0] for kind, r in rows.items()}, {kind: r[1] for kind, r in rows.items()}

    def reserve(self, length: int, device) -> None:
        for table in self.tables.values():
            table.reserve(length, device)


class LagunaTransformer(Transformer):
    """Transformer's embedding, final norm, LM head, forward and cache specs; Laguna's layers and RoPE."""

    def __init__(self, cfg: LagunaConfig):
        super().__init__(cfg, LagunaDecoderLayer)
        self.rope = LayerKindRope(cfg)


def check_laguna_tensors(cfg: LagunaConfig, shapes: dict, source: str) -> None:
    """Every layer's q_proj and g_proj agree with its head count, then the generic checks (layer count,
    embedding, KV heads, dense FFN, experts), before anything is allocated."""
    for layer, heads in enumerate(cfg.heads_per_layer):
        gate = heads if cfg.gate_per_head else heads * cfg.head_dim
        for name, rows in (("q_proj", heads * cfg.head_dim), ("g_proj", gate)):
            tensor = f"layers.{layer}.self_attn.{name}.weight"
            want = (rows, cfg.hidden_size)
            if tensor in shapes and tuple(shapes[tensor]) != want:
                raise CheckpointError(f"{source}: tensor {tensor} has shape {list(shapes[tensor])}, but "
                                      f"num_attention_heads_per_layer[{layer}] ({heads}) and head_dim "
                                      f"({cfg.head_dim}) make it {list(want)}")
    first = dataclasses.replace(cfg, num_heads=cfg.heads_per_layer[0])  # the generic check reads layer 0's q_proj
    check_config_against_tensors(first, shapes, source, HF_KEYS)

