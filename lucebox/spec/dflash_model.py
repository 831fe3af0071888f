"""The DFlash drafter network (z-lab layout): Qwen3-style layers whose keys and values are the
target's fused hidden features (context) followed by the block being drafted.

Context feature of a committed position: c = hidden_norm(fc(concat of the target's tapped layer
outputs)). Every draft layer projects the same c with its own k_proj / v_proj (+ k_norm, RoPE at
the absolute position), so the projected context K/V can be cached and appended to. Queries come
from the block only; a block sees all its context and itself (non-causal). The drafter has no
embedding or LM head: the block input is the target's embedding of [anchor, MASK, ...], and the
logits are the target's LM head over the drafter's final norm.

Block input. z-lab's reference loop and training code embed the block with the target's embedding
module, `target.model.embed_tokens(ids)`, which in transformers' Gemma 4 scales the rows by
sqrt(hidden_size) (Gemma4TextScaledWordEmbedding): a Gemma 4 drafter was trained on scaled rows, and
vLLM's qwen3_dflash (embed_normalizer) and Lucebox's C++ Gemma 4 drafter scale them too. PyPI
`dflash` 0.1.0 instead takes the *raw* rows times the config's `input_embedding_scale`. So: with
that key, raw rows times it (0.1.0); without it, the rows the target's first layer receives
(target.embed: Gemma 4 scaled, others as they are) -- 0.1.0 would take raw rows there, which on a
Gemma 4 target contradicts how its drafters were trained. Per-layer inputs stay the target's.
Logits (0.1.0): the target's LM head times `output_multiplier`, then tanh-soft-capped by the
drafter config's `final_logit_softcapping` -- the drafter's, not the target's (z-lab's Gemma 4
drafter carries 30, its target's value). The MLP takes the config's `hidden_act` (silu, or Gemma's
gelu_pytorch_tanh), as the reference's Qwen3MLP does.

Published layouts read here: the Qwen3 drafters (`rope_theta` + `rope_scaling`, full attention)
and the Qwen3.5/3.6 ones for hybrid targets (transformers 5's `rope_parameters`, mask id 248070,
`layer_types` with `sliding_attention` layers of `sliding_window`). As in the reference, a sliding
layer is causal inside the block unless `is_causal` says otherwise (`is_causal` set: every layer
follows it). RoPE turns the whole head whatever rope keys a drafter copied from its target
(`partial_rotary_factor`, `mrope_section`): the reference's Qwen3 rotary reads only the rope type,
theta and scaling, and the published weights were trained that way.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..kernels.activation import gelu_tanh_and_mul
from ..kernels.rope import apply_rope
from ..model.config import ModelConfig, hf_rope, hf_sliding_windows, rope_to_hf
from ..model.rope import RopeTable
from ..model.transformer import MLP, RMSNorm
from . import draft_attention


@dataclass
class DFlashConfig:
    model: ModelConfig  # the drafter's layer shapes (hidden size equals the target's)
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    num_target_layers: int | None = None
    is_causal: bool | None = None  # the config's key: None = causal exactly in the sliding layers
    kinds: list[str] | None = None  # the config's layer_types (None: from the windows)
    input_embedding_scale: float | None = None  # block rows = raw rows times this (None: target.embed)
    output_multiplier: float = 1.0  # logits = the target's LM head times this, then soft-capped:
    final_logit_softcapping: float | None = None
    activation: str = "silu"  # the MLP's: silu or gelu_pytorch_tanh

    @property
    def causal_layers(self) -> list[bool]:
        """Per layer: whether block rows see only block rows at or before their own position."""
        if self.is_causal is not None:
            return [self.is_causal] * self.model.num_layers
        return [kind == "sliding_attention" for kind in self.layer_types]

    @property
    def layer_types(self) -> list[str]:
        return self.kinds or ["sliding_attention" if w else "full_attention" for w in self.model.sliding_windows]

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
        activation = raw.get("hidden_act", "silu")
        if activation not in ACTIVATIONS:
            raise CheckpointError(f"{where}: hidden_act {activation!r:.80} is not supported (one of "
                                  f"{sorted(ACTIVATIONS)})")
        # drafters are Qwen3-style whatever the target family; the activation is the MLP's own (DraftMLP)
        model = dict(raw, model_type="qwen3", hidden_act="silu")
        try:
            cfg = ModelConfig.from_hf_dict(model)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        try:
            cfg.rope = hf_rope(raw)
            cfg.partial_rotary_factor = 1.0  # the whole head (see the module's note)
            # transformers' Qwen3Config drops the window when use_sliding_window is false (the
            # reference then attends fully, causal or not); absent, the window holds.
            windowed = raw.get("layer_types") and raw.get("use_sliding_window") is not False
            cfg.sliding_windows = hf_sliding_windows(model, "mistral", cfg.num_layers) if windowed \
                else [None] * cfg.num_layers
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        causal = raw.get("is_causal")
        if causal is not None and not isinstance(causal, bool):
            raise CheckpointError(f"{where}: is_causal must be true, false or absent, got {causal!r:.80}")
        kinds = raw.get("layer_types")
        scale = pick("input_embedding_scale")
        scale = None if scale is None else _number(scale, "input_embedding_scale", where, positive=True)
        multiplier = _number(pick("output_multiplier", default=1.0), "output_multiplier", where, positive=True)
        cap = pick("final_logit_softcapping")  # none, or <= 0: no cap, as in the reference
        cap = None if cap is None or _number(cap, "final_logit_softcapping", where) <= 0 else float(cap)
        return cls(cfg, [int(t) for t in taps], mask, int(block),
                   pick("num_target_layers", "n_target_layers"), causal, list(kinds) if kinds else None,
                   scale, multiplier, cap, ACTIVATIONS[activation])

    def to_dict(self) -> dict:
        m = self.model
        windows = {w for w in m.sliding_windows if w is not None}
        if len(windows) > 1:
            raise CheckpointError(f"a drafter config holds one sliding_window, not {sorted(windows)}")
        layout = {"layer_types": self.layer_types, "use_sliding_window": bool(windows)}
        if windows:
            layout["sliding_window"] = windows.pop()
        if self.is_causal is not None:
            layout["is_causal"] = self.is_causal
        for name, default in (("input_embedding_scale", None), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", None)):
            if getattr(self, name) != default:
                layout[name] = getattr(self, name)
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids,
                              "block_size": self.block_size},
            "num_target_layers": self.num_target_layers, "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "rms_norm_eps": m.rms_norm_eps, "rope_theta": m.rope.theta, "rope_scaling": rope_to_hf(m.rope),
            "max_position_embeddings": m.max_position_embeddings, "vocab_size": m.vocab_size,
            "attention_bias": False, "tie_word_embeddings": True, "hidden_act": self.activation,
        } | layout


# hidden_act values -> the MLP activation they name (transformers' ACT2FN names)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}


def _number(value, name: str, where: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise CheckpointError(f"{where}: {name} must be a {'positive ' if positive else ''}finite number, "
                              f"got {value!r:.80}")
    return float(value)


class DraftAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, causal: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.sliding_window = cfg.sliding_windows[layer]
        self.causal = causal
        self.scale = cfg.head_dim ** -0.5

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> K, V [n, kv_heads, head_dim] (K normed and rotated)."""
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos, sin, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [n, hidden] queries; keys/values [m, kv_heads, d] (context then the queries' own K/V);
        mask [n, m] bool (True = may attend) or None (all)."""
        q = self._queries(x, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k = keys.transpose(0, 1).repeat_interleave(groups, 0)
        v = values.transpose(0, 1).repeat_interleave(groups, 0)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.scale)
        return self.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))

    def over_context(self, x: torch.Tensor, cos, sin, context: draft_attention.Context, own_k: torch.Tensor,
                     own_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """forward over the context's K/V then the queries' own (mask [n, m + n]): past
        SPLIT_KEYS_ABOVE keys in slices read from the context as they come (spec/draft_attention.py)."""
        if draft_attention.context_length(context) + own_k.shape[0] <= draft_attention.SPLIT_KEYS_ABOVE:
            ctx_k, ctx_v = draft_attention.read_context(context)
            keys, values = torch.cat([ctx_k.to(own_k.dtype), own_k]), torch.cat([ctx_v.to(own_v.dtype), own_v])
            return self(x, cos, sin, keys, values, mask)
        q = self._queries(x, cos, sin)
        o = draft_attention.split_key_attention(q, draft_attention.key_slices(context, own_k, own_v, mask),
                                                self.scale).to(q.dtype)
        return self.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))

    def _queries(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """[heads, n, d], normed and rotated."""
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        return apply_rope(q, cos, sin).transpose(0, 1)


class DraftMLP(MLP):
    """gate/up/down with the drafter config's activation."""

    def __init__(self, cfg: ModelConfig, activation: str = "silu"):
        super().__init__(cfg)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return super().forward(x)
        return self.down_proj(gelu_tanh_and_mul(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, causal: bool = False, activation: str = "silu"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer, causal)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg, activation)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        m = cfg.model
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * m.hidden_size, m.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(m, i, causal, cfg.activation)
                                    for i, causal in enumerate(cfg.causal_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.rope = RopeTable(m.rope, m.head_dim)

    def block_input(self, target, ids: torch.Tensor) -> torch.Tensor:
        """The block's rows from the target model's embedding: raw rows times input_embedding_scale
        when the config sets it, else what the target's first layer receives (module note)."""
        scale = self.config.input_embedding_scale
        return target.embed(ids) if scale is None else target.embed_tokens(ids) * scale

    def logits(self, head_logits: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the drafter's hidden states (float32) -> the drafter's logits."""
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            head_logits = head_logits * cfg.output_multiplier
        cap = cfg.final_logit_softcapping
        return head_logits if cap is None else torch.tanh(head_logits / cap) * cap

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

    def blocks(self, x: torch.Tensor, positions: torch.Tensor, context: list[draft_attention.Context],
               context_positions: torch.Tensor, mask: torch.Tensor | None = None,
               position_bound: int | None = None) -> torch.Tensor:
        """Run the block rows x [n, hidden] (target embeddings) at `positions` over cached context
        K/V (per layer, [m, kv_heads, d], at context_positions [m]); mask [n, m + n] (True = may
        attend) or None (everything). Sliding-window layers also drop keys a window or more away
        from the query (behind it; ahead of it too unless causal); causal layers keys past it. Returns the normed hidden states [n, hidden]. position_bound: as in context_kv."""
        cos, sin = self.rope.lookup(positions, x.dtype, position_bound)
        key_positions = torch.cat([context_positions, positions])
        for layer, ctx in zip(self.layers, context):
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            k, v = attn.key_value(h, cos, sin)
            x = x + attn.over_context(h, cos, sin, ctx, k, v, layer_mask(attn, mask, positions, key_positions))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def layer_mask(attn: DraftAttention, mask: torch.Tensor | None, positions: torch.Tensor,
               key_positions: torch.Tensor) -> torch.Tensor | None:
    """A layer's mask over the keys: `mask`, sliding windows (both ways unless causal, as in the
    reference), causal layers."""
    if attn.sliding_window is not None:
        distance = positions[:, None] - key_positions[None, :]
        near = (distance < attn.sliding_window) & (attn.causal or -distance < attn.sliding_window)
        mask = near if mask is None else mask & near
    if attn.causal:
        before = key_positions[None, :] <= positions[:, None]
        mask = before if mask is None else mask & before
    return mask


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
