"""Resolve a model reference (local HF dir, local .gguf, or hub id) and load model + tokenizer."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError, LuceboxError, RequestError
from .config import ModelConfig
from .transformer import Transformer

log = logging.getLogger("lucebox")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object  # lucebox.tokenizer.Tokenizer
    config: ModelConfig
    source: str
    format: str  # "hf" | "gguf"
    generation_defaults: dict = field(default_factory=dict)


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise RequestError(f"--device {device!r} is not a device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RequestError(f"--device {device}: CUDA is not available on this machine")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise RequestError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise RequestError(f"--device {device!r}: use cpu, cuda or cuda:N")
    return dev


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
        from ..weights.gguf import load_gguf
        return load_gguf(path, dtype, dev)
    return load_hf(path, dtype, dev)


def load_hf(path: Path, dtype, device: torch.device) -> LoadedModel:
    from ..tokenizer import Tokenizer
    from ..weights.load import assign, empty_model
    from ..weights.safetensors import iter_safetensors

    cfg = ModelConfig.from_hf_dir(path)
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
    model = empty_model(cfg, torch_dtype, device)
    assign(model, _hf_names(iter_safetensors(path), cfg), str(path), torch_dtype)
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


__all__ = ["LoadedModel", "load_model", "LuceboxError"]
