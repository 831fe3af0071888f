"""Tensor-parallel shards of a random --shape, each built by its rank on its own device.

A bench shape's checkpoint would have to be written first (qwen3-32b: 64 GB in bf16) and read by every
rank; instead each rank lays out the whole model on the meta device, shards it there
(model/tensor_parallel.shard_model: no memory), and fills only its own shard with random weights on its
device. Each weight's values come from a generator seeded with the run's seed and the weight's name, so
replicated weights (norms, routers) are the same on every rank; a shard's values are not the slice of
one unsharded random model, which the speed of the forward does not depend on.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import EngineArgs
from ..errors import UnsupportedError
from ..model.assign import model_class, on_meta
from ..model.loader import LoadedModel
from ..model.tensor_parallel import FullVocab, check_config, shard_model
from ..weights.quant import QuantEmbedding, QuantLinear, QuantTensor
from . import shapes

WRAPPERS = {"local", "table", "moe"}  # module names tensor parallelism wraps a layer's own module in


@dataclass(frozen=True)
class RandomShards:
    """engine/tensor_parallel.Shards of the bench shape `shape` in `quant` storage."""
    shape: str
    quant: str
    seed: int = 0
    dtype: torch.dtype | None = None  # activations of a GGUF mix (default: bfloat16 on CUDA, float32 on the CPU)

    @property
    def label(self) -> str:
        return f"random {self.shape} ({self.quant})"

    def resolve(self, args: EngineArgs) -> EngineArgs:
        return replace(args, model=self.label)

    def check(self, args: EngineArgs) -> None:
        check_config(shapes.shape_config(self.shape), args.tensor_parallel_size)

    def load(self, args: EngineArgs, rank: int, keep_full_vocab: bool = False) -> tuple[LoadedModel, FullVocab | None]:
        from ..engine.tensor_parallel import rank_device  # the engine imports nothing of the benches
        if keep_full_vocab:
            raise UnsupportedError("random tensor-parallel shards keep no unsharded vocabulary: a DFlash drafter "
                                   "on rank 0 needs a checkpoint")
        device = rank_device(args, rank)
        cfg = shapes.shape_config(self.shape)
        quant = shapes.check_quant(self.quant)
        dtype = shapes.FLOAT_QUANTS.get(quant) or self.dtype or (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        with on_meta():
            model = model_class(cfg)(cfg).to(dtype)
        shard_model(model, rank, args.tensor_parallel_size)
        with torch.no_grad():
            fill(model, quant, cfg.tie_word_embeddings, device, dtype, self.seed)
        model.eval()
        return LoadedModel(model, shapes.random_tokenizer(cfg.vocab_size), cfg, self.label, "random"), None


def logical_name(name: str) -> str:
    """A sharded module's name as the unsharded model has it (lm_head.local.weight -> lm_head.weight)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def fill(model: nn.Module, quant: str, tied: bool, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    """Every meta parameter and buffer of `model` made real on `device`: matrices of a GGUF mix as its
    quantised modules (random valid blocks, shapes.random_quant_tensor), norms' weights ones, the rest
    normal with shapes.STD."""
    quantised = quant not in shapes.FLOAT_QUANTS
    for name, module in list(model.named_modules()):
        if not quantised or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        weight = logical_name(f"{name}.weight")
        rows, cols = module.weight.shape
        if not shapes.is_quantised(weight, (rows, cols)):
            continue
        torch.manual_seed(_seed(seed, weight))
        qt = shapes.random_quant_tensor(shapes.weight_type(weight, quant, tied, cols), rows, cols, device, weight)
        bias = getattr(module, "bias", None)
        bias = _random(bias.shape, f"{weight}.bias", device, dtype, seed) if bias is not None else None
        new = QuantEmbedding(qt, dtype) if isinstance(module, nn.Embedding) else QuantLinear(qt, bias)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    for module_name, module in list(model.named_modules()):
        for leaf, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            name = logical_name(f"{module_name}.{leaf}")
            if quantised and shapes.is_quantised(name, tuple(p.shape)):  # stacked experts
                rows, cols = p.shape[:-1].numel(), p.shape[-1]
                torch.manual_seed(_seed(seed, name))
                qt = shapes.random_quant_tensor(shapes.weight_type(name, quant, tied, cols), rows, cols, device, name)
                delattr(module, leaf)
                setattr(module, leaf, QuantTensor(qt.data, qt.qtype, tuple(p.shape), name))
                continue
            if shapes.is_unit(name, p):
                value = torch.ones(p.shape, dtype=dtype, device=device)
            else:
                value = _random(p.shape, name, device, dtype, seed)
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        for leaf, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                module._buffers[leaf] = torch.zeros(b.shape, dtype=b.dtype, device=device)


def _seed(seed: int, name: str) -> int:
    return seed * 1_000_003 + zlib.crc32(name.encode())


def _random(shape, name: str, device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(_seed(seed, name))
    return torch.randn(shape, generator=g, device=device).mul_(shapes.STD).to(dtype)
