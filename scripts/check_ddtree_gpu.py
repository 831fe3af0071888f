#!/usr/bin/env python
"""Draft trees (DDTree) against chains on the GPU: greedy identity, tau and tok/s per tree budget.

    python scripts/check_ddtree_gpu.py                                  # the bundled pair
    python scripts/check_ddtree_gpu.py --model DIR --draft DFLASH_DIR --budgets 22 32 63
    python scripts/check_ddtree_gpu.py --device cpu --max-tokens 32     # checks the script runs

For each configuration (plain, chain, tree of each budget; speculation not adaptive, so every step
verifies) it generates the same prompts at T = 0 and prints tau (tokens committed per target pass),
tok/s, and how many outputs equal plain decoding token for token (GPU kernels of different widths
round differently, so a near-tie may diverge: report, not assert). Tree steps run eagerly (no CUDA
graph buckets by node count yet); the chain's verifies replay graphs, so tok/s compares a tree's
eager step with a chain's graph step.
"""
from __future__ import annotations

import argparse
import json
import time

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef softmax(x):", "class Stack:\n    def __init__(self):",
           "def quicksort(arr):", "# parse a CSV file into a list of dicts\nimport csv\n", "def binary_search(a, x):",
           "class LRUCache:\n", "async def fetch(url):"]


def run(model: str, config: dict | None, prompts: list[str], max_tokens: int, device: str) -> dict:
    from lucebox import LLM, SamplingParams
    llm = LLM(model, device=device, speculative_config=config if config is not None else {})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    verifies = sum(o.metrics.num_drafts for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"tau": 1 + accepted / verifies if verifies else 1.0, "tok_s": sum(map(len, tokens)) / seconds,
            "tokens": tokens}


def main() -> None:
    from lucebox.default_model import BUNDLED, BUNDLED_DRAFTER
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED))
    p.add_argument("--draft", default=str(BUNDLED_DRAFTER))
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 22, 32, 48, 63])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    base = {"method": "dflash", "model": args.draft, "adaptive": False}
    rows = {"plain": run(args.model, None, PROMPTS, args.max_tokens, args.device),
            "chain": run(args.model, base, PROMPTS, args.max_tokens, args.device)}
    for budget in args.budgets:
        rows[f"tree {budget}"] = run(args.model, base | {"tree_budget": budget}, PROMPTS, args.max_tokens, args.device)
    plain = rows["plain"]["tokens"]
    print(f"{'config':<10} {'tau':>6} {'tok/s':>9} {'= plain':>8}")
    for name, row in rows.items():
        same = sum(a == b for a, b in zip(row["tokens"], plain))
        row["identical"] = same
        print(f"{name:<10} {row['tau']:>6.2f} {row['tok_s']:>9.1f} {same:>5}/{len(plain)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {m: v for m, v in r.items() if m != "tokens"} for k, r in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
