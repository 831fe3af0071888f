"""Check a config's sizes against the tensors a checkpoint holds, before anything is allocated.

A config is just numbers in a file: `num_hidden_layers: 10000000` would build ten million layers and
`vocab_size: 10**12` would ask for petabytes. The weights cannot lie about their own shapes, so the
layer count and the sizes every allocation depends on must agree with them first.
"""
from __future__ import annotations

import re

from ..errors import CheckpointError
from .config import ModelConfig
from .moe import check_expert_tensors

_LAYER = re.compile(r"layers\.(\d+)\.")


def check_config_against_tensors(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str,
                                 keys: dict[str, str]) -> None:
    """`shapes`: our parameter name -> shape; `keys`: ModelConfig field -> what the file calls it."""
    layers = sorted({int(m[1]) for name in shapes if (m := _LAYER.match(name))})
    if layers != list(range(cfg.num_layers)):
        held = f"layers {layers[0]} to {layers[-1]}" if layers else "no layers"
        if layers and len(layers) != layers[-1] + 1:
            held = f"layers {', '.join(map(str, layers[:12]))}{', ...' if len(layers) > 12 else ''}"
        raise CheckpointError(f"{source}: {keys['num_layers']} is {cfg.num_layers}, but the weights hold {held}")
    checks = (
        ("embed_tokens.weight", (("vocab_size", cfg.vocab_size), ("hidden_size", cfg.hidden_size))),
        ("layers.0.self_attn.q_proj.weight", (("num_heads", cfg.num_heads * cfg.head_dim),
                                               ("hidden_size", cfg.hidden_size))),
        ("layers.0.self_attn.k_proj.weight", (("num_kv_heads", cfg.num_kv_heads * cfg.head_dim),
                                               ("hidden_size", cfg.hidden_size))),
    )
    if not all(cfg.moe_layers):  # the first dense FFN
        checks += ((f"layers.{cfg.moe_layers.index(False)}.mlp.gate_proj.weight",
                    (("intermediate_size", cfg.intermediate_size), ("hidden_size", cfg.hidden_size))),)
    check_expert_tensors(cfg, shapes, source, keys)
    for name, dims in checks:
        if name not in shapes:
            raise CheckpointError(f"{source}: missing tensor {name}")
        shape = shapes[name]
        want = tuple(size for _, size in dims)
        if tuple(shape) != want:
            bad = next((field for (field, size), got in zip(dims, (*shape, None, None)) if got != size), dims[0][0])
            raise CheckpointError(
                f"{source}: tensor {name} has shape {list(shape)}, but {keys[bad]} ({_described(cfg, bad, keys)}) "
                f"makes it {list(want)}")


def _described(cfg: ModelConfig, field: str, keys: dict[str, str]) -> str:
    if field in ("num_heads", "num_kv_heads"):
        return f"{getattr(cfg, field)} heads x {keys['head_dim']} {cfg.head_dim}"
    return str(getattr(cfg, field))
