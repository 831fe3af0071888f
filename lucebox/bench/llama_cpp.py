"""llama.cpp as the peer of `lucebox bench speed --peer llama.cpp`: the same shape in the same quant mix,
written as a GGUF of random but valid blocks, measured by llama.cpp's own llama-bench on the same GPU.

The file follows llama.cpp's loaders (src/models/qwen35.cpp, qwen35moe.cpp, qwen3moe.cpp, qwen3.cpp, laguna.cpp):
arch metadata, tensor names and shapes, a minimal gpt2-style BPE vocabulary of vocab_size tokens
(256 byte tokens, one merge, filler words). Types come from bench/shapes.py's mix rule, tensor by
tensor from the lucebox model's own parameter list, so both sides hold the same bytes per matrix.

Writing streams to disk at disk speed: each quantised tensor repeats one pattern of valid random
blocks (a prime number of them, started at a different block per tensor, so no two rows of a
matrix are alike and routing and embeddings still vary token to token); the small float tensors
(norms, router, the DeltaNet's a / b / conv / A / dt) are drawn for real.

llama-bench (scripts/build_llama_cpp.sh builds or unpacks it into .llama/bin) then runs
`-ngl 99 -fa 1 -p PROMPT_LENS -n DECODE_TOKENS -d 0,CONTEXTS -o json`; its JSON rows become this
module's prefill / decode rows and "lucebox / llama.cpp" ratios.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as Q

from ..convert import write_shape_metadata
from ..model import gguf_gemma4, gguf_gemma4_config
from ..model.assign import model_class
from ..model.config import ModelConfig
from ..model.gemma4_config import is_gemma4
from ..model.gguf_config import FAMILY_TO_HYBRID_ARCH, GLOBAL_TENSORS, LAYER_TENSORS, ROPE_FREQS
from ..model.gguf_hybrid_config import write_hybrid_keys
from ..model.gguf_hybrid_write import llama_cpp_tensors
from ..util import on_meta
from . import shapes

# Names, shapes and metadata come from the converter's own tables (model/gguf_tensors.py for qwen3moe /
# qwen35 / qwen35moe, model/gguf_config.py for dense qwen3; convert.write_shape_metadata and
# gguf_hybrid_config.write_hybrid_keys), so the peer's file is what `lucebox convert` would write.
DENSE_LAYER_NAMES = {f"{ours}.weight": f"{theirs}.weight" for theirs, ours in LAYER_TENSORS.items()}
DENSE_GLOBAL_NAMES = {ours: theirs for theirs, ours in GLOBAL_TENSORS.items()}
FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
              "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_k": LlamaFileType.MOSTLY_Q4_K_M,
              "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q5_k": LlamaFileType.MOSTLY_Q5_K_M,
              "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M, "q6_k": LlamaFileType.MOSTLY_Q6_K,
              "iq4_xs": LlamaFileType.MOSTLY_IQ4_XS}
FLOAT_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}
PATTERN_UNITS = 65521  # blocks (or float values) in a repeated pattern: prime, so matrix rows differ
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def arch_of(cfg: ModelConfig) -> str:
    if cfg.family in FAMILY_TO_HYBRID_ARCH:
        return FAMILY_TO_HYBRID_ARCH[cfg.family]
    if is_gemma4(cfg):
        return gguf_gemma4_config.ARCH
    if cfg.family == "qwen3":
        return "qwen3"
    raise ValueError(f"llama.cpp peer: no GGUF architecture for model family {cfg.family!r} "
                     f"(known: qwen3, {', '.join(FAMILY_TO_HYBRID_ARCH)}, gemma4)")


def _layout(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str, tuple[int, ...]]]:
    """(GGUF name, its shape, our parameter name, our shape) of every tensor of the file."""
    if cfg.family in FAMILY_TO_HYBRID_ARCH or is_gemma4(cfg):
        listed = gguf_gemma4.llama_cpp_gemma4_tensors(cfg) if is_gemma4(cfg) else llama_cpp_tensors(cfg)
        layout = [(name, shape, ours, our_shape) for name, shape, ours, _, our_shape in listed]
        if is_gemma4(cfg):  # the full layers' proportional RoPE (written with its values, not drawn)
            freqs = gguf_gemma4_config.rope_freqs(cfg).shape
            layout.append((ROPE_FREQS, freqs, ROPE_FREQS, freqs))
        return layout
    with on_meta():
        model = model_class(cfg)(cfg)
    layout = []
    for ours, p in model.named_parameters():
        match = _LAYER.fullmatch(ours)
        theirs = (f"blk.{match[1]}.{DENSE_LAYER_NAMES[match[2]]}" if match and match[2] in DENSE_LAYER_NAMES
                  else DENSE_GLOBAL_NAMES.get(ours))
        if theirs is None:
            raise ValueError(f"llama.cpp peer: no qwen3 GGUF name for tensor {ours}")
        layout.append((theirs, tuple(p.shape), ours, tuple(p.shape)))
    return layout


def tensor_plan(cfg: ModelConfig, quant: str) -> list[tuple[str, str, tuple[int, ...], Q]]:
    """(lucebox name, GGUF name, shape outermost first, GGML type) of every tensor of the file."""
    arch_of(cfg)
    plan = []
    for theirs, shape, ours, our_shape in _layout(cfg):
        if shapes.is_quantised(ours, our_shape):
            qtype = (FLOAT_TYPES[quant] if quant in FLOAT_TYPES
                     else shapes.weight_type(ours, quant, cfg.tie_word_embeddings, our_shape[-1]))
        else:
            qtype = Q.F32  # llama.cpp keeps routers, convs, the DeltaNet's a / b and 1-D tensors in float32
        plan.append((ours, theirs, shape, qtype))
    return plan


def tensor_bytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def _metadata(w: GGUFWriter, cfg: ModelConfig, quant: str, arch: str) -> None:
    want = FLOAT_TYPES[quant] if quant in FLOAT_TYPES else shapes.QUANT_MIXES[quant][0]  # Q.F32 is 0: falsy
    write_shape_metadata(w, cfg, f"random {cfg.family} for lucebox bench speed", want, FILE_TYPES[quant])
    if arch == gguf_gemma4_config.ARCH:
        gguf_gemma4_config.write_gemma4_keys(w, cfg)
    elif arch != "qwen3":
        write_hybrid_keys(w, cfg, arch, None)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _vocabulary(w: GGUFWriter, vocab_size: int, arch: str) -> None:
    """A valid gpt2-style BPE vocabulary: the 256 byte tokens, one merge and filler words."""
    if vocab_size < 258:
        raise ValueError(f"llama.cpp peer: a vocabulary of {vocab_size} is too small for the 256 byte tokens")
    tokens = [*_bytes_to_unicode(), "\u0120t", *(f"t{i}" for i in range(257, vocab_size))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35" if arch.startswith("qwen35") else "laguna" if arch == "laguna" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab_size)  # LLAMA_TOKEN_TYPE_NORMAL
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(vocab_size - 1)
    w.add_eos_token_id(vocab_size - 1)
    w.add_add_bos_token(False)


def _pattern(qtype: Q, seed: int) -> memoryview:
    """PATTERN_UNITS valid random blocks (float types: values) of qtype, as bytes."""
    torch.manual_seed(seed)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        values = torch.randn(PATTERN_UNITS).mul_(shapes.STD).to(dtype)
        return memoryview(values.view(torch.uint8).numpy().tobytes())
    block = GGML_QUANT_SIZES[qtype][0]
    qt = shapes.random_quant_tensor(qtype, 1, block * PATTERN_UNITS, torch.device("cpu"))
    return memoryview(qt.data.numpy().tobytes())


def _small_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A float32 tensor drawn for real: norms and Gemma 4's scalars 1, A = -exp(A_log) near -1, the rest N(0, 0.02)."""
    if "norm" in name or "scal" in name:
        return np.ones(shape, np.float32)
    values = rng.standard_normal(shape, dtype=np.float32) * shapes.STD
    return -np.exp(values) if name.endswith("A_log") else values


