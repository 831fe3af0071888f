"""Gemma 4 checkpoints: `Gemma4ForConditionalGeneration` (text model under `model.language_model.`,
vision and audio towers and their embedders skipped with one log line) or the text-only
`Gemma4ForCausalLM` (`model.`). KV-shared layers keep no k/v projections or norms; checkpoints that
still carry them (transformers ignores them on load) have them dropped here too."""
from __future__ import annotations

import logging
import re

from ..errors import CheckpointError

log = logging.getLogger("lucebox")

TEXT_PREFIXES = ("model.language_model.", "model.")  # ConditionalGeneration, then CausalLM
SKIPPED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
LAYER_NAME = re.compile(r"layers\.(\d+)\.")
SHARED_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def text_name(name: str, cfg) -> str | None:
    """A checkpoint tensor's name as the model names it; None for tensors the text model does not use."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    shared = SHARED_LAYER_TENSOR.match(name)
    if shared and cfg.kv_sources[int(shared[1])] != int(shared[1]):
        return None
    return name


def text_tensors(tensors, cfg, source: str):
    """(our name, tensor) of the text model's tensors; the towers skipped with one log line."""
    skipped = 0
    for name, tensor in tensors:
        ours = text_name(name, cfg)
        if ours is None:
            skipped += name.startswith(SKIPPED_PREFIXES)
            continue
        yield ours, tensor
    if skipped:
        log.info("%s: skipped %d vision/audio tower tensors (text model only)", source, skipped)


def check_tensors(cfg, shapes: dict, source: str) -> None:
    """Layer count, embedding, the first layer's attention and the experts agree with the config
    before anything is allocated (the rest is checked tensor by tensor as it is assigned)."""
    layers = sorted({int(m[1]) for name in shapes if name and (m := LAYER_NAME.match(name))})
    if layers != list(range(cfg.num_layers)):
        raise CheckpointError(f"{source}: num_hidden_layers is {cfg.num_layers}, but the weights hold "
                              f"{len(layers)} layers")
    expect(shapes, "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "vocab_size and hidden_size", source)
    for layer in sorted({cfg.layer_types.index(kind) for kind in cfg.layer_types}):
        dim, kv = cfg.layer_head_dims[layer], cfg.layer_kv_heads[layer]
        expect(shapes, f"layers.{layer}.self_attn.q_proj.weight", (cfg.num_heads * dim, cfg.hidden_size),
               f"num_attention_heads ({cfg.num_heads}) and head_dim ({dim})", source)
        expect(shapes, f"layers.{layer}.self_attn.k_proj.weight", (kv * dim, cfg.hidden_size),
               f"{kv} key/value heads of head_dim {dim}", source)
    if any(cfg.moe_layers):
        expect(shapes, "layers.0.experts.gate_up_proj",
               (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size),
               f"num_experts ({cfg.num_experts}) and moe_intermediate_size ({cfg.moe_intermediate_size})", source)
    if cfg.hidden_size_per_layer_input:
        expect(shapes, "embed_tokens_per_layer.weight",
               (cfg.vocab_size_per_layer_input, cfg.num_layers * cfg.hidden_size_per_layer_input),
               "vocab_size_per_layer_input, num_hidden_layers and hidden_size_per_layer_input", source)


def expect(shapes: dict, name: str, want: tuple[int, ...], because: str, source: str) -> None:
    if name not in shapes:
        raise CheckpointError(f"{source}: missing tensor {name}")
    if tuple(shapes[name]) != tuple(want):
        raise CheckpointError(f"{source}: tensor {name} has shape {list(shapes[name])}, but {because} "
                              f"make it {list(want)}")
