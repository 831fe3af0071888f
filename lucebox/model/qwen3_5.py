"""Qwen 3.5 / 3.6 hybrids (HF model_type `qwen3_5`, `qwen3_5_text`; MoE: `qwen3_5_moe`,
`qwen3_5_moe_text`): per `layer_types`, a Gated DeltaNet layer (model/deltanet.py) or a gated
full-attention layer (model/gated_attention.py), each followed by the usual SwiGLU MLP, or in the
MoE models by a SparseMoE with a shared expert (model/moe.py).

Checkpoints: `Qwen3_5ForConditionalGeneration` (text model under `model.language_model.`, a vision
tower under `model.visual.`, skipped) or the text-only `Qwen3_5ForCausalLM` (`model.`). Their
RMSNorms (layer norms, final norm, q/k norms) are zero-centred, x * (1 + w): the loader stores
1 + w once, so the layers run the plain RMSNorm of every other family. The gated norm inside
DeltaNet (`linear_attn.norm`) multiplies by w itself and is kept as is.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from ..kernels.gated_delta import warm_up_chunk
from ..kernels.linear import norm_rows
from .deltanet import GatedDeltaNet
from .gated_attention import GatedAttention
from .moe import SparseMoE
from .rope import rotary_dim
from .transformer import MLP, RMSNorm, Transformer

log = logging.getLogger("lucebox")

LAYER_NAME = re.compile(r"layers\.(\d+)\.")
LINEAR, FULL = "linear_attention", "full_attention"
HF_TEXT_PREFIXES = ("model.language_model.", "model.")  # ConditionalGeneration, then CausalLM
SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # the vision tower; multi-token-prediction heads


def is_hybrid(cfg) -> bool:
    return LINEAR in (getattr(cfg, "layer_types", None) or ())


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.layer = layer
        self.kind = cfg.layer_types[layer]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = GatedAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.moe_layers[layer] else MLP(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == LINEAR else self.self_attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, batch):
        """DecoderLayer's contract: (x, residual) -> (mlp output, residual stream before it)."""
        norm = self.input_layernorm  # its launch rounds h to int8 too where the mixer's products take it
        h, residual, rows = norm_rows(x, residual, norm.weight, norm.eps, self.mixer.input_projections())
        if self.layer - 1 in batch.capture_layers:
            batch.captured[self.layer - 1] = residual
        h = self.linear_attn(h, batch, rows) if self.kind == LINEAR else self.self_attn(h, cos, sin, batch, rows)
        return self.mlp.after_norm(self.post_attention_layernorm, h, residual)


class HybridTransformer(Transformer):
    """Transformer's embedding, final norm, LM head and forward; hybrid layers and partial RoPE."""

    def __init__(self, cfg):
        super().__init__(cfg, HybridDecoderLayer, rotary_dim(cfg.head_dim, cfg.partial_rotary_factor))

    def cache_specs(self, cache_type_k: str | None = "auto", cache_type_v: str | None = "auto",
                    rotate_k: bool = False) -> list:
        """Per layer: RecurrentSpec (DeltaNet) or PagedKVSpec (full attention)."""
        return [layer.linear_attn.cache_spec() if layer.kind == LINEAR
                else layer.self_attn.cache_spec(self.dtype, cache_type_k, cache_type_v, rotate_k)
                for layer in self.layers]

    def warm_up(self) -> None:
        """Compile the prefill kernels before the first request (every DeltaNet layer has the same heads)."""
        mixer = next(layer.linear_attn for layer in self.layers if layer.kind == LINEAR)
        warm_up_chunk(mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, self.dtype,
                      self.device)

    def fuse_projections(self) -> None:
        """gate/up as one GEMV per dense MLP or shared expert, DeltaNet's four input projections as
        one (gated attention's stay separate)."""
        for layer in self.layers:
            layer.mlp.fuse()
            if layer.kind == LINEAR:
                layer.linear_attn.fuse()


def hf_text_tensors(tensors, source: str):
    """(name without the text model's prefix, tensor) of a Qwen 3.5 checkpoint: the vision tower
    and MTP heads skipped (one log line), zero-centred norm weights w stored as 1 + w."""
    skipped = 0
    for name, tensor in tensors:
        if name.startswith(SKIPPED_PREFIXES):
            skipped += 1
            continue
        for prefix in HF_TEXT_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if zero_centred_norm(name):
            tensor = tensor.float() + 1.0
        yield name, tensor
    if skipped:
        log.info("%s: skipped %d vision-tower / MTP tensors (text model only)", source, skipped)


def hf_text_name(name: str) -> str | None:
    """A checkpoint tensor name as the model names it; None for skipped tensors."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in HF_TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def zero_centred_norm(name: str) -> bool:
    return name.endswith("norm.weight") and ".linear_attn." not in name


def check_hybrid_tensors(cfg, shapes: dict, source: str) -> None:
    """The layer count, the embedding's size and the experts (MoE) agree with the weights before
    anything is allocated (the rest is checked tensor by tensor as it is assigned)."""
    from ..errors import CheckpointError
    from .config import HF_KEYS
    from .moe import check_expert_tensors
    layers = sorted({int(m[1]) for name in shapes if name and (m := LAYER_NAME.match(name))})
    if layers != list(range(cfg.num_layers)):
        raise CheckpointError(f"{source}: num_hidden_layers is {cfg.num_layers}, but the weights hold "
                              f"{len(layers)} layers")
    embed = shapes.get("embed_tokens.weight")
    if embed is None:
        raise CheckpointError(f"{source}: missing tensor embed_tokens.weight")
    if tuple(embed) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{source}: tensor embed_tokens.weight has shape {list(embed)}, but vocab_size and "
                              f"hidden_size make it {[cfg.vocab_size, cfg.hidden_size]}")
    check_expert_tensors(cfg, shapes, source, HF_KEYS)
