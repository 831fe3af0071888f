"""Gemma 4 text models (31B dense, 26B-A4B MoE; HF model_type `gemma4`, `gemma4_text`), as
transformers' Gemma4TextModel computes them (config fields: model/gemma4_config.py).

Each layer: sandwich RMSNorms around attention and the FFN (norm -> block -> norm -> + residual),
then optionally the per-layer input (gelu(gate(x)) * its per-layer embedding -> projection -> norm
-> + residual), and the layer's learned scalar. RMSNorm weights multiply as they are (w, not 1 + w).
Attention: q and k RMS-normalised per head, v normalised without a weight, scale 1.0 (the norms
set the logit size), RoPE per layer type (sliding layers their table, full layers theirs, which may
turn only part of each head: proportional RoPE); full-attention layers may have their own head size
and K/V head count and, with attention_k_eq_v, take v from k's projection. The last
num_kv_shared_layers layers keep no K/V: they attend to an earlier layer's cache (SharedKVSpec).
The MoE block of 26B-A4B runs beside the dense MLP: a router over the pre-FFN stream (unit RMSNorm,
scaled, softmax top-k renormalised, times a per-expert scale) and GeGLU experts (model/moe.Experts:
the Triton expert kernels on GPUs, which weigh each expert's output by these weights as Qwen's).
Embeddings are scaled by sqrt(hidden_size) in the model dtype; the logits are soft-capped.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.activation import gelu_tanh_and_mul
from ..kernels.attention import attention_output
from ..kernels.dispatch import decided_once
from ..kernels.forward_batch import ForwardBatch
from ..kernels.linear import gelu_mul_linear, linear, linears, norm_rows, takes_int8
from ..kernels.moe import route_experts
from ..kernels.norm import rms_norm, rms_norm_add, rms_norm_many, rms_norm_pair_add, unit_rms_norm
from ..kernels.rope import apply_rope, rope_and_write_kv
from .cache_spec import PagedKVSpec, SharedKVSpec
from .gemma4_config import FULL, Gemma4Config
from .moe import Experts
from .rope import RopeTable
from .transformer import RMSNorm, Transformer, fuse_linears


def rope_table(rotary, head_dim: int) -> RopeTable:
    """RoPE over head_dim; proportional RoPE zeroes the frequencies past its fraction (those dims stay put)."""
    table = RopeTable(rotary.rope, head_dim)
    table.inv_freq[int(rotary.fraction * head_dim // 2):] = 0.0
    return table


class RopeTables(dict):
    """The RoPE table of each layer type; reserve() covers them all (a captured CUDA graph must
    never see a table regrow)."""

    def reserve(self, length: int, device) -> None:
        for table in self.values():
            table.reserve(length, device)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int):
        super().__init__()
        self.kind = cfg.layer_types[layer]
        self.num_heads, self.head_dim = cfg.num_heads, cfg.layer_head_dims[layer]
        self.num_kv_heads = cfg.layer_kv_heads[layer]
        self.sliding_window = cfg.sliding_windows[layer]
        self.eps = cfg.rms_norm_eps
        self.source = cfg.kv_sources[layer]
        self.k_eq_v = cfg.attention_k_eq_v and self.kind == FULL
        q_size, kv_size = cfg.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if self.source == layer:
            self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
            self.v_proj = None if self.k_eq_v else nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.k_cache = None  # paged K/V stores, installed by the runner (a KV-shared layer: its source's)
        self.v_cache = None
        self.shares = ()  # (source attention,): a tuple, so the source is not registered as a submodule
        self.kv_group = 0  # the KV cache group whose tables this layer reads (set by the runner; mixed windows)

    def cache_spec(self, model_dtype: torch.dtype, cache_type_k: str | None = "auto",
                   cache_type_v: str | None = "auto", rotate_k: bool = False):
        if self.shares:
            return SharedKVSpec(self.source, self.sliding_window)
        return PagedKVSpec.of(self.num_kv_heads, self.head_dim, model_dtype, cache_type_k, cache_type_v,
                              self.sliding_window, rotate_k)

    def input_projections(self) -> tuple:
        """q, and (a layer with its own K/V) k and v (none where v is k: k_eq_v)."""
        if self.shares:
            return (self.q_proj,)
        return (self.q_proj, self.k_proj) + ((self.v_proj,) if self.v_proj is not None else ())

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows: h rounded to int8 by the norm, if it was (norm_rows): the products share it."""
        tokens = h.shape[0]
        batch = batch.group(self.shares[0].kv_group if self.shares else self.kv_group)
        q, *kv = linears(h, self.input_projections(), rows)
        q = q.view(tokens, self.num_heads, self.head_dim)
        if self.shares:  # K/V come from the source layer's cache
            k_cache, v_cache = self.shares[0].k_cache, self.shares[0].v_cache
            q = apply_rope(rms_norm(q, self.q_norm.weight, self.eps), cos, sin)
        else:  # q/k norms, v's unit norm, RoPE and the K/V writes: one launch
            k_cache, v_cache = self.k_cache, self.v_cache
            k = kv[0].view(tokens, self.num_kv_heads, self.head_dim)
            v = k if self.v_proj is None else kv[1].view(tokens, self.num_kv_heads, self.head_dim)
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.eps)
            q = rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping, qk_norm, self.eps)
        return attention_output(q.contiguous(), k_cache, v_cache, batch, 1.0, self.sliding_window, self.o_proj)


