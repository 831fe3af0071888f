"""A deterministic corpus of mutated checkpoints: tiny valid GGUF and safetensors models (the safetensors
half in tests/hf_mutations.py), then each mutation of one field (or random byte flips with a fixed seed).
Independent of lucebox: files are written with the `gguf` and `tokenizers` packages and raw bytes, so the
reader under test cannot shape its own inputs.

A case is (id, build(dir) -> path, expected): `expected` is a regex the LuceboxError must match
(naming the field), or None for "a clean load or a LuceboxError".
"""
from __future__ import annotations

import random
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 64, 2
MERGES = ["Ġ t", "h e", "Ġt he"]


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = byte_chars() + ["Ġt", "he", "Ġthe", "<|end|>"]
VOCAB = len(TOKENS)


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """HF parameter names -> shapes of the tiny llama."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    return shapes


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def random_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 0.1 + (1.0 if "norm" in name else 0.0)).astype(np.float32)
            for name, shape in tensor_shapes().items()}


# ------------------------------------------------------------------------------------------ GGUF
def gguf_metadata() -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """key -> (value, type, array item type) of the valid file; writer-level mutations replace entries."""
    u32, f32, s, arr = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY
    return {
        "general.alignment": (32, u32, None),
        "llama.vocab_size": (VOCAB, u32, None),
        "llama.context_length": (256, u32, None),
        "llama.embedding_length": (HIDDEN, u32, None),
        "llama.block_count": (LAYERS, u32, None),
        "llama.feed_forward_length": (FFN, u32, None),
        "llama.attention.head_count": (HEADS, u32, None),
        "llama.attention.head_count_kv": (KV_HEADS, u32, None),
        "llama.rope.freq_base": (10000.0, f32, None),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, f32, None),
        "lucebox.test.aa": (1, u32, None),
        "lucebox.test.bb": (2, u32, None),
        "tokenizer.ggml.model": ("gpt2", s, None),
        "tokenizer.ggml.pre": ("default", s, None),
        "tokenizer.ggml.tokens": (TOKENS, arr, s),
        "tokenizer.ggml.token_type": ([1] * (VOCAB - 1) + [3], arr, GGUFValueType.INT32),
        "tokenizer.ggml.merges": (MERGES, arr, s),
        "tokenizer.ggml.eos_token_id": (VOCAB - 1, u32, None),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m.content }}{% endfor %}", s, None),
    }


def write_gguf(path: Path, metadata=None, tensors=None) -> Path:
    """The tiny llama as GGUF: F32 everywhere except output.weight in Q8_0."""
    w = GGUFWriter(str(path), "llama")
    for key, (value, vtype, sub) in (metadata or gguf_metadata()).items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, values in (tensors or random_tensors()).items():
        if name == "lm_head.weight":
            w.add_tensor(gguf_name(name), quantize(values, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name), values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class GGUFFields:
    """Byte positions of a GGUF file's header fields (a minimal parser, just for patching)."""
    values: dict[str, tuple[int, int]]  # key -> (position of its value type, of its value)
    key_lengths: dict[str, int]  # key -> position of its name length
    tensors: dict[str, dict[str, int]]  # tensor name -> positions: name_len, n_dims, dim0, type, offset
    header_end: int


def parse_gguf(data: bytes) -> GGUFFields:
    pos = 24
    _, _, n_tensors, n_kv = struct.unpack_from("<IIQQ", data, 0)

    def string(p):
        n = struct.unpack_from("<Q", data, p)[0]
        return data[p + 8:p + 8 + n].decode(), p + 8 + n

    def skip(p, vtype):
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vtype in sizes:
            return p + sizes[vtype]
        if vtype == 8:
            return string(p)[1]
        item, count = struct.unpack_from("<IQ", data, p)
        p += 12
        for _ in range(count):
            p = skip(p, item)
        return p

    values, key_lengths, tensors = {}, {}, {}
    for _ in range(n_kv):
        start = pos
        key, pos = string(pos)
        vtype = struct.unpack_from("<I", data, pos)[0]
        key_lengths[key] = start
        values[key] = (pos, pos + 4)
        pos = skip(pos + 4, vtype)
    for _ in range(n_tensors):
        start = pos
        name, pos = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields = {"name_len": start, "n_dims": pos, "dim0": pos + 4, "type": pos + 4 + 8 * n_dims,
                  "offset": pos + 8 + 8 * n_dims}
        tensors[name] = fields
        pos = fields["offset"] + 8
    return GGUFFields(values, key_lengths, tensors, pos)


def patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    raw = struct.pack("<" + fmt, value)
    return data[:pos] + raw + data[pos + len(raw):]


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Path]  # writes the mutated checkpoint under the given directory, returns its path
    expected: str | None  # regex the LuceboxError message must match; None: clean load or LuceboxError


@lru_cache(maxsize=1)
def valid_gguf_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        return write_gguf(Path(directory) / "valid.gguf").read_bytes()


