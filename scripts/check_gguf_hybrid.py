"""GPU / llama.cpp check of the qwen3moe, qwen35 and qwen35moe GGUF files (the CPU tests cover the rest):

    python scripts/check_gguf_hybrid.py [--device cuda] [--llama-bench .llama/bin/llama-bench]
                                        [--llama-logits ./llama-logits]

Builds the tiny random models of tests/model/test_gguf_hybrid.py, converts each with `lucebox convert`
(F16 and Q8_0), loads them on --device and prints the largest logit difference from transformers (float32,
CPU); with --llama-bench, runs llama.cpp on each file (ours, and one written in llama.cpp's own layout by
tests/hybrid_mutations.py) to show llama.cpp loads and runs them; with --llama-logits (scripts/llama_logits.cpp)
compares llama.cpp's logits on our files with transformers'. Exits non-zero on any failure.
On CPU (2026-12-04, llama.cpp of the llama-cpp-python 0.3.36 sdist, its repacking off: it crashes on these
tiny Q8_0 shapes, so llama-bench fails on them unless run with --repack 0): llama.cpp on our F32 files is
within 0.0005 (qwen3moe), 0.0007 (qwen35) and 0.0016 (qwen35moe, but 0.12 at one position whose top-2
routing is a near tie) of transformers; on Q8_0 it moves as lucebox does (0.01-0.21).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lucebox.convert import convert_hf_to_gguf  # noqa: E402
from lucebox.model.loader import load_model  # noqa: E402
from tests.conftest import CHATML_TEMPLATE, SPECIAL_TOKENS, TRAINING_TEXT, build_hf_model  # noqa: E402
from tests.hybrid_mutations import write_hybrid_gguf  # noqa: E402
from tests.gguf_files import lucebox_logits, prompt_for  # noqa: E402
from tests.model.test_gguf_hybrid import ARCHS, reference_logits  # noqa: E402

# On CPU (2026-12-04): f16 moves these tiny models' logits by <= 0.003, Q8_0 by <= 0.22 (where a top-2
# routing choice flips), bf16 compute by <= 0.12 more; a layout mistake moves them by their own size (~1-2).
# Per position, llama.cpp on our files is within ~0.002 of transformers at F32/F16 (its own rounding), except
# where a near-tie in top-2 routing goes the other way (one position ~0.1, the state carrying a little after):
# hence a median and a looser maximum.
LLAMA_CPP_LIMITS = {"f32": 0.01, "f16": 0.02, "q8_0": 0.1}
LIMITS = {("f16", torch.float32): 0.02, ("q8_0", torch.float32): 0.4, ("f16", torch.bfloat16): 0.4,
          ("q8_0", torch.bfloat16): 0.5}


def tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TRAINING_TEXT], trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML_TEMPLATE}))
    return out


def llama_logits_agree(binary: str, path: Path, reference, qtype: str) -> bool:
    prompt = prompt_for(reference.config.vocab_size, length=40)
    run = subprocess.run([binary, str(path), *map(str, prompt)], capture_output=True, timeout=600)
    if run.returncode:
        print(f"FAIL llama.cpp logits {path.name}: rc {run.returncode}: {run.stderr.decode(errors='replace')[-300:]}")
        return False
    got = torch.tensor([[float(v) for v in line.split()] for line in run.stdout.decode().strip().splitlines()])
    per_position = (got - reference_logits(reference, prompt)).abs().max(dim=1).values
    typical, worst = per_position.median().item(), per_position.max().item()
    ok = typical <= LLAMA_CPP_LIMITS[qtype] and worst <= 0.4
    print(f"{'ok  ' if ok else 'FAIL'} llama.cpp {path.name}: |logit - transformers| median over positions "
          f"{typical:.4f} (limit {LLAMA_CPP_LIMITS[qtype]}), max {worst:.4f} (limit 0.4)")
    return ok


def check_converted(label: str, hf_dir: Path, reference, stem: Path, args, limits: dict) -> tuple[list[Path], int]:
    """`lucebox convert` of hf_dir at F32 / F16 / Q8_0 (files stem-QTYPE.gguf): llama.cpp's logits against
    transformers' with args.llama_logits, and lucebox's on args.device for every (qtype, dtype) in
    `limits`. Returns the files and the failures."""
    files, failures = [], 0
    for qtype in ("f32", "f16", "q8_0"):
        path = convert_hf_to_gguf(hf_dir, stem.parent / f"{stem.name}-{qtype}.gguf", qtype)
        files.append(path)
        if args.llama_logits:
            failures += not llama_logits_agree(args.llama_logits, path, reference, qtype)
        for dtype in (torch.float32, torch.bfloat16):
            if (qtype, dtype) not in limits:
                continue
            loaded = load_model(str(path), dtype=dtype, device=args.device)
            prompt = prompt_for(loaded.config.vocab_size, length=40)
            diff = (lucebox_logits(loaded, prompt).float().cpu() - reference_logits(reference, prompt)).abs().max()
            ok = diff.item() <= limits[qtype, dtype]
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {label:16} {qtype:4} {str(dtype):14} on {args.device}: "
                  f"max |logit - transformers| = {diff.item():.4f} (limit {limits[qtype, dtype]})")
    return files, failures


def llama_bench_runs(binary: str, files: list[Path]) -> int:
    """llama-bench on each file (--repack 0: this CPU build's repacking crashes on tiny Q8_0 shapes); failures."""
    failures = 0
    for path in files:
        run = subprocess.run([binary, "-m", str(path), "-p", "32", "-n", "8", "-r", "1", "--repack", "0"],
                             capture_output=True, text=True, timeout=600)
        failures += run.returncode != 0
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        print(f"{'ok  ' if run.returncode == 0 else 'FAIL'} llama-bench {path.name}: rc {run.returncode}")
        print("     " + "\n     ".join(tail))
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--llama-logits", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    failures = 0
    work = Path(tempfile.mkdtemp(prefix="gguf-hybrid-"))
    tok = tokenizer(work / "tok")
    files = [write_hybrid_gguf(work / "llama-cpp-layout.gguf")]
    for arch, spec in ARCHS.items():
        hf_dir = build_hf_model("qwen3", work / arch, tok, **spec)
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        converted, bad = check_converted(arch, hf_dir, reference, work / arch, args, LIMITS)
        files += converted
        failures += bad
    if args.llama_bench:
        failures += llama_bench_runs(args.llama_bench, files)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
