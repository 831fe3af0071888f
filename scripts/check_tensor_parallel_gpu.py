#!/usr/bin/env python
"""Tensor parallelism over NCCL (two GPUs): TP=N against one GPU, greedy tokens and tok/s.

    python scripts/check_tensor_parallel_gpu.py                          # the bundled pair, 2 ranks
    python scripts/check_tensor_parallel_gpu.py --model DIR_OR_GGUF --draft DFLASH_DIR --size 2
    python scripts/check_tensor_parallel_gpu.py --device cpu --max-tokens 16   # checks the script runs (gloo)

For each configuration (plain, n-gram, DFlash when a drafter is given or the bundled pair runs) it
generates the same prompts at T = 0 on one device and on `--size` ranks, and prints tok/s of both and
how many outputs are token-identical (on GPUs a sharded product sums in another order than the whole
one, so a near-tie may diverge in bfloat16: report, not assert). Steps run eagerly under TP (no CUDA
graphs yet), so the one-device run is eager too (enforce_eager) for a like-for-like rate.
"""
from __future__ import annotations

import argparse
import json
import time

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef softmax(x):", "class Stack:\n    def __init__(self):",
           "def quicksort(arr):", "# parse a CSV file into a list of dicts\nimport csv\n", "def binary_search(a, x):"]


def run(model: str | None, config: dict | None, size: int, device: str, max_tokens: int) -> dict:
    from lucebox import LLM, SamplingParams
    kwargs = {"device": device, "cuda_graphs": False, "tensor_parallel_size": size}
    if config is not None:
        kwargs["speculative_config"] = config
    llm = LLM(model, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        started = time.perf_counter()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        llm.engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: the bundled default model)")
    p.add_argument("--draft", default=None, help="a DFlash drafter for --model")
    p.add_argument("--size", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    configs = {"plain": {}, "ngram": {"method": "ngram"}}
    if args.draft:
        configs["dflash"] = {"method": "dflash", "model": args.draft}
    elif args.model is None:
        configs["dflash"] = None  # the bundled pair's own drafter
    rows = {}
    for name, config in configs.items():
        one = run(args.model, config, 1, args.device, args.max_tokens)
        many = run(args.model, config, args.size, args.device, args.max_tokens)
        same = sum(a == b for a, b in zip(one["tokens"], many["tokens"]))
        rows[name] = {"tok_s_1": one["tok_s"], f"tok_s_{args.size}": many["tok_s"], "identical": same,
                      "prompts": len(PROMPTS)}
        print(f"{name:7s} 1 rank {one['tok_s']:8.1f} tok/s   {args.size} ranks {many['tok_s']:8.1f} tok/s   "
              f"token-identical {same}/{len(PROMPTS)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
