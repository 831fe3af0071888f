"""Random DFlash drafters shaped for a target, so speculative speed can be measured without downloading
one (bench kv-pool's drafter rows, scripts/bench_device_map.py). The z-lab layout: 5 layers of the
target's width (heads, KV heads, head size, MLP), 16-token blocks, five target taps spread over its
depth. Random weights draft tokens the target rarely accepts: a row's rate is mostly the step's cost."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import RequestError
from ..model.config import ModelConfig
from ..spec.dflash_model import DFlashConfig, DFlashDrafter, save_drafter

# target families lucebox speculates on with DFlash drafters (spec tests: dense, MoE, hybrid, gemma4, laguna)
DFLASH_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma4", "laguna")
LAYERS = 5


def has_dflash_shape(target: ModelConfig) -> bool:
    return target.family in DFLASH_FAMILIES


def kv_bytes_per_token(target: ModelConfig, dtype: torch.dtype, layers: int = LAYERS) -> int:
    """KV bytes a context token costs random_dflash_drafter's drafter (K and V of every layer in dtype)."""
    return layers * 2 * target.num_kv_heads * target.head_dim * dtype.itemsize


def random_dflash_drafter(target: ModelConfig, out: Path, layers: int = LAYERS, seed: int = 0) -> Path:
    """Write a random drafter for `target` to the directory `out` (config.json + safetensors)."""
    if not has_dflash_shape(target):
        raise RequestError(f"no DFlash drafter shape for a {target.family} target (known: "
                           f"{', '.join(DFLASH_FAMILIES)})")
    m = ModelConfig(family="qwen3", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                    intermediate_size=target.intermediate_size, num_layers=layers, num_heads=target.num_heads,
                    num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                    max_position_embeddings=target.max_position_embeddings, qk_norm=True)
    n = target.num_layers
    taps = sorted({min(n - 1, max(0, t)) for t in (1, n // 4, n // 2, 3 * n // 4, n - 3)})  # z-lab's: 1 9 18 27 33
    drafter = DFlashDrafter(DFlashConfig(m, taps, target.vocab_size - 1, 16, n)).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
            else:
                p.fill_(1.0)
    save_drafter(drafter, out)
    return out
