"""GPU / llama.cpp check of the qwen3moe, qwen35 and qwen35moe GGUF files (the CPU tests cover the rest):

    python scripts/check_gguf_hybrid.py [--device cuda] [--llama-bench .llama/bin/llama-bench]

Builds the tiny random models of tests/model/test_gguf_hybrid.py, converts each with `lucebox convert`
(F16 and Q8_0), loads them on --device and prints the largest logit difference from transformers (float32,
CPU); with --llama-bench, runs llama.cpp on each file (ours, and one written in llama.cpp's own layout by
tests/hybrid_mutations.py) to show llama.cpp loads and runs them. Exits non-zero on any failure.
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
from tests.model.test_gguf_hybrid import ARCHS, lucebox_logits, prompt_for, reference_logits  # noqa: E402

# On CPU (2026-12-04): f16 moves these tiny models' logits by <= 0.003, Q8_0 by <= 0.22 (where a top-2
# routing choice flips), bf16 compute by <= 0.12 more; a layout mistake moves them by their own size (~1-2).
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--llama-bench", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    failures = 0
    work = Path(tempfile.mkdtemp(prefix="gguf-hybrid-"))
    tok = tokenizer(work / "tok")
    files = [write_hybrid_gguf(work / "llama-cpp-layout.gguf")]
    for arch, spec in ARCHS.items():
        hf_dir = build_hf_model("qwen3", work / arch, tok, **spec)
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        for qtype in ("f16", "q8_0"):
            path = convert_hf_to_gguf(hf_dir, work / f"{arch}-{qtype}.gguf", qtype)
            files.append(path)
            for dtype in (torch.float32, torch.bfloat16):
                loaded = load_model(str(path), dtype=dtype, device=args.device)
                prompt = prompt_for(loaded.config.vocab_size, length=40)
                diff = (lucebox_logits(loaded, prompt).float().cpu() - reference_logits(reference, prompt)).abs().max()
                ok = diff.item() <= LIMITS[qtype, dtype]
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {arch:9} {qtype:4} {str(dtype):14} on {args.device}: "
                      f"max |logit - transformers| = {diff.item():.4f} (limit {LIMITS[qtype, dtype]})")
    if args.llama_bench:
        for path in files:
            run = subprocess.run([args.llama_bench, "-m", str(path), "-p", "32", "-n", "8", "-r", "1"],
                                 capture_output=True, text=True, timeout=600)
            failures += run.returncode != 0
            tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
            print(f"{'ok  ' if run.returncode == 0 else 'FAIL'} llama-bench {path.name}: rc {run.returncode}")
            print("     " + "\n     ".join(tail))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
