"""The safetensors half of the mutated-checkpoint corpus (tests/mutations.py holds the GGUF half and what
both share): a tiny valid Hugging Face directory (two shards, an index, a BPE tokenizer), then each mutation
of its config, index, shard headers or bytes. A case is mutations.Case: its regex names the field at fault."""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.mutations import (
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    MERGES,
    TOKENS,
    VOCAB,
    Case,
    random_tensors,
)


def hf_config() -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": VOCAB - 1, "tie_word_embeddings": False,
            "torch_dtype": "float32"}


def safetensors_bytes(tensors: dict[str, np.ndarray], header_edit: Callable[[dict], None] | None = None) -> bytes:
    """A .safetensors file written by hand (8-byte header length, JSON header, data), so the header can lie."""
    header, chunks, offset = {}, [], 0
    for name, values in tensors.items():
        raw = values.astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(values.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if header_edit:
        header_edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "chat_template":
                                                                 "{% for m in messages %}{{ m.content }}{% endfor %}"}))


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def write_hf(directory: Path, config: dict | None = None, shard_edits: dict[int, Callable[[dict], None]] | None = None,
             index_edit: Callable[[dict], None] | None = None) -> Path:
    """The tiny llama as a sharded HF checkpoint (two shards + index)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or hf_config()))
    write_tokenizer(directory)
    tensors = random_tensors()
    names = list(tensors)
    halves = (names[:len(names) // 2], names[len(names) // 2:])
    weight_map = {}
    for i, (shard, part) in enumerate(zip(SHARDS, halves)):
        (directory / shard).write_bytes(safetensors_bytes({n: tensors[n] for n in part},
                                                          (shard_edits or {}).get(i)))
        weight_map.update({n: shard for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    if index_edit:
        index_edit(index)
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def _hf_case(case_id: str, expected: str, config=None, shard_edits=None, index_edit=None, after=None) -> Case:
    def build(directory: Path) -> Path:
        path = write_hf(directory / case_id, config, shard_edits, index_edit)
        if after:
            after(path)
        return path
    return Case(case_id, build, expected)


def _config(**changes) -> dict:
    cfg = hf_config()
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not _DROP}


_DROP = object()


def _first(edit: Callable[[dict, str], None]) -> Callable[[dict], None]:
    return lambda header: edit(header, next(iter(header)))


def _index_first(shard: str) -> Callable[[dict], None]:
    def edit(index):
        name = next(iter(index["weight_map"]))
        index["weight_map"][name] = shard
    return edit


def _set(entry: str, value):
    def edit(header, name):
        header[name][entry] = value
    return edit


def _raw_shard(mutate: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def after(path: Path) -> None:
        shard = path / SHARDS[0]
        shard.write_bytes(mutate(shard.read_bytes()))
    return after


def safetensors_cases() -> list[Case]:
    h = _hf_case
    return [
        h("index_absolute_path", "outside the checkpoint directory", index_edit=_index_first("/etc/passwd")),
        h("index_dotdot_path", "outside the checkpoint directory", index_edit=_index_first("../../../etc/passwd")),
        h("index_inner_dotdot", "outside the checkpoint directory",
          index_edit=_index_first("sub/../../" + SHARDS[0])),
        h("index_windows_path", "outside the checkpoint directory", index_edit=_index_first("C:\\Windows\\win.ini")),
        h("index_shard_not_string", "must be a shard file name", index_edit=_index_first(7)),
        h("index_missing_shard", "missing", index_edit=_index_first("model-00009-of-00009.safetensors")),
        h("index_weight_map_list", "weight_map", index_edit=lambda i: i.update(weight_map=[1, 2])),
        h("header_length_2e64", "header length", after=_raw_shard(lambda d: struct.pack("<Q", (1 << 64) - 1) + d[8:])),
        h("header_length_past_end", "header length", after=_raw_shard(lambda d: struct.pack("<Q", len(d)) + d[8:])),
        h("header_not_json", "not valid JSON", after=_raw_shard(lambda d: d[:8] + b"x" + d[9:])),
        h("truncated_data", "truncated", after=_raw_shard(lambda d: d[:-7])),
        h("too_short", "too short", after=_raw_shard(lambda d: d[:5])),
        h("dtype_unknown", "dtype 'F99'", shard_edits={0: _first(_set("dtype", "F99"))}),
        h("dtype_relabelled_f16", r"needs \d+ bytes", shard_edits={0: _first(_set("dtype", "F16"))}),
        h("shape_negative", "shape must be", shard_edits={0: _first(_set("shape", [-1, 32]))}),
        h("shape_string", "shape must be", shard_edits={0: _first(_set("shape", ["32"]))}),
        h("shape_overflows", r"needs \d+ bytes", shard_edits={0: _first(_set("shape", [1 << 40, 1 << 40]))}),
        h("offsets_2e64", "data_offsets", shard_edits={0: _first(_set("data_offsets", [0, (1 << 64) - 1]))}),
        h("offsets_reversed", "data_offsets", shard_edits={0: _first(_set("data_offsets", [64, 0]))}),
        h("offsets_overlap", "data_offsets", shard_edits={0: lambda hd: hd[list(hd)[1]].update(
            data_offsets=[0, hd[list(hd)[1]]["data_offsets"][1] - hd[list(hd)[1]]["data_offsets"][0]])}),
        h("num_hidden_layers_1e7", "num_hidden_layers", config=_config(num_hidden_layers=10 ** 7)),
        h("num_hidden_layers_3", "num_hidden_layers is 3, but the weights hold layers 0 to 1",
          config=_config(num_hidden_layers=3)),
        h("num_hidden_layers_bool", "num_hidden_layers", config=_config(num_hidden_layers=True)),
        h("vocab_size_1e12", "vocab_size", config=_config(vocab_size=10 ** 12)),
        h("vocab_size_mismatch", "vocab_size", config=_config(vocab_size=VOCAB * 1000)),
        h("hidden_size_mismatch", "hidden_size", config=_config(hidden_size=HIDDEN * 2)),
        h("intermediate_size_huge", "intermediate_size", config=_config(intermediate_size=10 ** 9)),
        h("intermediate_size_mismatch", "intermediate_size", config=_config(intermediate_size=FFN * 64)),
        h("heads_mismatch", "num_attention_heads", config=_config(num_attention_heads=HEADS * 2, head_dim=HEAD_DIM)),
        h("kv_heads_mismatch", "num_key_value_heads", config=_config(num_key_value_heads=1)),
        h("head_dim_string", "head_dim", config=_config(head_dim="8")),
        h("rope_theta_string", "rope_theta", config=_config(rope_theta="x")),
        h("rope_theta_nan", "rope_theta", config=_config(rope_theta=math.nan)),
        h("rope_theta_negative", "rope_theta", config=_config(rope_theta=-1.0)),
        h("rope_scaling_not_object", "rope_scaling", config=_config(rope_scaling="yarn")),
        h("rope_factor_nan", "rope factor", config=_config(rope_scaling={"rope_type": "linear", "factor": math.nan})),
        h("rms_norm_eps_nan", "rms_norm_eps", config=_config(rms_norm_eps=math.nan)),
        h("rms_norm_eps_negative", "rms_norm_eps", config=_config(rms_norm_eps=-1e-6)),
        h("rms_norm_eps_string", "rms_norm_eps", config=_config(rms_norm_eps="1e-6")),
        h("max_position_embeddings_huge", "max_position_embeddings",
          config=_config(max_position_embeddings=10 ** 15)),
        h("sliding_window_negative", "sliding_window", config=_config(model_type="mistral", sliding_window=-4)),
        h("eos_token_id_string", "eos_token_id", config=_config(eos_token_id="</s>")),
        h("hidden_size_missing", "hidden_size", config=_config(hidden_size=_DROP)),
    ]