class GeGLU(nn.Module):
    """gate/up/down with gelu-tanh: Gemma's dense MLP."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.gate_up = None  # gate and up as one projection, after fuse()

    def fuse(self) -> None:
        self.gate_up = self.gate_up or fuse_linears([self.gate_proj, self.up_proj])

    def input_projections(self) -> tuple:
        return (self.gate_up,) if self.gate_up is not None else (self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows: x rounded to int8 by its norm, if it was (norm_rows)."""
        outs = linears(x, self.input_projections(), rows)
        gate, up = outs[0].chunk(2, dim=-1) if len(outs) == 1 else outs
        return gelu_mul_linear(gate, up, self.down_proj)


class Gemma4Router(nn.Module):
    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.top_k, self.eps, self.root = cfg.num_experts_per_tok, cfg.rms_norm_eps, cfg.hidden_size ** -0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.register_buffer("norm_weight", None, persistent=False)  # scale * root, after fuse()

    def fuse(self) -> None:
        """The norm's weight and the 1 / sqrt(hidden) factor as one (an RMSNorm launch), rounded once."""
        self.norm_weight = (self.scale.detach().float() * self.root).to(self.scale.dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k] in x's dtype): after fuse(), a norm launch, the
        product and the router kernel (softmax top-k renormalised, times the per-expert scale)."""
        if self.norm_weight is not None:
            return self.route(rms_norm(x, self.norm_weight.to(x.dtype), self.eps))
        return self.route(unit_rms_norm(x, self.eps) * self.scale * self.root)

    def route(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's experts and weights from its normalised input (norm_weight's norm of the stream)."""
        logits = linear(normed, self.proj)  # the measured GEMV route of a float router, not torch's
        chosen = route_experts(logits, self.top_k, softmax=True, softcap=0.0, bias=None, norm=True,
                               dtype=normed.dtype, expert_scale=self.per_expert_scale)
        if chosen is not None:
            return chosen
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids].float()
        return ids, weights.to(normed.dtype)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int):
        super().__init__()
        self.layer = layer
        self.kind = cfg.layer_types[layer]
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(cfg, layer)
        width = cfg.intermediate_size * (2 if cfg.double_wide_mlp[layer] else 1)
        self.mlp = GeGLU(cfg.hidden_size, width)
        self.moe = cfg.moe_layers[layer]
        if self.moe:
            self.router = Gemma4Router(cfg)
            self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, "gelu_pytorch_tanh")
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            self.pre_feedforward_layernorm_2 = norm()
        self.per_layer = cfg.hidden_size_per_layer_input
        if self.per_layer:
            self.per_layer_input_gate = nn.Linear(cfg.hidden_size, self.per_layer, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer, cfg.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1))
        # after fuse_norms(): the MoE layer's three norms of its FFN input (dense MLP, experts, router)
        # and its three FFN post-norms, stacked for one launch each
        self.register_buffer("ffn_in_norms", None, persistent=False)
        self.register_buffer("ffn_out_norms", None, persistent=False)

    def fuse_norms(self) -> None:
        if self.moe:
            self.router.fuse()
            stack = lambda *ws: torch.stack([w.detach().to(self.layer_scalar.dtype) for w in ws])
            self.ffn_in_norms = stack(self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm_2.weight,
                                      self.router.norm_weight)
            self.ffn_out_norms = stack(self.post_feedforward_layernorm_1.weight,
                                       self.post_feedforward_layernorm_2.weight, self.post_feedforward_layernorm.weight)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos, sin, batch) -> torch.Tensor:
        """The residual stream after this layer; the layer scalar multiplies in the last add's launch."""
        norm = self.input_layernorm  # its launch rounds the rows q / k / v take, where they take int8
        h, _, rows = norm_rows(x, None, norm.weight, norm.eps, self.self_attn.input_projections())
        x = _add_norm(self.post_attention_layernorm, self.self_attn(h, cos, sin, batch, rows), x)
        scale = None if self.per_layer else self.layer_scalar
        if self.ffn_in_norms is not None and self.ffn_in_norms.dtype == x.dtype:
            x = self._fused_moe_ffn(x, scale)
        else:
            norm = self.pre_feedforward_layernorm  # its launch rounds the rows the MLP's int8 products take
            h, _, rows = norm_rows(x, None, norm.weight, norm.eps, self.mlp.input_projections())
            h = self.mlp(h, rows)
            if self.moe:
                h = _add_norm(self.post_feedforward_layernorm_2, self.experts_out(x), self.post_feedforward_layernorm_1(h))
            x = _add_norm(self.post_feedforward_layernorm, h, x, scale)
        if self.per_layer:
            h = gelu_tanh_and_mul(self.per_layer_input_gate(x), per_layer_input)
            x = _add_norm(self.post_per_layer_input_norm, self.per_layer_projection(h), x, self.layer_scalar)
        return x

    def _fused_moe_ffn(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The MoE layer's FFN after fuse_norms(): its three input norms in one launch (the first one
        rounding the MLP's int8 rows), the MLP and the experts, then the post-norms and the residual
        add in one more."""
        eps = self.pre_feedforward_layernorm.eps
        (h, h_experts, h_router), rows = rms_norm_many(
            x, self.ffn_in_norms, eps, rounded=takes_int8(self.mlp.input_projections(), x))
        experts = self.experts(h_experts, *self.router.route(h_router))
        return rms_norm_pair_add(self.mlp(h, rows), experts, self.ffn_out_norms, eps, x, scale)

    def experts_out(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE block's experts for the pre-FFN stream x, before their post-norm (experts:
        kernels/moe.py on GPUs)."""
        return self.experts(self.pre_feedforward_layernorm_2(x), *self.router(x))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE block's part of the FFN output for the pre-FFN stream x."""
        return self.post_feedforward_layernorm_2(self.experts_out(x))


def _add_norm(norm: RMSNorm, y: torch.Tensor, stream: torch.Tensor, scale: torch.Tensor | None = None
              ) -> torch.Tensor:
    """(stream + norm(y)) [* scale] in one launch where Triton runs (kernels/norm.rms_norm_add)."""
    return rms_norm_add(y, norm.weight, norm.eps, stream, scale)


class Gemma4Model(Transformer):
    """Transformer's embedding table, final norm, LM head and cache plumbing; Gemma 4's layers,
    scaled embeddings, per-layer inputs, two RoPE tables and soft-capped logits."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__(cfg, Gemma4DecoderLayer)
        for layer in self.layers:
            attn = layer.self_attn
            if attn.source != layer.layer:
                attn.shares = (self.layers[attn.source].self_attn,)
        self.rope = RopeTables({kind: rope_table(cfg.rotary[kind], self._head_dim(kind)) for kind in cfg.rotary})
        per_layer = cfg.hidden_size_per_layer_input
        if per_layer:
            size = cfg.num_layers * per_layer
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, size)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, size, bias=False)
            self.per_layer_projection_norm = RMSNorm(per_layer, cfg.rms_norm_eps)

    def _head_dim(self, kind: str) -> int:
        return next(layer.self_attn.head_dim for layer in self.layers if layer.kind == kind)

    def cache_specs(self, cache_type_k: str | None = "auto", cache_type_v: str | None = "auto",
                    rotate_k: bool = False) -> list:
        """Per layer: paged K/V (windowed on sliding layers), or SharedKVSpec for KV-shared layers."""
        return [layer.self_attn.cache_spec(self.dtype, cache_type_k, cache_type_v, rotate_k) for layer in self.layers]

    def fuse_projections(self) -> None:
        """The GeGLU MLP's gate and up as one product (q/k/v keep their own); the routers' norm weights."""
        for layer in self.layers:
            layer.mlp.fuse()
            layer.fuse_norms()

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[T, layers, per-layer size]: each token's per-layer embedding mixed with a projection of x."""
        cfg = self.config
        size = cfg.hidden_size_per_layer_input
        if not size:
            return None
        shape = (ids.shape[0], cfg.num_layers, size)
        table = self.embed_tokens_per_layer(ids) * torch.tensor(size ** 0.5).to(x.dtype)
        projected = self.per_layer_model_projection(x) * cfg.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + table.view(shape)) * 2.0 ** -0.5

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """New tokens of a ragged batch -> final hidden states [T, hidden]; the streams after the
        layers in batch.capture_layers go to batch.captured."""
        with decided_once():
            ids = batch.input_ids
            x = self.embed(ids)
            per_layer = self.per_layer_inputs(ids, x)
            tables = {kind: table.lookup(batch.positions, x.dtype, batch.position_bound)
                      for kind, table in self.rope.items()}
            for i, layer in enumerate(self.layers):
                x = layer(x, None if per_layer is None else per_layer[:, i], *tables[layer.kind], batch)
                if i in batch.capture_layers:
                    batch.captured[i] = x
            return self.norm(x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows scaled by sqrt(hidden_size), the scale rounded to the model dtype (as
        transformers' Gemma4TextScaledWordEmbedding)."""
        x = self.embed_tokens(ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

