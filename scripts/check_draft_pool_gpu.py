#!/usr/bin/env python
"""The DFlash drafter-side KV pool (--draft-kv-pool-tokens) on the GPU: speculative decode tok/s, tau
and greedy identity at long contexts, with and without the pool (issue 30's drafter row: at 128K,
>= 1.3x the tok/s of the full drafter context).

    python scripts/check_draft_pool_gpu.py --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 \\
        --contexts 8192 32768 131072 --pool 4096
    python scripts/check_draft_pool_gpu.py --device cpu --contexts 1024 --pool 512 --max-tokens 16  # runs

Prompts are the repository's own docs, repeated to the context length, then a question. Each row
prefills the prompt once (max_tokens=1), then times a second generation of --max-tokens over the
prefix-cached prompt: decode only. Outputs with and without the pool should be token-identical (the
target verifies over its whole context either way; GPU kernels of other widths may round a near-tie
differently: reported, not asserted).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(tokenizer, length: int) -> list[int]:
    text = "\n\n".join((ROOT / name).read_text() for name in ("README.md", "DESIGN.md") if (ROOT / name).is_file())
    ids = tokenizer.encode(text, add_special_tokens=False)
    question = tokenizer.encode("\n\nSummarise the design above in one paragraph:\n", add_special_tokens=False)
    body = (ids * (length // max(1, len(ids)) + 1))[:length - len(question)]
    return body + question


def run(args, context: int, pool: int) -> dict:
    from lucebox import LLM, SamplingParams
    llm = LLM(args.model, device=args.device, max_model_len=context + args.max_tokens + 64, max_num_seqs=1,
              draft_kv_pool_tokens=pool,
              speculative_config={"method": "dflash", "model": args.draft, "adaptive": False})
    prop = llm.engine.speculator.proposer
    if prop.pool_tokens != pool:  # an engine that does not pass the flag on yet
        prop.enable_pool(pool)
    prompt = {"prompt_token_ids": prompt_ids(llm.tokenizer, context)}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # prefill, cached
    started = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    seconds = time.perf_counter() - started
    tokens = out.outputs[0].token_ids
    tau = 1 + out.metrics.num_accepted_tokens / max(1, out.metrics.num_drafts)
    return {"context": context, "pool": pool, "tok_s": len(tokens) / seconds, "tau": tau, "tokens": tokens,
            "selections": prop.pool.selections if prop.pool is not None else 0}


def main() -> None:
    from lucebox.default_model import BUNDLED, BUNDLED_DRAFTER
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED))
    p.add_argument("--draft", default=str(BUNDLED_DRAFTER))
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--pool", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    print(f"{'context':>8} {'pool':>6} {'tau':>6} {'tok/s':>9} {'speedup':>8} {'= full':>7}")
    for context in args.contexts:
        full = run(args, context, 0)
        pooled = run(args, context, args.pool)
        for row in (full, pooled):
            row["speedup"] = row["tok_s"] / full["tok_s"]
            row["identical"] = row["tokens"] == full["tokens"]
            print(f"{context:>8} {row['pool']:>6} {row['tau']:>6.2f} {row['tok_s']:>9.1f} {row['speedup']:>7.2f}x "
                  f"{str(row['identical']):>7}")
        rows += [full, pooled]
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=2))


if __name__ == "__main__":
    main()
