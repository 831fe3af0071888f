"""HF checkpoint directory -> GGUF file, following llama.cpp's convert_hf_to_gguf.py conventions
(architecture names, metadata keys, tensor names, q/k row order, tokenizer metadata), so that
lucebox's files look like llama.cpp's and the loader has one layout to read.

Tensors are streamed: the header is written from shapes alone, then each tensor is read, quantised
and appended, so peak memory is about one tensor. The file appears under its name only when complete.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    TokenType,
)
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors import safe_open
from tqdm import tqdm

from .errors import CheckpointError, LuceboxError, RequestError, UnsupportedError
from .model import gguf_gemma4, gguf_gemma4_config
from .model.config import ModelConfig
from .model.gemma4_config import is_gemma4
from .model.gguf_config import (
    FAMILY_TO_ARCH,
    FAMILY_TO_HYBRID_ARCH,
    ROPE_FREQS,
    SAMPLING_KEYS,
    permute_rows,
    rows_permuted,
    to_gguf_name,
    yarn_mscale,
)
from .model.gguf_hybrid_config import write_hybrid_keys
from .model.gguf_hybrid_write import hybrid_plan, planned_values
from .model.loader import read_generation_config
from .model.rope import inverse_frequencies, rotary_dim
from .model.transformer import Transformer
from .text import gguf_gemma4_vocab
from .text.gguf_vocab import LLAMA3_REGEX, NEWLINE_RUNS_REGEX, QWEN2_REGEX, QWEN35_REGEX
from .util import on_meta
from .weights.gguf import FLOAT_TYPES
from .weights.safetensors import read_header, safetensors_files

log = logging.getLogger("lucebox")

QTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
          "q5_0": Q.Q5_0, "q5_1": Q.Q5_1}
FILE_TYPES = {Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16,
              Q.Q8_0: LlamaFileType.MOSTLY_Q8_0, Q.Q4_0: LlamaFileType.MOSTLY_Q4_0,
              Q.Q4_1: LlamaFileType.MOSTLY_Q4_1, Q.Q5_0: LlamaFileType.MOSTLY_Q5_0,
              Q.Q5_1: LlamaFileType.MOSTLY_Q5_1}


def convert_hf_to_gguf(hf_dir: str | Path, out_path: str | Path, qtype: str = "f16") -> Path:
    """Write `out_path` (a .gguf) from the HF model in `hf_dir`. `qtype` is llama.cpp's --outtype:
    f32, f16, bf16 or q8_0/q4_0/q4_1/q5_0/q5_1 for the 2-D weight matrices (norms and biases stay
    F32; a matrix whose rows are not whole blocks falls back to F16, as in llama.cpp)."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if qtype not in QTYPES:
        raise RequestError(f"GGUF type {qtype!r} is not one lucebox can write; choose one of {', '.join(QTYPES)}")
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir}: not a HF model directory")
    if not out_path.parent.is_dir():
        raise RequestError(f"{out_path}: the directory {out_path.parent} does not exist")
    want = QTYPES[qtype]
    cfg = ModelConfig.from_hf_dir(hf_dir)
    if cfg.family in FAMILY_TO_HYBRID_ARCH or is_gemma4(cfg):
        arch = gguf_gemma4_config.ARCH if is_gemma4(cfg) else FAMILY_TO_HYBRID_ARCH[cfg.family]
        planned = gguf_gemma4.gemma4_plan(hf_dir, cfg) if is_gemma4(cfg) else hybrid_plan(hf_dir, cfg)
        plan = sorted(((p.gguf_name, p.shape, _hybrid_tensor_type(p.gguf_name, p.shape, want),
                        [file for file, _ in p.sources], partial(planned_values, p, cfg=cfg))
                       for p in planned), key=_gguf_order)
    elif cfg.family in FAMILY_TO_ARCH:
        arch = FAMILY_TO_ARCH[cfg.family]
        plan = [(gguf_name, shape, ggml_type, [file], partial(_dense_values, file, hf_name, gguf_name, arch, cfg))
                for gguf_name, shape, ggml_type, file, hf_name in _plan(hf_dir, cfg, want)]
    else:
        raise UnsupportedError(f"{hf_dir}: converting {cfg.family} to GGUF is not supported")

    with gguf_written(out_path, arch) as writer:
        _write_metadata(writer, cfg, arch, hf_dir, want)
        _write_tokenizer(writer, hf_dir, cfg)
        extra = gguf_gemma4_config.rope_freqs(cfg) if is_gemma4(cfg) else _rope_freqs(cfg)
        for gguf_name, shape, ggml_type, _, _ in plan:
            writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), tensor_nbytes(shape, ggml_type), ggml_type)
        if extra is not None:
            writer.add_tensor_info(ROPE_FREQS, extra.shape, extra.dtype, extra.nbytes, Q.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with ExitStack() as stack:
            files = {}
            for file in dict.fromkeys(file for entry in plan for file in entry[3]):
                files[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            for _, _, ggml_type, _, values in tqdm(plan, desc=f"Converting to {qtype}", unit="tensor", disable=None):
                array = np.ascontiguousarray(values(files).numpy())
                writer.write_tensor_data(np.ascontiguousarray(quantize(array, ggml_type)))
        if extra is not None:
            writer.write_tensor_data(extra)
    return out_path


@contextmanager
def gguf_written(out_path: Path, arch: str) -> Iterator[GGUFWriter]:
    """A GGUFWriter onto a hidden partial file beside `out_path`, renamed over it when the block ends
    without error: on any error the partial file is removed (nothing half-written is left, an
    existing out_path untouched) and an OSError becomes a LuceboxError naming out_path."""
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.partial")
    writer = GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.close()
        os.replace(tmp, out_path)
    except BaseException as e:
        writer.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise LuceboxError(f"{out_path}: cannot write the GGUF file ({e})") from None
        raise


def tensor_nbytes(shape, ggml_type: Q) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return math.prod(shape) // block_size * type_size


def _tensor_type(shape: tuple[int, ...], want: Q) -> Q:
    if len(shape) < 2:
        return Q.F32  # norms and biases: tiny, and precision matters more than bytes there
    if want in FLOAT_TYPES:
        return want
    return want if shape[-1] % GGML_QUANT_SIZES[want][0] == 0 else Q.F16


def _plan(hf_dir: Path, cfg: ModelConfig, want: Q) -> list[tuple[str, tuple[int, ...], Q, Path, str]]:
    """(gguf name, shape, GGUF type, file, HF name) for every tensor, checked against the config
    before anything is written."""
    with on_meta():
        expected = {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}
    plan = {}
    for file in safetensors_files(hf_dir):
        for hf_name, shape in ((name, entry.shape) for name, entry in read_header(file).items()):
            ours = hf_name.removeprefix("model.")
            if ours.endswith("rotary_emb.inv_freq") or (ours == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            gguf_name = to_gguf_name(ours)
            if gguf_name is None or ours not in expected:
                log.warning("%s: skipping tensor %s (no GGUF counterpart for this architecture)", file, hf_name)
                continue
            if shape != expected[ours]:
                raise CheckpointError(f"{file}: tensor {hf_name} has shape {list(shape)}, the config needs "
                                      f"{list(expected[ours])}")
            plan[ours] = (gguf_name, shape, _tensor_type(shape, want), file, hf_name)
    missing = [name for name in expected if name not in plan]
    if missing:
        raise CheckpointError(f"{hf_dir}: missing tensors {', '.join(missing[:5])}")
    return sorted(plan.values(), key=_gguf_order)


def _gguf_order(entry) -> tuple:
    # llama.cpp's files list the embedding first, then layer by layer, then the head.
    name = entry[0]
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def _dense_values(file: Path, hf_name: str, gguf_name: str, arch: str, cfg: ModelConfig, files: dict) -> torch.Tensor:
    try:
        values = files[file].get_tensor(hf_name).to(torch.float32)
    except Exception as e:  # safetensors' own error types, for a file cut short
        raise CheckpointError(f"{file}: cannot read tensor {hf_name} ({e})") from None
    which = rows_permuted(arch, gguf_name)
    if which:
        values = torch.from_numpy(permute_rows(values.numpy(), cfg.num_heads if which == "q" else cfg.num_kv_heads))
    return values


# llama.cpp's converter keeps these F32 whatever the output type: routers and the conv filter.
_ALWAYS_F32 = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")


def _hybrid_tensor_type(gguf_name: str, shape: tuple[int, ...], want: Q) -> Q:
    return Q.F32 if gguf_name.endswith(_ALWAYS_F32) else _tensor_type(shape, want)


def write_shape_metadata(w: GGUFWriter, cfg: ModelConfig, name: str, want: Q,
                         file_type: LlamaFileType | None = None) -> None:
    """llama.cpp's general and `{arch}.*` shape keys of a transformer (targets and drafters alike);
    file_type: the mix's llama.cpp file type where it is not `want`'s own (e.g. Q4_K_M)."""
    w.add_type("model")
    w.add_name(name)
    w.add_file_type(FILE_TYPES[want] if file_type is None else file_type)
    if want not in FLOAT_TYPES:
        w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(getattr(cfg, "heads_per_layer", None) or cfg.num_heads)  # laguna: one per layer
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    factor = getattr(cfg, "partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(rotary_dim(cfg.head_dim, factor))
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def _write_metadata(w: GGUFWriter, cfg: ModelConfig, arch: str, hf_dir: Path, want: Q) -> None:
    write_shape_metadata(w, cfg, hf_dir.resolve().name, want)
    if arch in FAMILY_TO_HYBRID_ARCH.values():
        write_hybrid_keys(w, cfg, arch, _mrope_sections(hf_dir))
    rope = cfg.rope
    if rope.type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.factor)
    elif rope.type == "yarn":
        if rope.mscale or rope.mscale_all_dim or not rope.truncate:
            raise UnsupportedError(f"{hf_dir}: YaRN with mscale/mscale_all_dim/truncate=false has no GGUF keys "
                                   "that lucebox writes")
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope.factor)
        w.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(rope.beta_slow)
        if rope.attention_factor is not None:  # llama.cpp multiplies its own YaRN scale by the key
            w.add_rope_scaling_attn_factors(rope.attention_factor / yarn_mscale(rope.factor))
    # llama3 scaling travels as the rope_freqs tensor instead (see _rope_freqs).
    # laguna: its window and per-layer pattern are write_hybrid_keys' (llama.cpp's default pattern differs)
    windows = {win for win in cfg.sliding_windows if win} if arch != "laguna" else set()
    if len(windows) > 1:
        raise UnsupportedError(f"{hf_dir}: layers use different sliding windows {sorted(windows)}")
    if windows:
        w.add_sliding_window(windows.pop())
        if not all(cfg.sliding_windows):
            w.add_sliding_window_pattern([bool(win) for win in cfg.sliding_windows])
    generation = read_generation_config(hf_dir)
    for key, name in SAMPLING_KEYS.items():
        value = generation.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key == "top_k":
                w.add_int32(f"general.sampling.{key}", int(value))
            else:
                w.add_float32(f"general.sampling.{key}", float(value))
    if is_gemma4(cfg):  # last: it replaces keys written above where Gemma 4's differ
        gguf_gemma4_config.write_gemma4_keys(w, cfg)


def _mrope_sections(hf_dir: Path) -> list[int] | None:
    """Qwen 3.5's mrope_section (text positions make every section turn alike; llama.cpp wants the key)."""
    raw = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    return sections if isinstance(sections, list) and all(isinstance(s, int) for s in sections) else None


def _rope_freqs(cfg: ModelConfig) -> np.ndarray | None:
    """llama3 RoPE as llama.cpp stores it: per-frequency divisors of the unscaled inverse frequencies."""
    if cfg.rope.type != "llama3":
        return None
    scaled, _ = inverse_frequencies(cfg.rope, cfg.head_dim)
    plain = 1.0 / (cfg.rope.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    return (plain / scaled).numpy().astype(np.float32)


# ---------------------------------------------------------------------------------------- tokenizer

def _write_tokenizer(w: GGUFWriter, hf_dir: Path, cfg: ModelConfig) -> None:
    """tokenizer.json -> tokenizer.ggml.*, as llama.cpp writes it: byte-level BPE ("gpt2" model), or
    Gemma 4's SentencePiece-style BPE ("gemma4" model) for gemma4 models."""
    from .text.tokenizer import Tokenizer

    if not (hf_dir / "tokenizer.json").is_file():
        raise UnsupportedError(f"{hf_dir}: no tokenizer.json; lucebox converts byte-level BPE tokenizers "
                               "(tokenizer.json) only, not SentencePiece tokenizer.model files")
    tok = Tokenizer.from_hf_dir(hf_dir)
    spec = json.loads(tok.backend.to_str())
    if is_gemma4(cfg) and gguf_gemma4_vocab.is_gemma4_style(spec):
        tokens, types, merges = gguf_gemma4_vocab.gemma4_vocabulary(tok, spec, cfg.vocab_size)
        w.add_tokenizer_model(gguf_gemma4_vocab.MODEL)
        w.add_token_list(tokens)
        w.add_token_scores([-1000.0] * len(tokens))  # what llama.cpp's converter writes: BPE has no scores
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_add_space_prefix(False)
    else:
        _write_byte_level_vocabulary(w, tok, spec, cfg, hf_dir)
    _write_special_tokens(w, tok, cfg)


def _write_byte_level_vocabulary(w: GGUFWriter, tok, spec: dict, cfg: ModelConfig, hf_dir: Path) -> None:
    if spec.get("model", {}).get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise UnsupportedError(f"{hf_dir}/tokenizer.json: only byte-level BPE tokenizers (GPT-2 / Llama 3 / "
                               "Qwen style) can be written to GGUF by lucebox")
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    size = max(cfg.vocab_size, max(vocab.values()) + 1)
    if size > cfg.vocab_size:
        raise CheckpointError(f"{hf_dir}: the tokenizer has {size} tokens but the model's embedding only "
                              f"{cfg.vocab_size} rows")
    # Ids the tokenizer never produces are padding rows of the embedding, named as llama.cpp does.
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TokenType.UNUSED] * size
    for token, i in vocab.items():
        tokens[i], types[i] = token, TokenType.NORMAL
    for i, added in tok.backend.get_added_tokens_decoder().items():
        types[i] = TokenType.CONTROL if added.special else TokenType.USER_DEFINED
    if cfg.family == "laguna" and "</assistant>" in vocab:  # its turn end, not special in tokenizer.json;
        types[vocab["</assistant>"]] = TokenType.CONTROL   # llama.cpp's converter makes it a control token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer(spec, cfg.family))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)


def _write_special_tokens(w: GGUFWriter, tok, cfg: ModelConfig) -> None:
    if (bos := tok.bos_token_id) is not None:
        w.add_bos_token_id(bos)
    eos = tok.eos_token_id
    if eos is None and cfg.eos_token_ids:
        eos = cfg.eos_token_ids[0]
    if eos is not None:
        w.add_eos_token_id(eos)
    others = sorted(i for i in set(tok.eos_token_ids) | set(cfg.eos_token_ids) if i != eos)
    if others:  # GGUF has one EOS; a second stop token (e.g. <|eot_id|>) goes in as end-of-turn
        w.add_eot_token_id(others[0])
    if (pad := tok.pad_token_id) is not None:
        w.add_pad_token_id(pad)
    if (unk := tok.unk_token_id) is not None:
        w.add_unk_token_id(unk)
    probe = tok.encode("a")  # what the HF tokenizer adds around a text decides the GGUF flags
    w.add_add_bos_token(bos is not None and probe[:1] == [bos])
    w.add_add_eos_token(eos is not None and len(probe) > 1 and probe[-1:] == [eos])
    templates = tok.chat_templates
    if templates:
        w.add_chat_template([{"name": name, "template": text} for name, text in templates.items()])


# The split regexes of the Llama 3 and Qwen2 tokenizer.json files, which llama.cpp names "llama-bpe"
# and "qwen2" in tokenizer.ggml.pre.


def _pre_tokenizer(spec: dict, family: str) -> str:
    """tokenizer.ggml.pre: llama.cpp names a pre-tokenizer (a split regex) rather than storing it."""
    parts = list(_walk(spec.get("pre_tokenizer")))
    regexes = [p["pattern"].get("Regex") for p in parts if p.get("type") == "Split" and isinstance(p.get("pattern"), dict)]
    if regexes == [NEWLINE_RUNS_REGEX, QWEN2_REGEX]:
        return "laguna"
    if QWEN2_REGEX in regexes:
        return "qwen2"
    if QWEN35_REGEX in regexes:
        return "qwen35"
    if LLAMA3_REGEX in regexes:
        return "llama-bpe"
    if not regexes and any(p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in parts):
        return "gpt-2"  # a plain ByteLevel pre-tokenizer splits with the GPT-2 regex
    fallback = "qwen2" if family.startswith("qwen") else "llama-bpe"
    log.warning("unrecognised pre-tokenizer in tokenizer.json; writing tokenizer.ggml.pre=%s, "
                "some texts may tokenize differently", fallback)
    return fallback


def _walk(node):
    """Every component of a (possibly nested Sequence) tokenizer.json pre_tokenizer."""
    if isinstance(node, dict):
        yield node
        for child in node.get("pretokenizers", []):
            yield from _walk(child)
