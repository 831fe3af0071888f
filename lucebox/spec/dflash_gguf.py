"""DFlash drafters as GGUF files (`lucebox convert-drafter`) and back (`load_drafter` on a .gguf).

Layout, following the spelling DFlash GGUF drafters already use (general.architecture
"dflash-draft", the DFlash settings under `dflash-draft.dflash.*`):
  metadata  llama.cpp's shape keys under `dflash-draft.` (block_count, embedding_length,
            feed_forward_length, attention.head_count[_kv], attention.key_length,
            attention.layer_norm_rms_epsilon, context_length, vocab_size, rope.*, sliding window);
            dflash.target_layer_ids, dflash.mask_token_id, dflash.block_size,
            dflash.n_target_features (taps x hidden), dflash.n_target_layers when known,
            dflash.is_causal when the config sets it (else sliding layers are the causal ones);
            final_logit_softcapping, dflash.input_embedding_scale / output_multiplier and
            dflash.hidden_act where set / not 1 / not silu.
  tensors   dflash_fc.weight, dflash_hidden_norm.weight, output_norm.weight (the drafter's final
            norm) and blk.N.* with llama.cpp's layer names; no embedding and no LM head.
DFlash2 drafters (dflash2_model.py) use the same architecture with the names mainline llama.cpp's
DFlash2 support gives their extra parts: dflash.{conv_kernel_size, conv_group_size, selector_rank,
selector_top_k} (a file with dflash.selector_rank is a DFlash2 drafter), blk.N.{attn,ffn}_conv_base
(the [side, tap, channel] base kernels, F32), blk.N.{attn,ffn}_conv_proj.weight (kernel_projection),
selector_hidden.weight, selector_predecessor.weight and selector_successor.weight (hidden_projection
and the two codebooks).
Matrices are F16 or Q8_0 (a matrix whose rows are not whole Q8_0 blocks stays F16, as in
llama.cpp); norms are F32. q/k rows keep the HF order (Qwen3-style, no llama permutation).

On load, Q8_0 layer projections stay quantised (QuantLinear, dequantised block-wise inside the
matmul); `fc` is dequantised to the model dtype, since it runs once per committed position and
the proposer reads its dtype.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
)
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors import safe_open
from tqdm.auto import tqdm

from ..convert import gguf_written, tensor_nbytes, write_shape_metadata
from ..errors import CheckpointError, RequestError, UnsupportedError
from ..kernels import dequant
from ..model.assign import assign
from ..model.config import ModelConfig, RopeConfig
from ..model.gguf_config import Metadata, to_gguf_name, to_our_name, yarn_mscale
from ..util import on_meta
from ..weights.gguf import FLOAT_TYPES, check_tensors, logical_shape, open_gguf
from ..weights.quant import QuantLinear, QuantTensor
from ..weights.safetensors import safetensors_files
from .dflash2_model import EXTRA_KEYS, DFlash2Config, build_drafter, read_config
from .dflash_model import ACTIVATIONS, DFlashConfig, DFlashDrafter

ARCH = "dflash-draft"
OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0}
FILE_TYPES = {Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.Q8_0: LlamaFileType.MOSTLY_Q8_0}
GLOBAL_NAMES = {"fc.weight": "dflash_fc.weight", "hidden_norm.weight": "dflash_hidden_norm.weight",
                "norm.weight": "output_norm.weight",
                "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
                "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
                "candidate_selector.successor_codebook": "selector_successor.weight"}
OUR_GLOBALS = {v: k for k, v in GLOBAL_NAMES.items()}
CONV_NAMES = {"attention_conv.base_kernel": "attn_conv_base", "attention_conv.kernel_projection.weight":
              "attn_conv_proj.weight", "mlp_conv.base_kernel": "ffn_conv_base",
              "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight"}
OUR_CONVS = {v: k for k, v in CONV_NAMES.items()}


def gguf_name(ours: str) -> str | None:
    parts = ours.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in CONV_NAMES:
        return f"blk.{parts[1]}.{CONV_NAMES[parts[2]]}"
    return GLOBAL_NAMES.get(ours) or to_gguf_name(ours)


def our_name(theirs: str) -> str | None:
    parts = theirs.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in OUR_CONVS:
        return f"layers.{parts[1]}.{OUR_CONVS[parts[2]]}"
    return OUR_GLOBALS.get(theirs) or to_our_name(theirs)


# ----------------------------------------------------------------------------------------- write

def convert_drafter_to_gguf(src: str | Path, out_path: str | Path, outtype: str = "f16") -> Path:
    """Write the drafter directory `src` (z-lab layout) as one GGUF file, atomically."""
    src, out_path = Path(src).expanduser(), Path(out_path).expanduser()
    if outtype not in OUTTYPES:
        raise RequestError(f"--outtype {outtype!r}: a drafter is written as {', '.join(OUTTYPES)}")
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a DFlash drafter directory (config.json + *.safetensors)")
    if not out_path.parent.is_dir():
        raise RequestError(f"{out_path}: the directory {out_path.parent} does not exist")
    cfg = read_config(src)
    want = OUTTYPES[outtype]
    plan = _plan(src, cfg, want)
    with gguf_written(out_path, ARCH) as writer:
        _write_metadata(writer, cfg, src, want)
        for name, shape, qtype, _, _ in plan:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), tensor_nbytes(shape, qtype), qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, qtype, file, ours in tqdm(plan, desc=f"Converting drafter to {outtype}", unit="tensor",
                                                   disable=None):
            with safe_open(str(file), framework="pt") as f:
                values = f.get_tensor(ours).to(torch.float32).numpy()
            writer.write_tensor_data(np.ascontiguousarray(quantize(np.ascontiguousarray(values), qtype)))
    return out_path



def _plan(src: Path, cfg: DFlashConfig, want: Q) -> list[tuple[str, tuple[int, ...], Q, Path, str]]:
    """(GGUF name, shape, type, file, our name) per tensor, checked against the config first."""
    with on_meta():
        expected = {n: tuple(p.shape) for n, p in build_drafter(cfg).named_parameters()}
    plan = {}
    for file in safetensors_files(src):
        try:
            with safe_open(str(file), framework="pt") as f:
                entries = [(n, tuple(f.get_slice(n).get_shape())) for n in f.keys()]
        except Exception as e:  # safetensors' own error types for torn files
            raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from None
        for ours, shape in entries:
            if ours not in expected or gguf_name(ours) is None:
                raise UnsupportedError(f"{file}: tensor {ours} has no place in a GGUF drafter "
                                       "(extra DFlash components are not converted)")
            if shape != expected[ours]:
                raise CheckpointError(f"{file}: tensor {ours} has shape {list(shape)}, the config needs "
                                      f"{list(expected[ours])}")
            qtype = Q.F32 if len(shape) != 2 else (want if shape[-1] % GGML_QUANT_SIZES[want][0] == 0 else Q.F16)
            plan[ours] = (gguf_name(ours), shape, qtype, file, ours)
    missing = [n for n in expected if n not in plan]
    if missing:
        raise CheckpointError(f"{src}: missing tensors {', '.join(missing[:5])}")
    return sorted(plan.values(), key=lambda e: (e[0].startswith("blk."), _layer(e[0]), e[0]))


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _write_metadata(w: GGUFWriter, cfg: DFlashConfig, src: Path, want: Q) -> None:
    m = cfg.model
    write_shape_metadata(w, m, src.resolve().name, want)
    _write_rope(w, m.rope, src)
    windows = {x for x in m.sliding_windows if x}
    if len(windows) > 1:
        raise UnsupportedError(f"{src}: draft layers use different sliding windows {sorted(windows)}")
    if windows:
        w.add_sliding_window(windows.pop())
        w.add_sliding_window_pattern([bool(x) for x in m.sliding_windows])
    w.add_array(f"{ARCH}.dflash.target_layer_ids", [int(t) for t in cfg.target_layer_ids])
    w.add_uint32(f"{ARCH}.dflash.mask_token_id", cfg.mask_token_id)
    w.add_uint32(f"{ARCH}.dflash.block_size", cfg.block_size)
    w.add_uint32(f"{ARCH}.dflash.n_target_features", len(cfg.target_layer_ids) * m.hidden_size)
    if cfg.num_target_layers is not None:
        w.add_uint32(f"{ARCH}.dflash.n_target_layers", int(cfg.num_target_layers))
    if cfg.is_causal is not None:
        w.add_bool(f"{ARCH}.dflash.is_causal", cfg.is_causal)
    if cfg.final_logit_softcapping is not None:
        w.add_float32(f"{ARCH}.final_logit_softcapping", cfg.final_logit_softcapping)
    if cfg.input_embedding_scale is not None:
        w.add_float32(f"{ARCH}.dflash.input_embedding_scale", cfg.input_embedding_scale)
    if cfg.output_multiplier != 1.0:
        w.add_float32(f"{ARCH}.dflash.output_multiplier", cfg.output_multiplier)
    if cfg.activation != "silu":
        w.add_string(f"{ARCH}.dflash.hidden_act", cfg.activation)
    if isinstance(cfg, DFlash2Config):
        for key in EXTRA_KEYS:
            w.add_uint32(f"{ARCH}.dflash.{key}", getattr(cfg, key))


def _write_rope(w: GGUFWriter, rope: RopeConfig, src: Path) -> None:
    if rope.type == "default":
        return
    if rope.mscale or rope.mscale_all_dim or not rope.truncate:
        raise UnsupportedError(f"{src}: YaRN with mscale / mscale_all_dim / truncate=false has no GGUF keys")
    kinds = {"linear": RopeScalingType.LINEAR, "yarn": RopeScalingType.YARN}
    if rope.type in kinds:
        w.add_rope_scaling_type(kinds[rope.type])
    else:  # llama3 has no llama.cpp scaling type (it ships a rope_freqs tensor): spelled out here
        w.add_string(f"{ARCH}.rope.scaling.type", rope.type)
        w.add_float32(f"{ARCH}.rope.scaling.low_freq_factor", rope.low_freq_factor)
        w.add_float32(f"{ARCH}.rope.scaling.high_freq_factor", rope.high_freq_factor)
    w.add_rope_scaling_factor(rope.factor)
    if rope.original_max_position_embeddings:
        w.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)
    if rope.type == "yarn":
        w.add_rope_scaling_yarn_beta_fast(rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(rope.beta_slow)
        if rope.attention_factor is not None:  # llama.cpp's convention, as convert.py writes it
            w.add_rope_scaling_attn_factors(rope.attention_factor / yarn_mscale(rope.factor))


# ------------------------------------------------------------------------------------------ read

def read_gguf_config(meta: Metadata) -> DFlashConfig:
    arch = meta.need("general.architecture")
    if arch != ARCH:
        raise CheckpointError(f"{meta.path}: general.architecture is {arch!r}, not a DFlash drafter ({ARCH!r})")

    def key(suffix):
        return f"{ARCH}.{suffix}"

    layers = meta.integer(key("block_count"), required=True)
    heads = meta.integer(key("attention.head_count"), required=True)
    hidden = meta.integer(key("embedding_length"), required=True)
    window = meta.integer(key("attention.sliding_window"), None)
    pattern = meta.get(key("attention.sliding_window_pattern"))
    if window and isinstance(pattern, list) and len(pattern) != layers:
        raise CheckpointError(f"{meta.path}: sliding_window_pattern has {len(pattern)} entries for {layers} layers")
    windows = [window if window and (not isinstance(pattern, list) or pattern[i]) else None for i in range(layers)]
    taps = meta.need(key("dflash.target_layer_ids"))
    if not isinstance(taps, list) or not taps:
        raise CheckpointError(f"{meta.path}: {key('dflash.target_layer_ids')} must be a non-empty list")
    try:
        model = ModelConfig(
            family="qwen3", vocab_size=meta.integer(key("vocab_size"), required=True), hidden_size=hidden,
            intermediate_size=meta.integer(key("feed_forward_length"), required=True), num_layers=layers,
            num_heads=heads, num_kv_heads=meta.integer(key("attention.head_count_kv"), heads),
            head_dim=meta.integer(key("attention.key_length"), None) or hidden // heads,
            rms_norm_eps=meta.number(key("attention.layer_norm_rms_epsilon"), required=True),
            max_position_embeddings=meta.integer(key("context_length"), required=True), rope=_read_rope(meta),
            qk_norm=True, tie_word_embeddings=True, sliding_windows=windows)
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {e}") from None
    causal = meta.get(key("dflash.is_causal"))
    if causal is not None and not isinstance(causal, bool):
        raise CheckpointError(f"{meta.path}: {key('dflash.is_causal')} must be a bool, got {causal!r:.80}")
    activation = meta.get(key("dflash.hidden_act")) or "silu"
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{meta.path}: {key('dflash.hidden_act')} {activation!r:.80} is not supported")
    cfg = DFlashConfig(model, [int(t) for t in taps], meta.integer(key("dflash.mask_token_id"), required=True),
                       meta.integer(key("dflash.block_size"), 16), meta.integer(key("dflash.n_target_layers"), None),
                       causal, input_embedding_scale=meta.number(key("dflash.input_embedding_scale"), None),
                       output_multiplier=meta.number(key("dflash.output_multiplier"), 1.0),
                       final_logit_softcapping=meta.number(key("final_logit_softcapping"), None),
                       activation=ACTIVATIONS[activation])
    if meta.get(key("dflash.selector_rank")) is not None:  # a DFlash2 drafter
        try:
            cfg = DFlash2Config.of(cfg, **{k: meta.integer(key(f"dflash.{k}"), required=True) for k in EXTRA_KEYS})
        except CheckpointError as e:
            raise CheckpointError(f"{meta.path}: {e}") from None
    return cfg


def _read_rope(meta: Metadata) -> RopeConfig:
    p = f"{ARCH}.rope"
    rope = RopeConfig(theta=meta.number(f"{p}.freq_base", 10000.0))
    kind = meta.get(f"{p}.scaling.type")
    if kind in (None, "none"):
        return rope
    if kind not in ("linear", "yarn", "llama3"):
        raise UnsupportedError(f"{meta.path}: RoPE scaling type {kind!r} is not supported")
    rope.type = kind
    rope.factor = meta.number(f"{p}.scaling.factor", required=True)
    rope.original_max_position_embeddings = meta.integer(f"{p}.scaling.original_context_length", None)
    rope.low_freq_factor = meta.number(f"{p}.scaling.low_freq_factor", rope.low_freq_factor)
    rope.high_freq_factor = meta.number(f"{p}.scaling.high_freq_factor", rope.high_freq_factor)
    rope.beta_fast = meta.number(f"{p}.scaling.yarn_beta_fast", rope.beta_fast)
    rope.beta_slow = meta.number(f"{p}.scaling.yarn_beta_slow", rope.beta_slow)
    scale = meta.number(f"{p}.scaling.attn_factor", None)
    rope.attention_factor = None if scale is None else scale * yarn_mscale(rope.factor)
    return rope


def load_drafter_gguf(path: str | Path, dtype: torch.dtype, device) -> tuple[DFlashDrafter, Path]:
    path = Path(path).expanduser()
    reader = open_gguf(path)
    meta = Metadata(reader, path)
    cfg = read_gguf_config(meta)
    check_tensors(reader, path)
    with on_meta():
        drafter = build_drafter(cfg).to(dtype)
    expected = {n: tuple(p.shape) for n, p in drafter.named_parameters()}

    def tensors():
        for t in reader.tensors:
            ours = our_name(t.name)
            if ours is None or ours not in expected:
                raise CheckpointError(f"{path}: tensor {t.name} is not part of a DFlash drafter")
            shape = logical_shape(t)
            if shape != expected[ours]:
                raise CheckpointError(f"{path}: tensor {t.name} has shape {list(shape)}, the metadata needs "
                                      f"{list(expected[ours])}")
            # [rows, bytes per row] as the dequantiser reads them; a copy, the memory map is read-only
            raw = np.asarray(t.data).reshape(-1).view(np.uint8).reshape(math.prod(shape[:-1]), -1)
            rows = torch.from_numpy(np.array(raw, copy=True))
            if t.tensor_type not in FLOAT_TYPES and len(shape) == 2 and ours.endswith("_proj.weight"):
                yield ours, QuantLinear(QuantTensor(rows, t.tensor_type, shape, t.name))
            else:
                yield ours, dequant.dequantize(rows, t.tensor_type, dtype).reshape(shape)

    assign(drafter, tensors(), str(path), dtype, device)
    return drafter.eval(), path
