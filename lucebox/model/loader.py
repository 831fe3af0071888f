"""Resolve a model reference (local HF dir, local .gguf, or hub id) and load model + tokenizer.

The one loader for both formats. GGUF: F32/F16/BF16 tensors become plain parameters in the model
dtype; quantised matrices become QuantLinear / QuantEmbedding modules that stay quantised (the
model is built on the meta device, so no float copy of them is ever allocated). The file is
memory-mapped; each tensor is copied out once, checked against the header and the config first.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGUFReader
from tqdm import tqdm

from ..errors import CheckpointError, RequestError
from ..kernels import dequant
from ..text.tokenizer import Tokenizer
from ..util import on_meta
from ..weights.gguf import FLOAT_TYPES, check_tensors, logical_shape, open_gguf, raw_rows, to_torch
from ..weights.quant import QuantEmbedding, QuantLinear, QuantTensor
from ..weights.safetensors import iter_safetensors, safetensors_shapes
from . import gemma4_checkpoint
from .assign import assign, empty_model, model_class
from .config import HF_KEYS, ModelConfig
from .gemma4_config import is_gemma4
from .gguf_config import (
    HYBRID_ARCHITECTURES,
    ROPE_FREQS,
    SAMPLING_KEYS,
    Metadata,
    architecture,
    config_keys,
    model_config,
    rows_permuted,
    to_our_name,
    unpermute_rows,
)
from .gguf_gemma4 import load_gemma4_gguf
from .gguf_gemma4_config import ARCH as GEMMA4_ARCH
from .gguf_hybrid_config import hybrid_model_config
from .gguf_hybrid_load import check_hybrid_layers, hybrid_tensors
from .gguf_hybrid_load import check_hybrid_tensors as check_hybrid_gguf
from .gguf_laguna_config import check_laguna_gguf, laguna_model_config
from .laguna import check_laguna_tensors
from .moe import stack_experts
from .qwen3_5 import check_hybrid_tensors, hf_text_name, hf_text_tensors, is_hybrid
from .rope import RopeTable
from .tensor_check import check_config_against_tensors
from .transformer import Transformer

log = logging.getLogger("lucebox")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    source: str
    format: str  # "hf" | "gguf"
    generation_defaults: dict = field(default_factory=dict)


def resolve_device(device: str | None) -> torch.device:
    """--device: auto (the first GPU, else the CPU) or a device that exists on this machine."""
    if device in (None, "auto"):
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return check_device(device, "--device")


def check_device(text: str, where: str) -> torch.device:
    """The device named `text` (cpu, cuda or cuda:N), which must exist on this machine; `where` names the flag."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise RequestError(f"{where}: {text!r} is not a device (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RequestError(f"{where}: {text} is absent: CUDA is not available on this machine")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise RequestError(f"{where}: {text} is absent: this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise RequestError(f"{where}: {text!r}: use cpu, cuda or cuda:N")
    return torch.device("cpu")


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype on GPU and computes in float32 on CPU (fast and exact there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(str(checkpoint_dtype), torch.bfloat16)
    if dtype not in DTYPES:
        raise RequestError(f"--dtype {dtype!r} is not supported (use auto, float32, bfloat16 or float16)")
    return DTYPES[dtype]


def resolve_path(model: str) -> Path:
    path = Path(model).expanduser()
    if path.exists():
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.endswith(".gguf"):
        return _download(model)
    raise CheckpointError(f"{model}: no such file or directory (and not a hub id like org/name)")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo: all a CheckpointError for the user
        raise CheckpointError(f"{repo_id}: could not download from the Hugging Face hub ({e})") from None


def load_model(model: str, dtype: str | torch.dtype | None = None, device: str | None = None) -> LoadedModel:
    dev = resolve_device(device)
    path = resolve_path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: expected a .gguf file or a HF model directory")
        return load_gguf(path, dtype, dev)
    return load_hf(path, dtype, dev)


def load_hf(path: Path, dtype, device: torch.device) -> LoadedModel:
    cfg = ModelConfig.from_hf_dir(path)
    if is_gemma4(cfg):
        shapes = {gemma4_checkpoint.text_name(name, cfg): shape for name, shape in safetensors_shapes(path).items()}
        gemma4_checkpoint.check_tensors(cfg, shapes, str(path / "config.json"))
    elif is_hybrid(cfg):
        shapes = {hf_text_name(name): shape for name, shape in safetensors_shapes(path).items()}
        check_hybrid_tensors(cfg, shapes, str(path / "config.json"))
    elif cfg.family == "laguna":
        shapes = {name.removeprefix("model."): shape for name, shape in safetensors_shapes(path).items()}
        check_laguna_tensors(cfg, shapes, str(path / "config.json"))
    else:
        shapes = {name.removeprefix("model."): shape for name, shape in safetensors_shapes(path).items()}
        check_config_against_tensors(cfg, shapes, str(path / "config.json"), HF_KEYS)
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
    model = empty_model(cfg, torch_dtype, device)
    tensors = iter_safetensors(path)
    if is_hybrid(cfg):  # text model only, zero-centred norms as 1 + w
        tensors = hf_text_tensors(tensors, str(path))
    elif is_gemma4(cfg):  # text model only
        tensors = gemma4_checkpoint.text_tensors(tensors, cfg, str(path))
    assign(model, stack_experts(_hf_names(tensors, cfg), cfg, str(path)), str(path), torch_dtype)
    model.eval()
    tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(model, tokenizer, cfg, str(path), "hf", read_generation_config(path))


def _hf_names(tensors, cfg: ModelConfig):
    for name, tensor in tensors:
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        yield name, tensor


def read_generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return raw


def load_gguf(path: Path, dtype, device: torch.device) -> LoadedModel:
    path = Path(path)
    reader = open_gguf(path)
    meta = Metadata(reader, path)
    architecture(meta)  # an unknown architecture is the clearest first message
    check_tensors(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if architecture(meta) in HYBRID_ARCHITECTURES:
        return _load_hybrid_gguf(reader, meta, path, dtype, device)
    if architecture(meta) == GEMMA4_ARCH:
        model, cfg = load_gemma4_gguf(reader, meta, path, resolve_dtype(dtype, None, device), device)
        return LoadedModel(model, Tokenizer.from_gguf(reader, path), cfg, str(path), "gguf", generation_defaults(meta))
    cfg = model_config(meta, {name: logical_shape(t) for name, t in tensors.items()})
    ours = {to_our_name(name): logical_shape(t) for name, t in tensors.items() if to_our_name(name)}
    check_config_against_tensors(cfg, ours, str(path), config_keys(architecture(meta)))
    torch_dtype = resolve_dtype(dtype, None, device)
    with on_meta():
        model = Transformer(cfg).to(torch_dtype)
    assign(model, _model_tensors(reader, cfg, meta, model, torch_dtype, path), str(path), torch_dtype, device)
    if ROPE_FREQS in tensors:
        model.rope = RopeTable(cfg.rope, cfg.head_dim, _rope_freqs(tensors[ROPE_FREQS], cfg, path))
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise RuntimeError("load_gguf: a Transformer tensor is not filled from the file (new buffer?)")
    model.eval()
    tokenizer = Tokenizer.from_gguf(reader, path)
    return LoadedModel(model, tokenizer, cfg, str(path), "gguf", generation_defaults(meta))


def _load_hybrid_gguf(reader: GGUFReader, meta: Metadata, path: Path, dtype, device: torch.device) -> LoadedModel:
    """qwen3moe / qwen35 / qwen35moe / laguna: names and layout changes in model/gguf_tensors.py."""
    arch = architecture(meta)
    shapes = {t.name: logical_shape(t) for t in reader.tensors}
    cfg = (laguna_model_config if arch == "laguna" else hybrid_model_config)(meta, shapes)
    check_hybrid_layers(cfg, arch, shapes, path)
    torch_dtype = resolve_dtype(dtype, None, device)
    with on_meta():
        model = model_class(cfg)(cfg).to(torch_dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if arch == "laguna":  # per-layer head counts, named by their metadata key
        check_laguna_gguf(cfg, shapes, path)
    check_hybrid_gguf(cfg, arch, expected, shapes, path)
    assign(model, hybrid_tensors(reader, cfg, arch, model, torch_dtype, path), str(path), torch_dtype, device)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise RuntimeError("load_gguf: a model tensor is not filled from the file (new buffer?)")
    model.eval()
    return LoadedModel(model, Tokenizer.from_gguf(reader, path), cfg, str(path), "gguf", generation_defaults(meta))


def _model_tensors(reader: GGUFReader, cfg: ModelConfig, meta: Metadata, model: Transformer,
                   dtype: torch.dtype, path: Path) -> Iterator[tuple[str, torch.Tensor | torch.nn.Module]]:
    arch = architecture(meta)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}
    for t in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor", disable=None):
        if t.name == ROPE_FREQS:
            continue
        ours = to_our_name(t.name)
        if ours is None or ours not in expected:
            log.warning("%s: ignoring tensor %s (not used by this architecture)", path, t.name)
            continue
        shape = logical_shape(t)
        if shape != expected[ours]:
            raise CheckpointError(f"{path}: tensor {t.name} has shape {list(shape)}, the model config needs "
                                  f"{list(expected[ours])}")
        rows = raw_rows(t, shape)
        permuted = rows_permuted(arch, t.name)
        quantised = t.tensor_type not in FLOAT_TYPES and len(shape) == 2
        if quantised and (ours.endswith("_proj.weight") or ours == "lm_head.weight"):
            if permuted:  # quantised rows are independent byte rows, so they reorder like float rows
                rows = unpermute_rows(rows, heads[permuted])
            yield ours, QuantLinear(QuantTensor(to_torch(rows), t.tensor_type, shape, t.name))
        elif quantised and ours == "embed_tokens.weight":
            yield ours, QuantEmbedding(QuantTensor(to_torch(rows), t.tensor_type, shape, t.name), dtype)
        else:  # float tensors, and quantised norms/biases (tiny) widened to float
            values = dequant.dequantize(to_torch(rows), t.tensor_type, dtype).reshape(shape)
            if permuted:
                values = unpermute_rows(values, heads[permuted])
            yield ours, values


def _rope_freqs(tensor, cfg: ModelConfig, path: Path) -> torch.Tensor:
    shape = logical_shape(tensor)
    if shape != (cfg.head_dim // 2,):
        raise CheckpointError(f"{path}: tensor {tensor.name} has shape {list(shape)}, expected "
                              f"[{cfg.head_dim // 2}] (one factor per RoPE frequency)")
    return dequant.dequantize(to_torch(raw_rows(tensor, shape)), tensor.tensor_type).reshape(shape)


def generation_defaults(meta: Metadata) -> dict:
    """GGUF has no generation_config.json; llama.cpp's `general.sampling.*` keys are the nearest thing."""
    out = {}
    for key, name in SAMPLING_KEYS.items():
        value = meta.get(f"general.sampling.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value if isinstance(value, int) else meta.number(f"general.sampling.{key}")
    return out
