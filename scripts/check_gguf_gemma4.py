"""GPU / llama.cpp check of the gemma4 GGUF files (the CPU tests cover the rest):

    python scripts/check_gguf_gemma4.py [--device cuda] [--llama-bench .llama/bin/llama-bench]
                                        [--llama-logits ./llama-logits]

Builds the tiny random Gemma 4 models of tests/model/test_gguf_gemma4.py (31B-like dense: sliding/full layers,
KV-shared layers, k = v, per-layer inputs; 26B-A4B-like MoE), converts each with `lucebox convert` (F32, F16,
Q8_0), loads them on --device and prints the largest logit difference from transformers; with --llama-bench
runs llama.cpp on each file (--repack 0: this CPU build's repacking crashes on tiny Q8_0 shapes, qwen's too);
with --llama-logits (scripts/llama_logits.cpp) compares llama.cpp's logits with transformers'.
On CPU (2026-12-04, llama.cpp of the llama-cpp-python 0.3.36 sdist): llama.cpp loads and runs both files;
on F32 it is within 0.0023 (dense) / 0.0026 (MoE) of transformers, 0.0011 / 0.0009 with flash attention off
(NOFA=1), and 0.0002 / 0.0001 when transformers' GELU is rounded as ggml's CPU table does (fp16 in and out).
Exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.check_gguf_hybrid import check_converted, llama_bench_runs, tokenizer  # noqa: E402
from tests.conftest import build_hf_model  # noqa: E402
from tests.model.test_gguf_gemma4 import SPECS  # noqa: E402

# Q8_0 moves these tiny Gemma 4 models' logits by about their own size (~0.5: normalised q and k at scale 1
# make attention peaked); F16 by a few thousandths; a layout mistake shows at F32/F16.
LIMITS = {("f32", torch.float32): 1e-3, ("f16", torch.float32): 0.02, ("f16", torch.bfloat16): 0.4,
          ("q8_0", torch.float32): 0.8, ("q8_0", torch.bfloat16): 0.8}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--llama-logits", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    failures, files = 0, []
    work = Path(tempfile.mkdtemp(prefix="gguf-gemma4-"))
    tok = tokenizer(work / "tok")
    for kind, spec in SPECS.items():
        hf_dir = build_hf_model("qwen3", work / kind, tok, **spec)
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        converted, bad = check_converted(f"gemma4 {kind}", hf_dir, reference, work / f"gemma4-{kind}", args, LIMITS)
        files += converted
        failures += bad
    if args.llama_bench:
        failures += llama_bench_runs(args.llama_bench, files)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
