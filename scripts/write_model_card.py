"""Write models/default/README.md (the model card) from the training runs' stats.json files.

    python scripts/write_model_card.py [--target models/default] [--drafter models/default-dflash]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "default", help="the card goes in here")
    ap.add_argument("--drafter", type=Path, default=ROOT / "models" / "default-dflash")
    args = ap.parse_args()
    target, drafter = args.target, args.drafter
    t = json.loads((target / "stats.json").read_text())
    d = json.loads((drafter / "stats.json").read_text()) if (drafter / "stats.json").is_file() else None
    cfg = json.loads((target / "config.json").read_text())
    c, a = t["corpus"], t["args"]
    pre, chat = t["pretrain"], t["chat"]
    lines = [
        "# lucebox default model: a small Python code model and its DFlash drafter",
        "",
        "Trained from scratch by lucebox's own scripts so that lucebox works out of the box, offline.",
        "It writes plausible-looking Python; it is far too small to be correct often. It exists to",
        "exercise the whole engine (tokenizer, chat template, tool-call tokens, speculative decoding)",
        "with a real, trained model.",
        "",
        "## Architecture",
        f"Qwen3 architecture: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, "
        f"SwiGLU FFN {cfg['intermediate_size']}, per-head q/k RMSNorm, RoPE theta {cfg['rope_theta']:g}, "
        f"tied embeddings, vocabulary {cfg['vocab_size']:,}, context {cfg['max_position_embeddings']:,}. "
        f"{t['parameters']:,} parameters, stored in bfloat16.",
        "",
        "Tokenizer: byte-level BPE (Qwen2 pre-tokenizer regex) trained on the corpus, with the specials "
        "`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, "
        "`<tool_response>`, `</tool_response>` and the DFlash mask token `<|mask|>`. Chat template: ChatML "
        "with Hermes-style tool calls (`scripts/chat_template.jinja`).",
        "",
        "## Data",
        f"The Python source files of the packages installed on the training machine: {c['files_seen']:,} files "
        f"seen, {c['duplicates']:,} exact duplicates and {c['skipped']:,} oversized or minified files dropped, "
        f"{c['bytes'] / 2**20:.0f} MiB kept. Held out by file (content hash): {c['held_out_files']} files, "
        f"{t['tokens']['held_out']:,} tokens; training: {c['train_files']:,} files, {t['tokens']['train']:,} tokens.",
        "",
        "## Training",
        f"On {t['device']} (torch {t['torch']}), bf16 autocast, AdamW (betas 0.9/0.95, weight decay 0.1), "
        "warm-up then cosine decay over a wall-clock budget, gradient clipping 1.0.",
        f"- Pre-training: sequences of {a['seq_len']} tokens, batch {a['batch']}, peak lr {a['lr']:g}: "
        f"{pre['steps']:,} steps, {pre['tokens'] / 1e6:.0f}M tokens in {pre['seconds']:.0f} s.",
        f"- Chat stage: {t['chat_tasks']:,} tasks built from the training files (the user gives a function's "
        "signature and docstring, the assistant writes the function), loss on the answer only, mixed 3:1 with "
        f"pre-training windows: {chat['steps']:,} steps in {chat['seconds']:.0f} s.",
        "",
        *long_context_section(t.get("long_context")),
        "## Results",
        f"Held-out loss: {t['held_out_loss_after_pretrain']:.3f} nats/token after pre-training, "
        f"{t['held_out_loss']:.3f} after the chat stage.",
        "",
        "Greedy samples (from the training run):",
        "",
    ]
    for s in t["samples"]:
        lines += [f"Prompt: `{s['prompt'].strip()}`", "```", s["completion"].rstrip()[:400], "```", ""]
    if d:
        lines += drafter_section(d)
    lines += [
        "## Files",
        "- `models/default/`: the target in HF format (sharded safetensors, config, tokenizer, chat template, "
        "generation_config), `stats.json` and `training.log` from the run.",
        "- A Q8_0 GGUF of the target is not shipped (it would take the repository past the device's 64 MiB); "
        "`lucebox convert models/default default-q8_0.gguf --outtype q8_0` writes it in seconds. Its greedy "
        "output can drift from the bf16 weights' after a few tokens on some prompts (quantisation error), "
        "which `tests/test_default_model.py` measures on a fresh conversion.",
        ("- `models/default-dflash/`: the drafter in the z-lab layout, its `stats.json` and training logs." if d else
         "- The DFlash drafter is not shipped yet: the best GPU-trained one (2 layers, 1,891 steps) reaches "
         "tau 1.5-2.3 in the engine on standard-library snippets (3.4 in the trainer's replay of "
         "continuations of the target's training files), under the bar (tau >= 3) and slower than n-gram lookup, with which "
         "lucebox speculates for this model until a drafter ships (BENCHMARKS.md)."),
        "",
        "## Reproduce",
        "```bash",
        "python scripts/train_default_model.py --out models/default      # ~8 min on one H200",
        "bash scripts/train_default_drafter.sh models/default-dflash 330   # the drafter (one H200, ~7 min)",
        "ARCH=dflash2 INIT_DRAFTER=models/default-dflash LR=3e-4 bash scripts/train_default_drafter.sh OUT  # grown into DFlash2",
        "STAGE=target bash scripts/extend_default_context.sh OUT; STAGE=drafter ...  # YaRN to 64K (two H200 calls, ~6 min each)",
        "python scripts/write_model_card.py",
        "```",
        "The corpus is whatever Python packages the training machine has installed, so a different machine "
        "gives a different (similar) model.",
    ]
    (target / "README.md").write_text("\n".join(lines) + "\n")
    return 0


def long_context_section(lc: dict | None) -> list[str]:
    """The context extension (scripts/extend_default_context.py), when the model went through it."""
    if not lc:
        return []
    rope, run, a = lc["rope_scaling"], lc["train"], lc["args"]
    losses = lc["loss_by_position"]
    buckets = list(losses["extended"])
    rows = [("base model, plain RoPE", "base"), ("YaRN, before the stage", "yarn_untrained"),
            ("after the stage", "extended")]
    return [
        "## Long context",
        f"Context extended from {rope['original_max_position_embeddings']:,} to {lc['context']:,} positions by "
        f"YaRN (factor {rope['factor']:g}) and a training stage of {run['steps']:,} steps, "
        f"{run['tokens'] / 1e6:.0f}M tokens in {run['seconds']:.0f} s on {lc['device']} "
        f"(`scripts/extend_default_context.py`): windows of {a['long_lens'].replace(',', ', ')} tokens of the "
        "corpus's token stream (neighbouring files of one package in a row), mixed with the base recipe's "
        f"{rope['original_max_position_embeddings']:,}-token windows and chat examples on "
        f"{a['short_fraction']:.0%} of the steps, peak lr {a['lr']:g}.",
        "",
        "Held-out loss (nats/token) by position, over windows of held-out code:",
        "",
        "| model | " + " | ".join(buckets) + " |",
        "|---|" + "---:|" * len(buckets),
        *[f"| {name} | " + " | ".join(f"{losses[key][b]:.3f}" for b in buckets) + " |" for name, key in rows],
        "",
    ]


def drafter_section(d: dict) -> list[str]:
    steps = list(d["trainer_tau"].items())
    shown = [steps[round(i * (len(steps) - 1) / 7)] for i in range(8)] if len(steps) > 8 else steps
    e = d["engine_tau"]
    speed = (f", {d['steps']:,} steps in {d['train_seconds']} s ({d['seconds_per_step']} s/step)"
             if d.get("train_seconds") else f", {d['steps']:,} steps")
    dflash2 = d.get("arch") == "dflash2"
    grown = ([f"A DFlash2 drafter: grouped dynamic convolutions around each sub-layer and a candidate selector "
              f"(rank-{d.get('selector_rank', 256)} predecessor / successor codebooks over the top-16 candidates) "
              "whose walk is the draft chain and whose lattice grows the draft trees. " + (d.get("recipe") or ""), ""]
             if dflash2 else [])
    return [
        "## DFlash drafter (`models/default-dflash`)", "", *grown,
        f"{d['layers']} DFlash layers (hidden {d['hidden_size']}), block {d['block_size']}, mask token `<|mask|>`, "
        f"reading the target's layers {', '.join(map(str, d['taps']))}; no embedding or LM head of its own (the "
        "target's are shared); bfloat16, in the published z-lab layout. Trained by "
        "`scripts/train_default_drafter.sh` (`lucebox train-drafter`) on the target's own greedy 128-token "
        "continuations of 128-token prompts cut from its training files, every continuation position an "
        f"anchor, slot-weighted cross-entropy{speed}. Short continuations matter: the target's greedy text "
        "falls into loops after about a hundred tokens, and a drafter trained on long continuations learns "
        "to copy loops rather than to draft where requests spend their drafts.", "",
        "Held-out tau in the trainer's replay (continuations of the target's held-out files):", "",
        "| step | " + " | ".join(f"{int(s):,}" for s, _ in shown) + " |",
        "|---|" + "---:|" * len(shown),
        "| tau | " + " | ".join(f"{t:.2f}" for _, t in shown) + " |", "",
        "Slot accuracy at the end: " + " ".join(f"{a:.2f}" for a in d["slot_accuracy"][:8]) + " ...", "",
        f"In the engine (float32, CPU, greedy): tau {e['tau']:.2f} over {e['tokens']} tokens after each of "
        f"{e['snippets']} held-out standard-library snippets of {e['chars']} characters "
        "(`lucebox/bench/prompts.py`; `tests/test_default_model.py` asserts > 2). With no `--model`, lucebox "
        "drafts with n-gram lookup where the text repeats and with this drafter elsewhere (`ngram_first`); "
        "speed figures in BENCHMARKS.md.", ""]


if __name__ == "__main__":
    sys.exit(main())
