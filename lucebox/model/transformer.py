"""The decoder-only transformer shared by the Llama, Mistral, Qwen2 and Qwen3 families.

Module names follow the HF checkpoints (minus the leading `model.`) so that loading is a name
lookup. Linear layers are plain nn.Linear or QuantLinear (GGUF weights that stay quantised); the
layers say which products follow which op (`norm -> q/k/v`, `silu * up -> down`) and
kernels/linear.py picks the kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.activation import silu_and_mul
from ..kernels.attention import attention_output
from ..kernels.dispatch import decided_once
from ..kernels.forward_batch import ForwardBatch
from ..kernels.linear import FusedProjection, linears, norm_linear, silu_mul_linear
from ..kernels.norm import rms_norm, rms_norm_residual
from ..kernels.rope import rope_and_write_kv
from ..weights.quant import QuantEmbedding, QuantLinear, QuantTensor
from .cache_spec import PagedKVSpec
from .config import ModelConfig
from .moe import SparseMoE
from .rope import RopeTable


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual) in one pass."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_residual(x, residual, self.weight, self.eps)


def fuse_linears(layers: list[nn.Module]):
    """One projection for several linears that read the same input, so one GEMV replaces several
    (decode reads the same bytes in fewer, larger kernels): float nn.Linear weights of one dtype,
    or quantised ones of one GGUF type. Each linear's weight (or raw rows) becomes a row slice of
    the fused tensor: no memory is added and every other reader of the modules keeps working.
    Returns the fused projection x -> [.., sum of out_features] (a FusedProjection, or a quantised
    projection's forward), or None when the weights cannot be fused. For inference: the slices
    are detached."""
    if len({m.bias is None for m in layers}) != 1:
        return None
    bias = torch.cat([m.bias.detach() for m in layers]) if layers[0].bias is not None else None
    if all(type(m) is nn.Linear for m in layers):
        if len({(m.weight.dtype, m.weight.device) for m in layers}) != 1:
            return None
        fused = torch.cat([m.weight.detach() for m in layers])
        for m, rows, b in _slices(layers, fused, bias):
            m.weight = nn.Parameter(rows, requires_grad=False)
            if b is not None:
                m.bias = nn.Parameter(b, requires_grad=False)
        return FusedProjection(fused, bias)
    if all(type(m) is QuantLinear for m in layers):  # not a subclass that transforms its input
        if len({(m.qtype, m.in_features, m.qweight.device, m.split_rows) for m in layers}) != 1:
            return None
        shape = (sum(m.out_features for m in layers), layers[0].in_features)
        projection = QuantLinear(QuantTensor(torch.cat([m.qweight for m in layers]), layers[0].qtype, shape,
                                             "+".join(m.name for m in layers)), bias)
        if layers[0].split_rows:  # rows in the GPU's split layout already (split_quant_rows came first)
            projection.use_split_rows(reorder=False)
        for m, rows, b in _slices(layers, projection.qweight, bias):
            m.qweight, m.bias = rows, b
        return projection.forward
    return None


def fused_projections(module: nn.Module) -> list[str]:
    """The names of module's attributes that hold a projection fuse_linears made (a FusedProjection,
    or a quantised projection's forward: a bound method of an unregistered QuantLinear), whatever a
    layer calls them (qkv, gate_up, Laguna's qkvg, DeltaNet's projections ...)."""
    return [name for name, value in vars(module).items()
            if isinstance(value, FusedProjection) or isinstance(getattr(value, "__self__", None), QuantLinear)]


def _slices(layers, fused: torch.Tensor, bias: torch.Tensor | None):
    row = 0
    for m in layers:
        n = m.out_features
        yield m, fused[row:row + n], (bias[row:row + n] if bias is not None else None)
        row += n


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim ** -0.5
        # Paged K and V stores of this layer (model/kv_cache.PagedKVCache), built from cache_spec by the runner.
        self.k_cache = None
        self.v_cache = None
        self.kv_group = 0  # the KV cache group whose tables this layer reads (set by the runner; mixed windows)
        self.qkv = None  # q, k and v as one projection, after fuse()
        self.qk = None  # or q and k alone, when v's weights differ (e.g. Q4_K_M: v in Q6_K)

    def cache_spec(self, model_dtype: torch.dtype, cache_type_k: str | None = "auto",
                   cache_type_v: str | None = "auto", rotate_k: bool = False) -> PagedKVSpec:
        """The state this layer keeps per sequence: paged K/V, bounded by its sliding window."""
        return PagedKVSpec.of(self.num_kv_heads, self.head_dim, model_dtype, cache_type_k, cache_type_v,
                              self.sliding_window, rotate_k)

    def fuse(self) -> None:
        if self.qkv is None and self.qk is None:
            self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            if self.qkv is None:
                self.qk = fuse_linears([self.q_proj, self.k_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention over the normalised input x."""
        return self.attend(*self._project(x), cos, sin, batch)

    def project(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """(q, k, v, stream) of norm(x + residual): norm -> the q/k/v projections."""
        outs, residual = norm_linear(x, residual, norm.weight, norm.eps, self._projections())
        return (*self._qkv(outs), residual)

    def _project(self, h: torch.Tensor):
        """(q, k, v) of the normalised input h."""
        return self._qkv(linears(h, self._projections()))

    def _projections(self) -> tuple:
        if self.qkv is not None:
            return (self.qkv,)
        return (self.qk, self.v_proj) if self.qk is not None else (self.q_proj, self.k_proj, self.v_proj)

    def _qkv(self, outs: tuple[torch.Tensor, ...]):
        """(q, k, v) of the products of _projections()."""
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        if len(outs) == 1:
            return outs[0].split(sizes, dim=-1)
        if len(outs) == 2:
            return (*outs[0].split(sizes[:2], dim=-1), outs[1])
        return outs

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: ForwardBatch) -> torch.Tensor:
        tokens, batch = q.shape[0], batch.group(self.kv_group)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        q = rope_and_write_kv(q, k, v, cos, sin, self.k_cache, self.v_cache, batch.slot_mapping, qk_norm)
        return attention_output(q, self.k_cache, self.v_cache, batch, self.scale, self.sliding_window, self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up = None  # gate and up as one projection, after fuse()

    def fuse(self) -> None:
        self.gate_up = self.gate_up or fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down(self.gate_up(x))
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))

    def after_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), x + residual): norm -> gate/up, where they are one projection."""
        if self.gate_up is not None:
            (gate_up,), residual = norm_linear(x, residual, norm.weight, norm.eps, (self.gate_up,))
            return self.down(gate_up), residual
        h, residual = norm(x, residual)
        return self(h), residual

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of the fused projection's [gate | up]."""
        return silu_mul_linear(gate_up, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.moe_layers[layer] else MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, batch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual stream before it): the residual stream after this
        layer is their sum, which the next norm adds as it normalises (vLLM's layout: one fused
        add+norm op per residual connection). residual None: x is the embedding."""
        q, k, v, residual = self.self_attn.project(self.input_layernorm, x, residual)
        if self.layer - 1 in batch.capture_layers:  # the stream after the previous layer, summed by this norm
            batch.captured[self.layer - 1] = residual
        h = self.self_attn.attend(q, k, v, cos, sin, batch)
        return self.mlp.after_norm(self.post_attention_layernorm, h, residual)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer=None, rope_dim: int | None = None):
        """`layer(cfg, i)` builds layer i (default DecoderLayer); RoPE covers `rope_dim` dims (default head_dim)."""
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList((layer or DecoderLayer)(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RopeTable(cfg.rope, rope_dim or cfg.head_dim)

    def cache_specs(self, cache_type_k: str | None = "auto", cache_type_v: str | None = "auto",
                    rotate_k: bool = False) -> list[PagedKVSpec]:
        """Per layer, the state it keeps per sequence (model/cache_spec.py), in the given KV cache types."""
        return [layer.self_attn.cache_spec(self.dtype, cache_type_k, cache_type_v, rotate_k) for layer in self.layers]

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one GEMV each, where their weights allow it (float of one dtype, or
        quantised of one type): fewer, larger kernels per decode step. For inference."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def split_quant_rows(self) -> None:
        """Q8_0 and Q6_K linears and embedding tables (a tied LM head) in the GPU decode kernels'
        split layout (use_split_rows), after fuse_projections: each tensor reordered once (the fused projection
        first, its layers' row slices then only told). Idempotent. For inference."""
        linears = [m for m in self.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
        for module in self.modules():  # fused projections are bound methods of unregistered QuantLinears
            for name in fused_projections(module):
                owner = getattr(getattr(module, name), "__self__", None)  # None: float (FusedProjection)
                if isinstance(owner, QuantLinear):
                    linears.append(owner)
        done: list[tuple[int, int]] = []  # byte ranges reordered
        for m in sorted(linears, key=lambda m: -m.qweight.numel()):
            if m.split_rows or not m.splits_rows():
                continue
            start = m.qweight.data_ptr()
            end = start + m.qweight.numel()
            inside = any(a <= start and end <= b for a, b in done)
            m.use_split_rows(reorder=not inside)
            if not inside:
                done.append((start, end))

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """New tokens of a ragged batch -> final hidden states [T, hidden] (before the LM head).

        Hidden states after the layers in batch.capture_layers are stored in batch.captured: the
        residual stream as the next norm sums it (no separate add)."""
        with decided_once():  # the kernels' Triton-or-torch choice: the environment read once
            x = self.embed(batch.input_ids)
            cos, sin = self.rope.lookup(batch.positions, x.dtype, batch.position_bound)
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, cos, sin, batch)
            h, stream = self.norm(x, residual)
        if len(self.layers) - 1 in batch.capture_layers:
            batch.captured[len(self.layers) - 1] = stream
        return h

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer receives (a family may scale them: Gemma 4)."""
        return self.embed_tokens(ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> float32 logits (a family may post-process: Gemma 4 soft-caps)."""
        return self.head_logits(hidden)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's product alone, float32: what a DFlash drafter's logits start from."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if isinstance(head, nn.Embedding):
            return F.linear(hidden, head.weight).float()
        if hasattr(head, "project"):  # tied head over a quantised (QuantEmbedding) or vocab-parallel table
            return head.project(hidden).float()
        return head(hidden).float()
