"""llama.cpp's tensor names of the MoE and hybrid GGUF architectures (qwen3moe, qwen35, qwen35moe, laguna,
gemma4) and the transforms its converter (convert_hf_to_gguf.py) applies to them, each with its inverse: the one table the
loader reads with (model/gguf_hybrid_load.py) and the converter writes with (model/gguf_hybrid_write.py).

What llama.cpp's converter changes, undone on load so the model equals the HF one:
  ssm_a = -exp(A_log); conv1d [C, 1, K] is stored [C, K]; zero-centred RMSNorm weights are stored as
  1 + w (what lucebox's hybrid model holds already, so nothing to undo); with fewer key heads than value
  heads, the Gated DeltaNet value heads go from HF's grouped order (the v heads of key head 0, then of key
  head 1, ...) to a tiled one (one v head of each key head in turn) in in_proj_qkv's v rows, in_proj_z,
  in_proj_a/b, A_log, dt_bias, conv1d's v channels and out_proj's columns.
Experts: llama.cpp stores gate and up as two stacked tensors (ffn_gate_exps, ffn_up_exps [E, I, H]; newer
files may fuse them as ffn_gate_up_exps [E, 2I, H]); lucebox's Experts holds gate_up_proj [E, 2I, H], each
expert's gate rows then its up rows, so the two GGUF tensors are the two halves of every expert's rows
(quantised, their raw byte rows are interleaved per expert into one QuantTensor: no dequantising).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .gguf_config import GLOBAL_TENSORS, LAYER_TENSORS


@dataclass(frozen=True)
class Rule:
    """One GGUF tensor: our parameter name (within `layers.N.` for block tensors), which of `parts` equal
    blocks of each expert's rows it is, a reversible transform (TRANSFORMS), and whether the converter
    writes it (False: a form only read, e.g. the fused ffn_gate_up_exps)."""
    ours: str
    transform: str | None = None
    part: int = 0
    parts: int = 1
    written: bool = True


def _pairs(names: dict[str, str]) -> dict[str, Rule]:
    return {f"{theirs}.{kind}": Rule(f"{ours}.{kind}") for theirs, ours in names.items() for kind in ("weight", "bias")}


_ATTENTION = _pairs({k: v for k, v in LAYER_TENSORS.items() if k.startswith("attn")})
_DENSE_FFN = _pairs({k: v for k, v in LAYER_TENSORS.items() if k in ("ffn_gate", "ffn_up", "ffn_down")})
_EXPERTS = {
    "ffn_gate_inp.weight": Rule("mlp.gate.weight"),
    "ffn_gate_exps.weight": Rule("mlp.experts.gate_up_proj", part=0, parts=2),
    "ffn_up_exps.weight": Rule("mlp.experts.gate_up_proj", part=1, parts=2),
    "ffn_gate_up_exps.weight": Rule("mlp.experts.gate_up_proj", written=False),
    "ffn_down_exps.weight": Rule("mlp.experts.down_proj"),
}
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp.weight": Rule("mlp.shared_expert_gate.weight"),
    "ffn_gate_shexp.weight": Rule("mlp.shared_expert.gate_proj.weight"),
    "ffn_up_shexp.weight": Rule("mlp.shared_expert.up_proj.weight"),
    "ffn_down_shexp.weight": Rule("mlp.shared_expert.down_proj.weight"),
}
_DELTANET = {
    "attn_qkv.weight": Rule("linear_attn.in_proj_qkv.weight", "qkv_v_rows"),
    "attn_gate.weight": Rule("linear_attn.in_proj_z.weight", "v_rows"),
    "ssm_alpha.weight": Rule("linear_attn.in_proj_a.weight", "v_heads"),
    "ssm_beta.weight": Rule("linear_attn.in_proj_b.weight", "v_heads"),
    "ssm_a": Rule("linear_attn.A_log", "a_log"),
    "ssm_dt.bias": Rule("linear_attn.dt_bias", "v_heads"),
    "ssm_conv1d.weight": Rule("linear_attn.conv1d.weight", "conv"),
    "ssm_norm.weight": Rule("linear_attn.norm.weight"),
    "ssm_out.weight": Rule("linear_attn.out_proj.weight", "v_columns"),
}
# Laguna (llama.cpp's src/models/laguna.cpp): the softplus output gate, the routers' score-correction bias
# and an ungated shared expert beside the experts; dense FFN layers lead.
_LAGUNA = {**_ATTENTION, "attn_gate.weight": Rule("self_attn.g_proj.weight"),
           "ffn_norm.weight": Rule("post_attention_layernorm.weight"), **_DENSE_FFN, **_EXPERTS,
           "exp_probs_b.bias": Rule("mlp.experts.e_score_correction_bias"),
           **{k: v for k, v in _SHARED_EXPERT.items() if k != "ffn_gate_inp_shexp.weight"}}
_HYBRID_NORMS = {"attn_norm.weight": Rule("input_layernorm.weight"),
                 "post_attention_norm.weight": Rule("post_attention_layernorm.weight")}
# Gemma 4 (llama.cpp's converter: norms stored as they are, no transforms; experts one fused gate_up tensor,
# the router's input scale and per-expert scale as `.scale` tensors of ffn_gate_inp / ffn_down_exps).
_GEMMA4 = {
    **_ATTENTION, "post_attention_norm.weight": Rule("post_attention_layernorm.weight"),
    "ffn_norm.weight": Rule("pre_feedforward_layernorm.weight"), **_DENSE_FFN,
    "post_ffw_norm.weight": Rule("post_feedforward_layernorm.weight"),
    "ffn_gate_inp.weight": Rule("router.proj.weight"), "ffn_gate_inp.scale": Rule("router.scale"),
    "ffn_down_exps.scale": Rule("router.per_expert_scale"),
    "ffn_gate_up_exps.weight": Rule("experts.gate_up_proj"), "ffn_down_exps.weight": Rule("experts.down_proj"),
    "ffn_gate_exps.weight": Rule("experts.gate_up_proj", part=0, parts=2, written=False),  # llama.cpp reads
    "ffn_up_exps.weight": Rule("experts.gate_up_proj", part=1, parts=2, written=False),  # these too
    "pre_ffw_norm_2.weight": Rule("pre_feedforward_layernorm_2.weight"),
    "post_ffw_norm_1.weight": Rule("post_feedforward_layernorm_1.weight"),
    "post_ffw_norm_2.weight": Rule("post_feedforward_layernorm_2.weight"),
    "layer_output_scale.weight": Rule("layer_scalar"),
    "inp_gate.weight": Rule("per_layer_input_gate.weight"), "proj.weight": Rule("per_layer_projection.weight"),
    "post_norm.weight": Rule("post_per_layer_input_norm.weight"),
}
# Per architecture: the name after `blk.N.` -> Rule. qwen3moe's dense FFN entries serve checkpoints with
# dense layers (mlp_only_layers), which lucebox reads and writes though llama.cpp expects every layer sparse.
LAYER_RULES = {
    "qwen3moe": {**_ATTENTION, "ffn_norm.weight": Rule("post_attention_layernorm.weight"), **_DENSE_FFN,
                 **_EXPERTS},
    "qwen35": {**_ATTENTION, **_HYBRID_NORMS, **_DELTANET, **_DENSE_FFN},
    "qwen35moe": {**_ATTENTION, **_HYBRID_NORMS, **_DELTANET, **_EXPERTS, **_SHARED_EXPERT},
    "laguna": _LAGUNA,
    "gemma4": _GEMMA4,
}
GLOBAL_RULES = {theirs: Rule(ours) for theirs, ours in GLOBAL_TENSORS.items()}
GLOBAL_RULES.update({  # Gemma 4's per-layer input embeddings (no other architecture has these parameters)
    "per_layer_token_embd.weight": Rule("embed_tokens_per_layer.weight"),
    "per_layer_model_proj.weight": Rule("per_layer_model_projection.weight"),
    "per_layer_proj_norm.weight": Rule("per_layer_projection_norm.weight"),
})
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def from_gguf_name(arch: str, gguf_name: str) -> tuple[str, Rule] | None:
    """(our parameter name, rule) of a GGUF tensor; None for names this architecture has no use for."""
    if gguf_name in GLOBAL_RULES:
        return GLOBAL_RULES[gguf_name].ours, GLOBAL_RULES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    rule = LAYER_RULES[arch].get(m[2]) if m else None
    return (f"layers.{m[1]}.{rule.ours}", rule) if rule else None


def to_gguf_names(arch: str, our_name: str, written: bool = True) -> list[tuple[str, Rule]]:
    """The GGUF tensors (name, rule) the converter writes for one of our parameters ([] for none);
    written=False: the forms only read instead (e.g. experts' gate and up fused or split)."""
    for theirs, rule in GLOBAL_RULES.items():
        if rule.ours == our_name:
            return [(theirs, rule)] if written else []
    m = _LAYER.fullmatch(our_name)
    if m is None:
        return []
    return [(f"blk.{m[1]}.{theirs}", rule) for theirs, rule in LAYER_RULES[arch].items()
            if rule.ours == m[2] and rule.written == written]


def gguf_shape(rule: Rule, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape (outermost first) llama.cpp stores for our parameter's shape."""
    if rule.parts > 1:  # [E, parts * I, H] -> [E, I, H]
        return (our_shape[0], our_shape[1] // rule.parts, *our_shape[2:])
    if rule.transform == "conv":  # [C, 1, K] -> [C, K]
        return (our_shape[0], our_shape[-1])
    return tuple(our_shape)


# ------------------------------------------------------------------------------------------ transforms
def _v_order(x: torch.Tensor, cfg, width: int, start: int, to_gguf: bool, dim: int = 0) -> torch.Tensor:
    """Value heads of `width` entries each along `dim`, from index `start`: HF's grouped order -> llama.cpp's
    tiled order (to_gguf), or back. Works on float values and on raw quantised rows alike (dim 0)."""
    k, v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if k == v:
        return x
    x = x.movedim(dim, 0)
    head = x[start:start + v * width]
    order = (k, v // k) if to_gguf else (v // k, k)
    head = head.reshape(*order, width, *head.shape[1:]).transpose(0, 1).reshape(head.shape)
    return torch.cat([x[:start], head, x[start + v * width:]]).movedim(0, dim)


def _a_log(x, cfg, to_gguf: bool, name: str):
    if to_gguf:
        return -_v_order(x.float(), cfg, 1, 0, True).exp()
    if not bool((x < 0).all()):
        raise CheckpointError(f"tensor {name} holds -exp(A_log), so every value must be negative; "
                              f"it has {int((x >= 0).sum())} that are not")
    return _v_order(torch.log(-x.float()), cfg, 1, 0, False)


def _conv(x, cfg, to_gguf: bool, name: str):
    rows = x.reshape(x.shape[0], x.shape[-1]) if to_gguf else x
    rows = _v_order(rows, cfg, cfg.linear_value_head_dim, 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim,
                    to_gguf)
    return rows if to_gguf else rows.reshape(rows.shape[0], 1, rows.shape[-1])


TRANSFORMS = {
    "qkv_v_rows": lambda x, cfg, to_gguf, name: _v_order(
        x, cfg, cfg.linear_value_head_dim, 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim, to_gguf),
    "v_rows": lambda x, cfg, to_gguf, name: _v_order(x, cfg, cfg.linear_value_head_dim, 0, to_gguf),
    "v_heads": lambda x, cfg, to_gguf, name: _v_order(x, cfg, 1, 0, to_gguf),
    "v_columns": lambda x, cfg, to_gguf, name: _v_order(x, cfg, cfg.linear_value_head_dim, 0, to_gguf, dim=1),
    "a_log": _a_log,
    "conv": _conv,
}
ROW_TRANSFORMS = frozenset({None, "qkv_v_rows", "v_rows", "v_heads"})  # apply to raw quantised rows as they are


def to_gguf(rule: Rule, values: torch.Tensor, cfg, name: str) -> torch.Tensor:
    """Our parameter's values (or a part's) as llama.cpp's converter stores them."""
    return values if rule.transform is None else TRANSFORMS[rule.transform](values, cfg, True, name)


def from_gguf(rule: Rule, values: torch.Tensor, cfg, name: str) -> torch.Tensor:
    """A GGUF tensor's values (float, or raw quantised rows for ROW_TRANSFORMS) in our layout."""
    return values if rule.transform is None else TRANSFORMS[rule.transform](values, cfg, False, name)


def v_column_order(cfg) -> torch.Tensor | None:
    """For out_proj: index such that x_tiled = x_grouped[..., index] (None when the orders agree)."""
    if cfg.linear_num_key_heads == cfg.linear_num_value_heads:
        return None
    return _v_order(torch.arange(cfg.linear_num_value_heads * cfg.linear_value_head_dim), cfg,
                    cfg.linear_value_head_dim, 0, True)
