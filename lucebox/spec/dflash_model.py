"""The DFlash drafter network (z-lab layout): Qwen3-style layers whose keys and values are the
target's fused hidden features (context) followed by the block being drafted.

Context feature of a committed position: c = hidden_norm(fc(concat of the target's tapped layer
outputs)). Every draft layer projects the same c with its own k_proj / v_proj (+ k_norm, RoPE at
the absolute position), so the projected context K/V can be cached and appended to. Queries come
from the block only; a block sees all its context and itself (non-causal). The drafter has no
embedding or LM head: the block input is the target's embedding of [anchor, MASK, ...], and the
logits are the target's LM head over the drafter's final norm.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..kernels.rope import apply_rope
from ..model.config import ModelConfig, hf_rope, hf_sliding_windows, rope_to_hf
from ..model.rope import RopeTable
from ..model.transformer import MLP, RMSNorm


@dataclass
class DFlashConfig:
    model: ModelConfig  # the drafter's layer shapes (hidden size equals the target's)
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    num_target_layers: int | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "DFlashConfig":
        inner = raw.get("dflash_config") or {}

        def pick(*names, default=None):
            for source in (inner, raw):  # dflash_config first, then the top level
                for name in names:
                    if source.get(name) is not None:
                        return source[name]
            return default

        taps = pick("target_layer_ids", "aux_hidden_state_layer_ids")
        mask = pick("mask_token_id")
        block = pick("block_size", "draft_block_size", default=16)
        if not taps or not isinstance(taps, list):
            raise CheckpointError(f"{where}: a DFlash drafter needs dflash_config.target_layer_ids")
        if not isinstance(mask, int):
            raise CheckpointError(f"{where}: a DFlash drafter needs dflash_config.mask_token_id")
        model = dict(raw, model_type="qwen3")  # drafters are Qwen3-style whatever the target family
        try:
            cfg = ModelConfig.from_hf_dict(model)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        cfg.rope = hf_rope(raw)
        cfg.sliding_windows = hf_sliding_windows(dict(model, use_sliding_window=True), "mistral", cfg.num_layers) \
            if raw.get("layer_types") else [None] * cfg.num_layers
        return cls(cfg, [int(t) for t in taps], mask, int(block),
                   pick("num_target_layers", "n_target_layers"))

    def to_dict(self) -> dict:
        m = self.model
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids,
                              "block_size": self.block_size},
            "num_target_layers": self.num_target_layers, "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "rms_norm_eps": m.rms_norm_eps, "rope_theta": m.rope.theta, "rope_scaling": rope_to_hf(m.rope),
            "max_position_embeddings": m.max_position_embeddings, "vocab_size": m.vocab_size,
            "attention_bias": False, "tie_word_embeddings": True, "hidden_act": "silu",
            "layer_types": ["full_attention"] * m.num_layers, "use_sliding_window": False,
        }


class DraftAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim ** -0.5

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> K, V [n, kv_heads, head_dim] (K normed and rotated)."""
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos, sin, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [n, hidden] queries; keys/values [m, kv_heads, d] (context then the queries' own K/V);
        mask [n, m] bool (True = may attend) or None (all)."""
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin).transpose(0, 1)
        groups = self.num_heads // self.num_kv_heads
        k = keys.transpose(0, 1).repeat_interleave(groups, 0)
        v = values.transpose(0, 1).repeat_interleave(groups, 0)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.scale)
        return self.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        m = cfg.model
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * m.hidden_size, m.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(m, i) for i in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.rope = RopeTable(m.rope, m.head_dim)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [n, taps * hidden] -> fused context c [n, hidden]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor, position_bound: int | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of the context rows: what the drafter caches per committed position.
        position_bound (all positions are below it), when known on the host, spares a device sync."""
        c = self.context(features.to(self.fc.weight.dtype))
        cos, sin = self.rope.lookup(positions, c.dtype, position_bound)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def blocks(self, x: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
               context_positions: torch.Tensor, mask: torch.Tensor | None = None,
               position_bound: int | None = None) -> torch.Tensor:
        """Run the block rows x [n, hidden] (target embeddings) at `positions` over cached context
        K/V (per layer, [m, kv_heads, d], at context_positions [m]); mask [n, m + n] (True = may
        attend) or None (everything). Sliding-window layers also drop keys a window or more behind
        the query. Returns the normed hidden states [n, hidden]. position_bound: as in context_kv."""
        cos, sin = self.rope.lookup(positions, x.dtype, position_bound)
        key_positions = torch.cat([context_positions, positions])
        for layer, (ctx_k, ctx_v) in zip(self.layers, context):
            h = layer.input_layernorm(x)
            k, v = layer.self_attn.key_value(h, cos, sin)
            keys, values = torch.cat([ctx_k.to(k.dtype), k]), torch.cat([ctx_v.to(v.dtype), v])
            layer_mask = mask
            window = layer.self_attn.sliding_window
            if window is not None:
                near = (positions[:, None] - key_positions[None, :]) < window
                layer_mask = near if mask is None else mask & near
            x = x + layer.self_attn(h, cos, sin, keys, values, layer_mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def read_drafter_config(path: Path) -> DFlashConfig:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: config.json not found (is {path} a DFlash drafter directory?)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    return DFlashConfig.from_dict(raw, str(file))


def save_drafter(drafter: DFlashDrafter, out: Path, dtype: torch.dtype | None = None) -> None:
    """Write the published z-lab layout: config.json + unprefixed safetensors, no embedding or head,
    floating tensors in `dtype` (default: as they are). Written beside the destination first, so a
    failure leaves no half-written drafter."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.partial"
    def stored(v: torch.Tensor) -> torch.Tensor:
        v = v.detach()
        return (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()

    save_file({k: stored(v) for k, v in drafter.state_dict().items()}, str(tmp))
    (out / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2))
    tmp.replace(out / "model.safetensors")
