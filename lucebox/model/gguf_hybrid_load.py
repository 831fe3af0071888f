"""Read the tensors of a qwen3moe / qwen35 / qwen35moe GGUF into lucebox's model (names and transforms:
model/gguf_tensors.py). Quantised projections stay QuantLinear; quantised experts stay one stacked
QuantTensor per Experts tensor (gate and up interleaved per expert as raw rows); llama.cpp's layout
changes are undone so the model computes what the HF checkpoint computes.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import CheckpointError, UnsupportedError
from ..kernels import dequant
from ..weights.gguf import FLOAT_TYPES, logical_shape, raw_rows, to_torch
from ..weights.quant import PermutedInputQuantLinear, QuantEmbedding, QuantLinear, QuantTensor
from .config import ModelConfig
from .gguf_hybrid_config import hybrid_config_keys
from .gguf_tensors import ROW_TRANSFORMS, from_gguf, from_gguf_name, gguf_shape, to_gguf_names, v_column_order

log = logging.getLogger("lucebox")

_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_hybrid_layers(cfg: ModelConfig, arch: str, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """The file holds blocks 0 .. num_layers - 1 (MTP blocks may follow) before the model is built."""
    held = sorted({int(m[1]) for name in shapes if (m := _BLOCK.match(name))})
    if held[:cfg.num_layers] != list(range(cfg.num_layers)):
        shown = f"layers {held[0]} to {held[-1]}" if held else "no layers"
        raise CheckpointError(f"{path}: {arch}.block_count (less {arch}.nextn_predict_layers) is {cfg.num_layers}, "
                              f"but the weights hold {shown}")


def check_hybrid_tensors(cfg: ModelConfig, arch: str, expected: dict[str, tuple[int, ...]],
                         shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """Every GGUF tensor the model needs is present with the shape the metadata implies, before any data
    is read; errors name the GGUF tensor and the metadata keys that size it."""
    for ours, our_shape in expected.items():
        entries = to_gguf_names(arch, ours)
        other = to_gguf_names(arch, ours, written=False)  # e.g. gate and up experts fused / split
        if other and any(name not in shapes for name, _ in entries) and all(name in shapes for name, _ in other):
            entries = other
        for name, rule in entries:
            if name not in shapes:
                raise CheckpointError(f"{path}: missing tensor {name} (the model's {ours})")
            want, got = gguf_shape(rule, our_shape), shapes[name]
            if got != want and _squeezed(got) != _squeezed(want):
                raise CheckpointError(f"{path}: tensor {name} has shape {list(got)}, but {_sized_by(name, cfg, arch)} "
                                      f"make it {list(want)}")


def _sized_by(name: str, cfg: ModelConfig, arch: str) -> str:
    """The metadata keys (and values) that size a GGUF tensor, for messages."""
    keys = hybrid_config_keys(arch)
    if "_exps." in name or name.endswith("ffn_gate_inp.weight"):
        return (f"{keys['num_experts']} ({cfg.num_experts}) and {keys['moe_intermediate_size']} "
                f"({cfg.moe_intermediate_size})")
    if "_shexp." in name:
        return (f"{keys['shared_expert_intermediate_size']} ({cfg.shared_expert_intermediate_size}) and "
                f"{keys['hidden_size']} ({cfg.hidden_size})")
    if "per_layer" in name or name.endswith((".inp_gate.weight", ".proj.weight", ".post_norm.weight")):  # gemma4
        return (f"{arch}.embedding_length_per_layer_input ({getattr(cfg, 'hidden_size_per_layer_input', 0)}) and "
                f"{arch}.block_count ({cfg.num_layers})")
    if ".ssm_" in name or ".attn_qkv." in name or ".attn_gate." in name:
        return f"{arch}.ssm.* (conv_kernel, state_size, group_count, time_step_rank, inner_size)"
    return f"{arch}.* (embedding_length, attention.*, feed_forward_length)"


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    # llama.cpp writes the shared-expert gate [1, H] and reads it as [H]: either is the same tensor.
    return tuple(d for d in shape if d != 1)


def hybrid_tensors(reader, cfg: ModelConfig, arch: str, model: torch.nn.Module, dtype: torch.dtype,
                   path: Path) -> Iterator[tuple[str, object]]:
    """(our name, tensor / QuantTensor / quantised module) for every tensor the model (on the meta
    device) uses; quantised weights of its nn.Linear modules become QuantLinear."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    pending: dict[str, dict[int, tuple]] = {}
    skipped = 0
    for t in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor", disable=None):
        found = from_gguf_name(arch, t.name)
        if found is None or found[0] not in expected:
            skipped += 1  # MTP blocks, or tensors this model has no use for
            continue
        ours, rule = found
        shape = logical_shape(t)
        rows = to_torch(raw_rows(t, shape))
        quantised = t.tensor_type not in FLOAT_TYPES
        # qwen, laguna: mlp.experts.*; gemma4: experts.* (laguna's selection bias is no expert tensor)
        if ours.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = pending.setdefault(ours, {})
            parts[rule.part] = (t.name, t.tensor_type, rows.view(shape[0], -1, rows.shape[-1]))
            if len(parts) == rule.parts:
                del pending[ours]
                yield ours, _experts([parts[i] for i in range(rule.parts)], expected[ours], dtype)
        elif quantised and len(shape) == 2 and ours in linears:
            yield ours, _quant_linear(rule, rows, t, shape, cfg)
        elif quantised and ours in ("embed_tokens.weight", "embed_tokens_per_layer.weight"):
            yield ours, QuantEmbedding(QuantTensor(rows, t.tensor_type, shape, t.name), dtype)
        else:  # float tensors, and small quantised ones (norms, routers) widened to float
            values = dequant.dequantize(rows, t.tensor_type, dtype).reshape(gguf_shape(rule, expected[ours]))
            try:
                values = from_gguf(rule, values, cfg, t.name)
            except CheckpointError as e:
                raise CheckpointError(f"{path}: {e}") from None
            yield ours, values.reshape(expected[ours])
    if skipped:
        log.info("%s: skipped %d tensors this model does not use (e.g. MTP blocks)", path, skipped)


