"""What `lucebox convert` writes for qwen3moe / qwen35 / qwen35moe: every GGUF tensor (llama.cpp's names
and layout, model/gguf_tensors.py) with the HF tensors it is made of, planned from shapes alone; the
values are read one GGUF tensor at a time while the file is written.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..util import on_meta
from ..weights.safetensors import read_header, safetensors_files
from .config import ModelConfig
from .gguf_config import FAMILY_TO_HYBRID_ARCH
from .gguf_tensors import Rule, gguf_shape, to_gguf, to_gguf_names
from .assign import model_class
from .qwen3_5 import hf_text_name, is_hybrid, zero_centred_norm

log = logging.getLogger("lucebox")

_PER_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# Which per-expert HF matrices make each part of our stacked expert tensors.
_EXPERT_KINDS = {("gate_up_proj", 0): "gate_proj", ("gate_up_proj", 1): "up_proj", ("down_proj", 0): "down_proj"}


@dataclass
class PlannedTensor:
    gguf_name: str
    shape: tuple[int, ...]
    ours: str
    rule: Rule
    sources: list[tuple[Path, str]]  # one HF tensor, or one per expert (stacked on read)
    stacked_part: bool = False  # the source is our whole stacked tensor: take `rule.part` of its rows
    per_expert: bool = False  # the sources are one matrix per expert, stacked in order


def llama_cpp_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str, Rule, tuple[int, ...]]]:
    """(GGUF name, its shape, our parameter name, rule, our shape) of every tensor llama.cpp's converter
    writes for a qwen3_moe / qwen3_5 / qwen3_5_moe model of `cfg` (shapes outermost first; GGUF's
    on-disk dims are these reversed). A file with exactly these tensors and write_hybrid_keys' metadata
    is what llama.cpp loads."""
    arch = FAMILY_TO_HYBRID_ARCH[cfg.family]
    with on_meta():
        model = model_class(cfg)(cfg)
    return [(gguf_name, gguf_shape(rule, tuple(p.shape)), ours, rule, tuple(p.shape))
            for ours, p in model.named_parameters() for gguf_name, rule in to_gguf_names(arch, ours)]


def hybrid_plan(hf_dir: Path, cfg: ModelConfig) -> list[PlannedTensor]:
    """Every GGUF tensor of the model in `hf_dir`, checked against the config before anything is written."""
    whole, per_expert = _index(hf_dir, cfg)
    plan = []
    for gguf_name, shape, ours, rule, our_shape in llama_cpp_tensors(cfg):
        if ours in whole:
            file, hf_name, hf_shape = whole[ours]
            if hf_shape != our_shape:
                raise CheckpointError(f"{file}: tensor {hf_name} has shape {list(hf_shape)}, the config needs "
                                      f"{list(our_shape)}")
            plan.append(PlannedTensor(gguf_name, shape, ours, rule, [(file, hf_name)], rule.parts > 1))
        else:
            prefix, kind = ours.rsplit(".", 1)
            plan.append(PlannedTensor(gguf_name, shape, ours, rule,
                                      _expert_sources(per_expert, prefix, _EXPERT_KINDS.get((kind, rule.part)),
                                                      cfg.num_experts, shape[1:], hf_dir, ours),
                                      per_expert=True))
    return plan


def _index(hf_dir: Path, cfg: ModelConfig):
    """our name -> (file, HF name, shape); (experts prefix, kind, expert) -> (file, HF name, shape)."""
    whole, per_expert = {}, {}
    for file in safetensors_files(hf_dir):
        for hf_name, shape in ((name, entry.shape) for name, entry in read_header(file).items()):
            ours = hf_text_name(hf_name) if is_hybrid(cfg) else hf_name.removeprefix("model.")
            if ours is None or ours.endswith("rotary_emb.inv_freq"):
                continue
            if m := _PER_EXPERT.fullmatch(ours):
                per_expert[m[1], m[3], int(m[2])] = (file, hf_name, shape)
            else:
                whole[ours] = (file, hf_name, shape)
    return whole, per_expert


def _expert_sources(per_expert, prefix: str, kind: str | None, experts: int, shape, hf_dir: Path, ours: str):
    if kind is None:
        raise CheckpointError(f"{hf_dir}: missing tensor {ours}")
    sources = []
    for e in range(experts):
        if (prefix, kind, e) not in per_expert:
            raise CheckpointError(f"{hf_dir}: missing tensor {prefix}.{e}.{kind}.weight (num_experts is {experts})")
        file, hf_name, hf_shape = per_expert[prefix, kind, e]
        if hf_shape != tuple(shape):
            raise CheckpointError(f"{file}: tensor {hf_name} has shape {list(hf_shape)}, the config needs "
                                  f"{list(shape)}")
        sources.append((file, hf_name))
    return sources


def planned_values(entry: PlannedTensor, files: dict, cfg: ModelConfig) -> torch.Tensor:
    """The float32 values llama.cpp stores for `entry`; `files`: path -> open safetensors handle."""
    def read(file, name):
        try:
            return files[file].get_tensor(name).to(torch.float32)
        except Exception as e:  # safetensors' own error types, for a file cut short
            raise CheckpointError(f"{file}: cannot read tensor {name} ({e})") from None

    values = [read(file, name) for file, name in entry.sources]
    values = torch.stack(values) if entry.per_expert else values[0]
    if entry.stacked_part:
        values = values.chunk(entry.rule.parts, dim=1)[entry.rule.part]
    if is_hybrid(cfg) and zero_centred_norm(entry.ours):
        values = values + 1.0  # Qwen 3.5's x * (1 + w), stored as llama.cpp's converter stores it
    return to_gguf(entry.rule, values, cfg, entry.gguf_name).contiguous()
