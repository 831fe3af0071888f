"""HF safetensors checkpoints: single or sharded files, read lazily (mmap), never unpickled."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard listed in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found "
                              "(lucebox does not load pickled .bin checkpoints)")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time so peak memory stays near one tensor above the model."""
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from None
