"""GPU / llama.cpp check of the `laguna` GGUF files (the CPU tests cover the rest):

    python scripts/check_gguf_laguna.py [--device cuda] [--llama-bench .llama/bin/llama-bench]
                                        [--llama-logits ./llama-logits] [--llama-tokenize ./llama-tokenize]

Builds the tiny random Laguna models of tests/model/test_gguf_laguna.py (router soft-capping off: llama.cpp's
laguna has none), converts each with `lucebox convert` (F32, F16, Q8_0), loads them on --device and prints
the largest logit difference from transformers (float32, CPU); with --llama-bench, runs llama-bench on each
file; with --llama-logits (scripts/llama_logits.cpp) compares llama.cpp's logits on our files with
transformers'; with --llama-tokenize (scripts/llama_tokenize.cpp), tokenizes texts with a Laguna-style
pre-tokenizer (newline runs, then Qwen2's regex: tokenizer.ggml.pre "laguna") by llama.cpp, lucebox's GGUF
tokenizer and the HF one. Exits non-zero on any failure.
On CPU (2026-12-04, llama.cpp of the llama-cpp-python 0.3.36 sdist): llama.cpp on our F32 files is within
0.0005 of transformers (YaRN full layers, a 5-token window under a 23-40 token prompt, per-head and
per-channel gates, one and two leading dense layers), in one batch and token by token; on F16 / Q8_0 files
it moves as lucebox does (<= 0.016 / 0.03). llama-bench runs them all (--repack 0: its CPU repacking crashes
on these tiny Q8_0 shapes). llama.cpp tokenizes the 7 texts as lucebox and HF do.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_gguf_hybrid import LIMITS, check_converted, llama_bench_runs, tokenizer  # noqa: E402

from lucebox.convert import convert_hf_to_gguf  # noqa: E402
from lucebox.model.loader import load_model  # noqa: E402
from tests.model.test_gguf_laguna import VARIANTS  # noqa: E402
from tests.model.test_laguna import build_laguna  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--llama-logits", default=None)
    parser.add_argument("--llama-tokenize", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    failures = 0
    work = Path(tempfile.mkdtemp(prefix="gguf-laguna-"))
    tok = tokenizer(work / "tok")
    files = []
    for name, spec in VARIANTS.items():
        hf_dir = build_laguna(work / name, tok, **dict(spec, moe_router_logit_softcapping=0.0))
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        converted, bad = check_converted(f"laguna {name}", hf_dir, reference, work / name, args, LIMITS)
        files += converted
        failures += bad
    if args.llama_bench:
        failures += llama_bench_runs(args.llama_bench, files)
    if args.llama_tokenize:
        failures += not tokenizations_agree(args.llama_tokenize, tok, work)
    return 1 if failures else 0


TEXTS = ["def f(x):  \n\n    return x  \n  # it's 12345\r\n\ttab  done \n", "hello world", " \n \n\n  a\n",
         "Über 東京 café — naïve 3.14159 ok's THEY'RE\n\n\n", "x  \n\ny", "   leading\n\ttabs\t\n", "a</assistant>b \n"]


def tokenizations_agree(binary: str, tok: Path, work: Path) -> bool:
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from lucebox.text.gguf_vocab import NEWLINE_RUNS_REGEX, QWEN2_REGEX
    backend = Tokenizer.from_file(str(tok / "tokenizer.json"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(NEWLINE_RUNS_REGEX), behavior="isolated"),
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.add_tokens(["</assistant>"])
    backend.save(str(tok / "tokenizer.json"))
    hf_dir = build_laguna(work / "laguna-tok", tok, **VARIANTS["per_head"])
    path = convert_hf_to_gguf(hf_dir, work / "laguna-tok.gguf", "f32")
    ours, hf = load_model(str(path)).tokenizer, load_model(str(hf_dir)).tokenizer
    ok = True
    for text in TEXTS:
        run = subprocess.run([binary, str(path)], input=text.encode(), capture_output=True, timeout=60)
        theirs = [int(i) for i in run.stdout.split()]
        agree = run.returncode == 0 and theirs == ours.encode(text) == hf.encode(text)
        ok &= agree
        print(f"{'ok  ' if agree else 'FAIL'} tokenize {text[:24]!r}: llama.cpp {theirs[:10]}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
