"""GGUF files for the loader tests (tests/model/test_gguf_*.py): copies rewritten with the `gguf` package
(every tensor dequantised to F32, tensors or keys dropped or replaced), a Qwen MoE / hybrid checkpoint laid
out as llama.cpp's converter writes it, and every position's logits of one two-chunk prefill through
lucebox's runner, to hold against transformers'."""
from __future__ import annotations

import json

import gguf
import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from lucebox.engine.block_manager import BlockManager
from lucebox.engine.runner import ModelRunner
from lucebox.model.qwen3_5 import is_hybrid


def prompt_for(vocab: int, length: int = 29, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def lucebox_logits(loaded, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill (in two chunks, so recurrent state crosses a step)."""
    hybrid = is_hybrid(loaded.config)
    runner, blocks = ModelRunner(loaded.model, 32, 4, state_slots=2), BlockManager(32, 4)
    table: list[int] = []
    blocks.allocate(table, len(prompt))
    slots = dict(state_slots=[1]) if hybrid else {}
    if hybrid:
        runner.reset_states([1])
    first = runner.forward([prompt[:11]], [0], [table], all_logits=True, **slots)
    return torch.cat([first, runner.forward([prompt[11:]], [11], [table], all_logits=True, **slots)])


def dequantised_copy(src, dst):
    """The file with every tensor dequantised to F32 by the gguf package: the float model the quantised
    one must compute exactly (up to float rounding)."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_fields(reader, writer, skip=("general.architecture",))
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
    finish(writer)
    return dst


def copy_fields(reader, writer, skip=(), prefix="", override=None):
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skip or not key.startswith(prefix):
            continue
        value = (override or {}).get(key, field.contents())
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)


def finish(writer):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rewritten(src, dst, drop=(), keys=None, tensors=None):
    """A copy of a GGUF file without the tensors or metadata keys in `drop`, with metadata `keys` and
    `tensors` ({name: (array, type)}) replaced."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_fields(reader, writer, skip=("general.architecture", *drop), override=keys)
    for t in reader.tensors:
        if t.name not in drop:
            data, qtype = (tensors or {}).get(t.name, (np.array(t.data), t.tensor_type))
            writer.add_tensor(t.name, data, raw_dtype=qtype)
    finish(writer)
    return str(dst)


def tiled(x: torch.Tensor, width: int, dim: int = 0, k: int = 2, v: int = 6) -> torch.Tensor:
    """llama.cpp's converter: value head j of key head g moves from g * (v/k) + j to j * k + g."""
    order = [g * (v // k) + j for j in range(v // k) for g in range(k)]
    index = torch.tensor([h * width + i for h in order for i in range(width)])
    return x.index_select(dim, index)


def llama_cpp_gguf(arch: str, hf_dir, lucebox_gguf, out, fuse_gate_up: bool = False):
    """A file as llama.cpp's convert_hf_to_gguf.py lays it out: names from gguf's own tensor map, keys from
    GGUFWriter's methods, the converter's transforms written out here (tokenizer keys copied)."""
    from safetensors.torch import load_file
    hf, cfg = load_file(hf_dir / "model.safetensors"), json.loads((hf_dir / "config.json").read_text())
    layers, hybrid = cfg["num_hidden_layers"], arch != "qwen3moe"
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
    names = gguf.get_tensor_name_map({"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen35": gguf.MODEL_ARCH.QWEN35,
                                      "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE}[arch], layers)
    w = GGUFWriter(out, arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "intermediate_size" in cfg and not experts:
        w.add_feed_forward_length(cfg["intermediate_size"])
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen35moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_full_attention_interval(2)  # qwen35: no key, llama.cpp's default of 4
    if hybrid:
        w.add_rope_dimension_count(4)
        w.add_rope_dimension_sections([1, 1, 0, 0])  # 2 rotary pairs, interleaved t, h
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(16)
        w.add_ssm_group_count(2)
        w.add_ssm_time_step_rank(6)
        w.add_ssm_inner_size(96)
    else:
        w.add_rope_dimension_count(cfg["head_dim"])
    copy_fields(GGUFReader(lucebox_gguf), w, prefix="tokenizer.")
    out_tensors = {}
    for name, t in hf.items():
        if ".mlp.experts." in name:
            continue
        if hybrid and name.endswith("norm.weight") and ".linear_attn." not in name:
            t = t + 1
        if ".linear_attn." in name:
            if name.endswith("in_proj_qkv.weight"):
                t = torch.cat([t[:64], tiled(t[64:], 16)])
            elif name.endswith(("in_proj_z.weight", "out_proj.weight")):
                t = tiled(t, 16, dim=1 if "out_proj" in name else 0)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log")):
                t = tiled(t, 1)
            elif name.endswith("conv1d.weight"):
                t = t.squeeze(1)
                t = torch.cat([t[:64], tiled(t[64:], 16)])
            if name.endswith("A_log"):
                t = -t.exp()
            name = name.replace(".dt_bias", ".dt_proj.bias")
        out_tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t
    for layer in range(layers if experts else 0):
        prefix = f"model.layers.{layer}.mlp.experts"
        stacked = {kind: torch.stack([hf[f"{prefix}.{e}.{kind}.weight"] for e in range(experts)])
                   for kind in ("gate_proj", "up_proj", "down_proj")}
        if fuse_gate_up:
            gate_up = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)  # each expert: gate rows, up rows
            out_tensors[f"blk.{layer}.ffn_gate_up_exps.weight"] = gate_up
        else:
            for kind in ("gate_proj", "up_proj"):
                out_tensors[names.get_name(f"{prefix}.{kind}.weight", try_suffixes=(".weight",))] = stacked[kind]
        out_tensors[names.get_name(f"{prefix}.down_proj.weight", try_suffixes=(".weight",))] = stacked["down_proj"]
    assert None not in out_tensors
    for name, t in out_tensors.items():
        w.add_tensor(name, t.contiguous().numpy())
    finish(w)
    return out
