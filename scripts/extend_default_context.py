"""Extend the default model's context (2,048 -> 65,536 tokens): YaRN RoPE scaling plus a short stage
of training on long sequences, so that a coding agent's first prompt (8-38K tokens) is served.

    python scripts/extend_default_context.py --base models/default --out DIR [--seconds 240]

Steps: the base HF directory's weights and config; the config gains YaRN (factor = context / base
context, the base context as original_max_position_embeddings) and the new max_position_embeddings;
held-out loss by position, for the base model as it was and with YaRN before any training; training
on a mix of long windows of the corpus's token stream (files in path order, so a window holds
neighbouring files of one package, whose imports and names recur across it) and of the base
recipe's own batches (2,048-token windows, chat examples) so that short prompts keep their quality;
held-out loss by position again; the new HF directory: the base's tokenizer and template files,
config.json, sharded safetensors, stats.json (the base's figures plus a `long_context` section) and
the model card (scripts/write_model_card.py). The DFlash drafter is extended afterwards
(scripts/extend_default_context.sh runs both).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_default_model import chat_batches, encode, log, samples, save_sharded, windows  # noqa: E402
from lucebox.model.config import ModelConfig, with_yarn  # noqa: E402
from lucebox.model.rope import RopeTable  # noqa: E402
from lucebox.model.transformer import Transformer  # noqa: E402
from lucebox.train import corpus  # noqa: E402
from lucebox.train.lm import dense_forward, train  # noqa: E402

COPIED = ("tokenizer.json", "generation_config.json", "training.log")


def load_weights(model: Transformer, base: Path) -> None:
    from safetensors.torch import load_file
    state = {}
    for shard in sorted(base.glob("*.safetensors")):
        state.update({k.removeprefix("model."): v.float() for k, v in load_file(str(shard)).items()})
    model.load_state_dict(state)


def read_corpus(args) -> tuple[list[str], list[str], dict]:
    """The base recipe's corpus (installed packages' Python sources, the same held-out split), or
    the .py files under --corpus-dir (tests)."""
    if args.corpus_dir is None:
        return corpus.collect(args.corpus_mb << 20)
    train_texts, held = [], []
    for path in sorted(Path(args.corpus_dir).rglob("*.py")):
        data = path.read_bytes()
        (held if corpus.is_held_out(data) else train_texts).append(data.decode("utf-8", errors="ignore"))
    if not held:  # a handful of files may hold none out by hash
        held = train_texts[-1:]
    return train_texts, held, {"files": len(train_texts) + len(held), "dir": str(args.corpus_dir)}


def bucket_edges(original: int, context: int) -> list[int]:
    """[0, original, 4 x original, ..., context]: loss by position shows where the context ends."""
    edges, edge = [0], original
    while edge < context:
        edges.append(edge)
        edge *= 4
    return edges + [context]


@torch.no_grad()
def position_losses(model: Transformer, held: list[torch.Tensor], edges: list[int], device) -> dict[str, float]:
    """Mean next-token loss of held-out windows per position bucket ("0-2048": ...)."""
    total = torch.zeros(edges[-1], dtype=torch.float64)
    for ids in held:
        ids = ids.to(device)
        rows = []
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = dense_forward(model, ids[:, :-1])
            for start in range(0, hidden.shape[1], 8192):  # float32 logits of 8K positions at a time
                logits = model.compute_logits(hidden[:, start:start + 8192]).float()
                targets = ids[:, 1 + start:1 + start + 8192]
                rows.append(F.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))
        total += torch.cat(rows, dim=1).sum(0).double().cpu()
    means = total / len(held)
    return {f"{a}-{b}": round(float(means[a:b].mean()), 4) for a, b in zip(edges, edges[1:])}


def mixed_batches(args, tok, tasks, train_tokens: np.ndarray, original: int, device):
    """Long windows (a length from --long-lens, --tokens-per-step tokens) and, on --short-fraction
    of the steps, the base recipe's batches in turn: 2,048-token windows, chat examples."""
    rng = random.Random(args.seed)
    lengths = [int(n) for n in args.long_lens.split(",")]
    longs = {n: windows(train_tokens, n, max(1, args.tokens_per_step // n), device, args.seed + n) for n in lengths}
    shorts = [windows(train_tokens, original, max(1, args.tokens_per_step // original), device, args.seed)]
    if tasks:
        shorts.append(chat_batches(tok, tasks, train_tokens, device, max(4, args.tokens_per_step // 512), 512, args.seed))
    turn = 0
    while True:
        if rng.random() < args.short_fraction:
            turn += 1
            yield next(shorts[turn % len(shorts)])
        else:
            yield next(longs[rng.choice(lengths)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="models/default", help="the HF directory to extend (plain RoPE)")
    ap.add_argument("--out", required=True, help="the extended HF directory")
    ap.add_argument("--context", type=int, default=65536, help="the new context (max_position_embeddings)")
    ap.add_argument("--seconds", type=float, default=240, help="wall-clock budget of the training stage")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (tests)")
    ap.add_argument("--long-lens", default="16384,32768,65536", help="lengths of the long windows, drawn per step")
    ap.add_argument("--tokens-per-step", type=int, default=65536, help="tokens per batch (long and short)")
    ap.add_argument("--short-fraction", type=float, default=0.3, help="share of steps on the base recipe's batches")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (the base trained at 2e-3)")
    ap.add_argument("--corpus-mb", type=int, default=150, help="corpus size (the base recipe's)")
    ap.add_argument("--corpus-dir", default=None, help="train on the .py files here instead (tests)")
    ap.add_argument("--eval-windows", type=int, default=4, help="held-out windows of --context tokens for the loss by position")
    ap.add_argument("--samples", action=argparse.BooleanOptionalAction, default=True, help="greedy sample completions")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base, out = Path(args.base), Path(args.out)
    if not (base / "config.json").is_file():
        raise SystemExit(f"--base {base}: no config.json (give the default model's HF directory)")
    lengths = [int(n) for n in args.long_lens.split(",")]
    if max(lengths) > args.context:
        raise SystemExit(f"--long-lens {args.long_lens}: windows longer than --context {args.context}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    base_config = json.loads((base / "config.json").read_text())
    original = int(base_config["max_position_embeddings"])
    config = with_yarn(base_config, args.context)
    stats = json.loads((base / "stats.json").read_text()) if (base / "stats.json").is_file() else {}
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "args": vars(args), "rope_scaling": config["rope_scaling"], "context": args.context}

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    train_texts, held_texts, info["corpus"] = read_corpus(args)
    train_tokens, held_tokens = encode(tok, train_texts), encode(tok, held_texts)
    info["tokens"] = {"train": int(len(train_tokens)), "held_out": int(len(held_tokens))}
    log(f"corpus {info['corpus']}, tokens {info['tokens']} at {time.time() - t0:.0f}s")
    if len(train_tokens) <= max(lengths) + 1:
        raise SystemExit(f"the corpus holds {len(train_tokens)} tokens: too few for {max(lengths)}-token windows")
    eval_len = min(args.context, len(held_tokens) - 2)
    held = [next(windows(held_tokens, eval_len, 1, "cpu", 1 + i)) for i in range(args.eval_windows)]
    edges = bucket_edges(original, eval_len)

    model = Transformer(ModelConfig.from_hf_dict(base_config))
    load_weights(model, base)
    model.to(device)
    info["loss_by_position"] = {"base": position_losses(model, held, edges, device)}
    log(f"held-out loss by position, base model (plain RoPE): {info['loss_by_position']['base']}")
    model.config = ModelConfig.from_hf_dict(config)
    model.rope = RopeTable(model.config.rope, model.config.head_dim)
    info["loss_by_position"]["yarn_untrained"] = position_losses(model, held, edges, device)
    log(f"... with YaRN, before training: {info['loss_by_position']['yarn_untrained']}")

    tasks = corpus.function_tasks(train_texts, 40000)
    batches = mixed_batches(args, tok, tasks, train_tokens, original, device)
    steps = args.steps if args.steps is not None else math.inf

    def limited():
        for i, batch in enumerate(batches):
            if i >= steps:
                return
            yield batch

    log(f"training for {args.seconds:.0f}s on windows of {args.long_lens} tokens "
        f"({args.short_fraction:.0%} of steps on {original}-token windows and chat examples)")
    info["train"] = train(model, limited, args.seconds, args.lr, warmup=0.05, log=log)
    info["loss_by_position"]["extended"] = position_losses(model, held, edges, device)
    log(f"... after training: {info['loss_by_position']['extended']}")

    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = json.loads((base / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = args.context
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    for name in COPIED:
        if (base / name).is_file() and (base / name).resolve() != (out / name).resolve():
            shutil.copy(base / name, out / name)
    save_sharded(model, out)
    if args.samples:
        long_prompt = tok.decode(held_tokens[:min(len(held_tokens), args.context // 2)].tolist())
        cut = long_prompt.rfind("\ndef ")
        long_prompt = long_prompt[:cut + 1] + "def " if cut > 0 else long_prompt  # ends where a function starts
        # Two sequences at most, so the KV pool stays small at --context positions.
        info["samples"] = samples(out, ["def fibonacci(n):\n", long_prompt], max_num_seqs=2)
        info["samples"][1]["prompt"] = f"(held-out code, {len(tok.encode(long_prompt).ids):,} tokens) ... def "
        log(json.dumps(info["samples"], indent=1)[:3000])
    info["seconds"] = round(time.time() - t0, 1)
    stats["long_context"] = info
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    log(f"done in {info['seconds']:.0f}s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