def _quant_linear(rule, rows: torch.Tensor, t, shape, cfg: ModelConfig) -> QuantLinear:
    if rule.transform in ROW_TRANSFORMS:  # raw rows reorder like float rows
        return QuantLinear(QuantTensor(from_gguf(rule, rows, cfg, t.name), t.tensor_type, shape, t.name))
    if rule.transform == "v_columns":  # quantised blocks cannot reorder columns: permute the input instead
        weight, order = QuantTensor(rows, t.tensor_type, shape, t.name), v_column_order(cfg)
        return QuantLinear(weight) if order is None else PermutedInputQuantLinear(weight, order)
    raise UnsupportedError(f"tensor {t.name}: a quantised {rule.ours} is not supported (store it as F32/F16)")


def _experts(parts: list[tuple], shape: tuple[int, ...], dtype: torch.dtype):
    """One Experts tensor [E, out, in] from its GGUF parts (each [E, out / parts, row bytes]): a QuantTensor
    when they are all of one quantised type (raw rows interleaved per expert), else float values."""
    names = " + ".join(name for name, _, _ in parts)
    types = {qtype for _, qtype, _ in parts}
    if len(types) == 1 and not types <= FLOAT_TYPES:
        rows = torch.cat([r for _, _, r in parts], dim=1).reshape(-1, parts[0][2].shape[-1])
        return QuantTensor(rows, types.pop(), shape, names)
    if not types <= FLOAT_TYPES:
        raise UnsupportedError(f"tensors {names} have different types ({', '.join(sorted(q.name for q in types))}); "
                               "lucebox keeps an expert's gate and up rows in one quantised tensor of one type")
    return torch.cat([dequant.dequantize(r.reshape(-1, r.shape[-1]), qtype, dtype).reshape(r.shape[0], r.shape[1], -1)
                      for _, qtype, r in parts], dim=1)