def write_gguf(cfg: ModelConfig, quant: str, path: str | Path, seed: int = 0) -> int:
    """Write the random GGUF of this config in this mix to `path` (via a .part file). Returns its size."""
    arch, path = arch_of(cfg), Path(path)
    plan = tensor_plan(cfg, quant)
    part = path.with_name(path.name + ".part")
    w = GGUFWriter(part, arch)
    _metadata(w, cfg, quant, arch)
    _vocabulary(w, cfg.vocab_size, arch)
    for _, target, shape, qtype in plan:
        w.add_tensor_info(target, shape, np.dtype(np.float32), tensor_bytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file(part)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    out, patterns, rng = w.fout[0], {}, np.random.default_rng(seed)
    w.write_padding(out, out.tell())
    for index, (name, _, shape, qtype) in enumerate(plan):
        nbytes = tensor_bytes(shape, qtype)
        if name == ROPE_FREQS:
            out.write(gguf_gemma4_config.rope_freqs(cfg).tobytes())
        elif qtype == Q.F32 and not shapes.is_quantised(name, shape):
            out.write(_small_tensor(name, shape, rng).tobytes())
        else:
            if qtype not in patterns:
                patterns[qtype] = _pattern(qtype, seed)
            unit = GGML_QUANT_SIZES[qtype][1]
            _write_repeating(out, patterns[qtype], nbytes, (index * 7919 % PATTERN_UNITS) * unit)
        w.write_padding(out, nbytes)
    w.close()
    os.replace(part, path)
    return path.stat().st_size


def _write_repeating(out, pattern: memoryview, nbytes: int, start: int) -> None:
    position = start % len(pattern)
    while nbytes:
        chunk = pattern[position:position + nbytes]
        out.write(chunk)
        nbytes -= len(chunk)
        position = 0


def expected_file_bytes(cfg: ModelConfig, quant: str) -> int:
    """Tensor data bytes of the file (the header and vocabulary come on top)."""
    return sum(tensor_bytes(shape, qtype) for _, _, shape, qtype in tensor_plan(cfg, quant))


# ------------------------------------------------------------------------------------------------ llama-bench
def bench_command(binary: str, path: str | Path, prompt_lens, decode_tokens: int, contexts, repeats: int,
                  extra: list[str] = ()) -> list[str]:
    depths = sorted({0, *contexts})
    return [str(binary), "-m", str(path), "-ngl", "99", "-fa", "1", "-p", ",".join(map(str, prompt_lens or [0])),
            "-n", str(decode_tokens if contexts else 0), "-d", ",".join(map(str, depths)), "-r", str(repeats),
            "-o", "json", *extra]


def parse_bench_json(text: str) -> dict:
    """llama-bench's `-o json` (tools/llama-bench/llama-bench.cpp json_printer): one object per test with
    n_prompt, n_gen, n_depth, avg_ts / stddev_ts (tokens a second), samples_ns and the model's
    description. Prompt tests become prefill rows, generation tests decode rows at their depth."""
    tests = json.loads(text)
    if not isinstance(tests, list) or not tests:
        raise ValueError("llama-bench printed no tests")
    first = tests[0]
    out = {"model_type": first["model_type"], "model_size": first["model_size"],
           "model_n_params": first["model_n_params"], "build_commit": first["build_commit"],
           "gpu_info": first.get("gpu_info"), "backends": first.get("backends"), "prefill": [], "decode": []}
    for t in tests:
        row = {"tok_s": float(t["avg_ts"]), "stddev_tok_s": float(t["stddev_ts"]), "depth": int(t["n_depth"]),
               "runs": len(t.get("samples_ns", []))}
        if t["n_gen"] == 0 and t["n_prompt"] > 0:
            out["prefill"].append(dict(row, prompt_len=int(t["n_prompt"])))
        elif t["n_prompt"] == 0 and t["n_gen"] > 0:
            out["decode"].append(dict(row, context=int(t["n_depth"]), tokens=int(t["n_gen"])))
    return out


def work_dir(given: str | None, need: int) -> Path:
    """--peer-dir, else the first of /dev/shm (memory: no writeback to wait for, ~10x faster than a
    VM's disk) and the temp dir with room for the file and 1 GiB spare."""
    candidates = [Path(given)] if given else [Path("/dev/shm"), Path(tempfile.gettempdir())]
    for d in candidates:
        if d.is_dir() and shutil.disk_usage(d).free > need + (1 << 30):
            return d
    free = {str(d): shutil.disk_usage(d).free // 2**30 for d in candidates if d.is_dir()}
    raise OSError(f"the random GGUF needs {need / 2**30:.1f} GiB of disk; free GiB: {free} (pass --peer-dir)")


def peer_phase(args, cfg: ModelConfig, quant: str, gguf: str | None, prefill: list[dict], decode: list[dict],
               say, prefix: list[dict] = ()) -> dict:
    """llama-bench on the same shape and mix (or the --model GGUF itself), and the lucebox / llama.cpp ratios;
    with cached-prefix rows (bench/prefix.py) a second llama-bench run times pp N at depth P (`-p N -n 0 -d P`:
    N tokens on top of P positions of KV), under "prefix"."""
    binary = Path(args.llama_bench)
    if not binary.is_file():
        return {"skipped": f"no llama-bench at {binary} (scripts/build_llama_cpp.sh builds or unpacks it)"}
    if gguf is None and not args.shape:
        return {"skipped": "the llama.cpp peer runs a --shape (written as a random GGUF) or a --model .gguf"}
    prompt_lens, contexts = [p["prompt_len"] for p in prefill], [d["context"] for d in decode]
    written = None
    try:
        if gguf is None:
            directory = work_dir(args.peer_dir, expected_file_bytes(cfg, quant))
            written = directory / f"lucebox-random-{args.shape}-{quant}.gguf"
            start = time.perf_counter()
            size = write_gguf(cfg, quant, written, args.seed)
            seconds = time.perf_counter() - start
            say(f"llama.cpp peer: wrote {written} ({size / 2**30:.2f} GiB in {seconds:.1f} s)")
        command = bench_command(binary, gguf or written, prompt_lens, args.decode_tokens, contexts, args.repeats,
                                shlex.split(args.peer_args))
        say("llama.cpp peer: " + " ".join(command))
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.peer_timeout, check=False)
        on_prefix = None
        if prefix and done.returncode == 0:
            on_prefix = bench_command(binary, gguf or written, sorted({x["suffix_len"] for x in prefix}), 0,
                                      [], args.repeats, shlex.split(args.peer_args))
            on_prefix[on_prefix.index("-d") + 1] = ",".join(str(d) for d in sorted({x["prefix_len"] for x in prefix}))
            say("llama.cpp peer, cached-prefix rows: " + " ".join(on_prefix))
            on_prefix = subprocess.run(on_prefix, capture_output=True, text=True, timeout=args.peer_timeout,
                                       check=False)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return {"skipped": f"llama.cpp peer: {e}"}
    finally:
        if written is not None:
            written.unlink(missing_ok=True)
            written.with_name(written.name + ".part").unlink(missing_ok=True)
    if done.returncode != 0:
        return {"skipped": f"llama-bench exited {done.returncode}: {done.stderr.strip()[-1500:]}", "command": command}
    result = dict(parse_bench_json(done.stdout), command=command, gguf_bytes=None if gguf else size,
                  write_seconds=None if gguf else seconds)
    if on_prefix is not None:
        result["prefix"] = (parse_bench_json(on_prefix.stdout)["prefill"] if on_prefix.returncode == 0 else [])
        result["prefix_error"] = on_prefix.stderr.strip()[-1500:] if on_prefix.returncode else None
    return dict(result, ratios=ratios(prefill, decode, result))


def ratios(prefill: list[dict], decode: list[dict], peer: dict) -> dict:
    """lucebox tok/s over llama.cpp's at the same prompt length (depth 0) and decode context."""
    theirs_p = {r["prompt_len"]: r["tok_s"] for r in peer["prefill"] if r["depth"] == 0}
    theirs_d = {r["context"]: r["tok_s"] for r in peer["decode"]}
    return {"prefill": {p["prompt_len"]: p["tok_s"] / theirs_p[p["prompt_len"]] for p in prefill
                        if p["prompt_len"] in theirs_p},
            "decode": {d["context"]: d["tok_s"] / theirs_d[d["context"]] for d in decode if d["context"] in theirs_d}}