def _gguf_bytes_case(case_id: str, mutate: Callable[[bytes, GGUFFields], bytes], expected: str | None) -> Case:
    def build(directory: Path) -> Path:
        data = valid_gguf_bytes()
        out = directory / f"{case_id}.gguf"
        out.write_bytes(mutate(data, parse_gguf(data)))
        return out
    return Case(case_id, build, expected)


def _gguf_meta_case(case_id: str, key: str, value, vtype: GGUFValueType, expected: str,
                    sub: GGUFValueType | None = None) -> Case:
    def build(directory: Path) -> Path:
        meta = gguf_metadata()
        meta[key] = (value, vtype, sub)
        return write_gguf(directory / f"{case_id}.gguf", meta)
    return Case(case_id, build, expected)


def _value(key: str, fmt: str, value):
    return lambda d, f: patch(d, f.values[key][1], fmt, value)


def _tensor(name: str, field: str, fmt: str, value):
    return lambda d, f: patch(d, f.tensors[name][field], fmt, value)


Q = "blk.0.attn_q.weight"
U32, F32, F64, S = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.STRING
NAN = float("nan")


def gguf_cases() -> list[Case]:
    b, m = _gguf_bytes_case, _gguf_meta_case
    return [
        b("magic", lambda d, f: b"GGUX" + d[4:], "not a GGUF file"),
        b("version_99", lambda d, f: patch(d, 4, "I", 99), "version 99"),
        b("tensor_count_2e63", lambda d, f: patch(d, 8, "Q", 1 << 63), "tensor_count"),
        b("kv_count_2e63", lambda d, f: patch(d, 16, "Q", 1 << 63), "kv_count"),
        b("kv_count_plus_one", lambda d, f: patch(d, 16, "Q", len(f.values) + 1), r"tensor #\d+ name|type|n_dims"),
        b("key_length_2e63", lambda d, f: patch(d, 24, "Q", 1 << 63), r"metadata key #0"),
        b("key_length_past_end", lambda d, f: patch(d, 24, "Q", 60000), r"metadata key #0"),
        b("value_type_unknown", lambda d, f: patch(d, f.values["llama.block_count"][0], "I", 77),
          "llama.block_count has value type 77"),
        b("string_length_2e64", _value("tokenizer.ggml.model", "Q", (1 << 64) - 1), "tokenizer.ggml.model"),
        b("array_length_2e40", lambda d, f: patch(d, f.values["tokenizer.ggml.tokens"][1] + 4, "Q", 1 << 40),
          "tokenizer.ggml.tokens"),
        b("array_item_type_unknown", _value("tokenizer.ggml.tokens", "I", 1234), r"tokenizer\.ggml\.tokens \(array"),
        b("array_of_arrays", _value("tokenizer.ggml.token_type", "I", int(GGUFValueType.ARRAY)),
          "tokenizer.ggml.token_type is an array of arrays"),
        b("array_string_length_huge", lambda d, f: patch(d, f.values["tokenizer.ggml.tokens"][1] + 12, "Q", 1 << 50),
          r"tokenizer\.ggml\.tokens\[0\]"),
        b("duplicate_key", lambda d, f: d.replace(b"lucebox.test.bb", b"lucebox.test.aa"),
          "lucebox.test.aa appears twice"),
        b("alignment_zero", _value("general.alignment", "I", 0), "general.alignment"),
        b("alignment_not_power_of_two", _value("general.alignment", "I", 48), "general.alignment"),
        b("alignment_type_float", lambda d, f: patch(d, f.values["general.alignment"][0], "I", int(F32)),
          "general.alignment must be a uint32"),
        b("tensor_offset_2e64_minus_1", _tensor(Q, "offset", "Q", (1 << 64) - 1), rf"{Q} \(offset\)"),
        b("tensor_offset_wraps_aligned", _tensor(Q, "offset", "Q", (1 << 64) - 32), rf"{Q}.*\(offset\)"),
        b("tensor_offset_overlaps", _tensor("blk.1.attn_q.weight", "offset", "Q", 0), r"\(offset\)"),
        b("tensor_offset_unaligned", _tensor(Q, "offset", "Q", 4), rf"{Q} \(offset\) 4 is not a multiple"),
        b("tensor_type_relabelled_f16", _tensor(Q, "type", "I", int(GGMLQuantizationType.F16)),
          rf"{Q} \(F16"),
        b("tensor_type_relabelled_q8_0", _tensor("blk.0.ffn_up.weight", "type", "I", int(GGMLQuantizationType.Q8_0)),
          r"blk\.0\.ffn_up\.weight \(Q8_0"),
        b("last_tensor_relabelled", lambda d, f: patch(d, f.tensors[list(f.tensors)[-1]]["type"], "I",
                                                      int(GGMLQuantizationType.F16)), "follow the last tensor"),
        b("tensor_type_unknown", _tensor(Q, "type", "I", 4242), rf"{Q} has type 4242"),
        b("tensor_type_unsupported_i32", _tensor(Q, "type", "I", int(GGMLQuantizationType.I32)), rf"{Q}.*I32"),
        b("tensor_n_dims_zero", _tensor(Q, "n_dims", "I", 0), rf"{Q} has n_dims 0"),
        b("tensor_n_dims_huge", _tensor(Q, "n_dims", "I", 1 << 31), rf"{Q} has n_dims"),
        b("tensor_dim_zero", _tensor(Q, "dim0", "Q", 0), rf"{Q} has an empty dimension"),
        b("tensor_dim_2e62", _tensor(Q, "dim0", "Q", 1 << 62), rf"{Q} .*needs"),
        b("tensor_shape_overflows_64_bits", lambda d, f: patch(patch(d, f.tensors[Q]["dim0"], "Q", 1 << 40),
                                                              f.tensors[Q]["dim0"] + 8, "Q", 1 << 40), rf"{Q} .*needs"),
        b("tensor_shape_swapped_dims", lambda d, f: patch(patch(d, f.tensors["blk.0.ffn_up.weight"]["dim0"], "Q", FFN),
                                                         f.tensors["blk.0.ffn_up.weight"]["dim0"] + 8, "Q", HIDDEN),
          r"ffn_up|up_proj"),
        b("tensor_name_length_2e63", lambda d, f: patch(d, f.tensors[Q]["name_len"], "Q", 1 << 63), "tensor #"),
        b("duplicate_tensor_name", lambda d, f: d.replace(b"blk.1.attn_q.weight", Q.encode()), "appears twice"),
        b("truncated_in_header", lambda d, f: d[:f.header_end - 5], "past the end"),
        b("truncated_in_metadata", lambda d, f: d[:200], "kv_count|past the end"),
        b("truncated_in_data", lambda d, f: d[:len(d) - 100], r"past the end|truncated"),
        b("trailing_garbage", lambda d, f: d + b"\0" * 256, "follow the last tensor"),
        b("empty_file", lambda d, f: b"", "empty"),
        m("block_count_1e6", "llama.block_count", 10 ** 6, U32, "llama.block_count"),
        m("block_count_3", "llama.block_count", 3, U32, r"llama\.block_count is 3, but the weights hold layers 0 to 1"),
        m("block_count_string", "llama.block_count", "2", S, r"llama\.block_count.*integer"),
        m("embedding_length_2e31", "llama.embedding_length", (1 << 31), U32, "llama.embedding_length"),
        m("embedding_length_48", "llama.embedding_length", 48, U32, "llama.embedding_length"),
        m("vocab_size_2e32", "llama.vocab_size", (1 << 32) - 1, U32, "llama.vocab_size"),
        m("vocab_size_mismatch", "llama.vocab_size", VOCAB + 40, U32, "llama.vocab_size"),
        m("feed_forward_length_huge", "llama.feed_forward_length", 10 ** 9, U32, "llama.feed_forward_length"),
        m("head_count_1e7", "llama.attention.head_count", 10 ** 7, U32, "llama.attention.head_count"),
        m("head_count_kv_zero", "llama.attention.head_count_kv", 0, U32, "head_count_kv"),
        m("context_length_string", "llama.context_length", "a lot", S, "llama.context_length"),
        m("rope_freq_base_nan", "llama.rope.freq_base", NAN, F32, "llama.rope.freq_base"),
        m("rope_freq_base_negative", "llama.rope.freq_base", -10000.0, F32, "llama.rope.freq_base"),
        m("rope_freq_base_inf", "llama.rope.freq_base", float("inf"), F64, "llama.rope.freq_base"),
        m("rope_freq_base_string", "llama.rope.freq_base", "x", S, "llama.rope.freq_base"),
        m("rms_eps_nan", "llama.attention.layer_norm_rms_epsilon", NAN, F32, "layer_norm_rms_epsilon"),
        m("rms_eps_negative", "llama.attention.layer_norm_rms_epsilon", -1e-5, F32, "layer_norm_rms_epsilon"),
        m("rms_eps_zero", "llama.attention.layer_norm_rms_epsilon", 0.0, F32, "layer_norm_rms_epsilon"),
        m("eos_token_id_huge", "tokenizer.ggml.eos_token_id", (1 << 32) - 1, U32, "eos_token_id"),
    ]


def gguf_flip_cases(count: int = 100, seed: int = 1234) -> list[Case]:
    """Random byte flips, mostly in the header (where lengths, counts and offsets live)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        flips = [(rng.random(), rng.randrange(256)) for _ in range(rng.choice((1, 1, 2, 4)))]
        in_header = rng.random() < 0.85

        def mutate(d, f, flips=flips, in_header=in_header):
            out = bytearray(d)
            span = f.header_end if in_header else len(d)
            for where, value in flips:
                out[int(where * span)] = value
            return bytes(out)
        cases.append(_gguf_bytes_case(f"flip_{i:03d}", mutate, None))
    return cases


# ------------------------------------------------------------------------------------- safetensors
