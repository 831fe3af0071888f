"""GGUF `gemma4` as llama.cpp writes it: read into lucebox's Gemma4Model, and the tensors `lucebox convert`
writes. Names come from the one table in model/gguf_tensors.py (no transforms: llama.cpp's converter
stores Gemma 4's norms as they are, w not 1 + w); metadata from model/gguf_gemma4_config.py; the
reading and checking machinery is the hybrid architectures' (model/gguf_hybrid_load.py), so quantised
projections stay QuantLinear and the MoE experts (one fused gate_up tensor) one QuantTensor each.
KV-shared layers have no k/v tensors in the file; with attention_k_eq_v the full layers have no attn_v.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..kernels import dequant
from ..util import on_meta
from ..weights.gguf import logical_shape, raw_rows, to_torch
from ..weights.safetensors import read_header, safetensors_files
from .assign import assign
from .gemma4 import Gemma4Model
from .gemma4_checkpoint import SKIPPED_PREFIXES, text_name
from .gemma4_config import Gemma4Config
from .gguf_config import ROPE_FREQS, Metadata
from .gguf_gemma4_config import ARCH, gemma4_model_config
from .gguf_hybrid_load import check_hybrid_layers, check_hybrid_tensors, hybrid_tensors
from .gguf_hybrid_write import PlannedTensor
from .gguf_tensors import Rule, gguf_shape, to_gguf_names

log = logging.getLogger("lucebox")


def load_gemma4_gguf(reader, meta: Metadata, path: Path, dtype: torch.dtype,
                     device: torch.device) -> tuple[Gemma4Model, Gemma4Config]:
    """The model of a gemma4 file, every tensor checked against the metadata before any data is read."""
    shapes = {t.name: logical_shape(t) for t in reader.tensors}
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        freqs = dequant.dequantize(to_torch(raw_rows(freqs, shapes[ROPE_FREQS])), freqs.tensor_type,
                                   torch.float32).reshape(shapes[ROPE_FREQS]).numpy()
    cfg = gemma4_model_config(meta, shapes, freqs)
    check_hybrid_layers(cfg, ARCH, shapes, path)
    with on_meta():
        model = Gemma4Model(cfg).to(dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_hybrid_tensors(cfg, ARCH, expected, shapes, path)
    assign(model, hybrid_tensors(reader, cfg, ARCH, model, dtype, path), str(path), dtype, device)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise RuntimeError("load_gguf: a Gemma 4 tensor is not filled from the file (new buffer?)")
    model.eval()
    return model, cfg


def llama_cpp_gemma4_tensors(cfg: Gemma4Config) -> list[tuple[str, tuple[int, ...], str, Rule, tuple[int, ...]]]:
    """(GGUF name, its shape, our parameter name, rule, our shape) of every tensor llama.cpp's converter
    writes for a Gemma 4 text model of `cfg` (rope_freqs.weight, computed, comes on top)."""
    with on_meta():
        model = Gemma4Model(cfg)
    return [(gguf_name, gguf_shape(rule, tuple(p.shape)), ours, rule, tuple(p.shape))
            for ours, p in model.named_parameters() for gguf_name, rule in to_gguf_names(ARCH, ours)]


def gemma4_plan(hf_dir: Path, cfg: Gemma4Config) -> list[PlannedTensor]:
    """Every GGUF tensor of the Gemma 4 checkpoint in `hf_dir` with its HF source, checked against the
    config before anything is written (vision/audio towers and KV-shared layers' k/v are left out)."""
    whole, towers = {}, 0
    for file in safetensors_files(hf_dir):
        for hf_name, entry in read_header(file).items():
            ours = text_name(hf_name, cfg)
            towers += hf_name.startswith(SKIPPED_PREFIXES)
            if ours is not None:
                whole[ours] = (file, hf_name, tuple(entry.shape))
    if towers:
        log.info("%s: left out %d vision/audio tower tensors (llama.cpp keeps them in an mmproj file)", hf_dir, towers)
    plan = []
    for gguf_name, shape, ours, rule, our_shape in llama_cpp_gemma4_tensors(cfg):
        if ours not in whole:
            raise CheckpointError(f"{hf_dir}: missing tensor {ours} (for {gguf_name})")
        file, hf_name, hf_shape = whole[ours]
        if hf_shape != our_shape:
            raise CheckpointError(f"{file}: tensor {hf_name} has shape {list(hf_shape)}, the config needs "
                                  f"{list(our_shape)}")
        plan.append(PlannedTensor(gguf_name, shape, ours, rule, [(file, hf_name)]))
    return plan

