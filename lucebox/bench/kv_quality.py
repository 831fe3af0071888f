"""`lucebox bench kv-quality`: what each KV cache type costs in quality, against the model dtype.

Two measures on held-out text (bench/prompts.py: held-out Python standard-library source):
greedy agreement (the fraction of each continuation generated before the first token that differs
from the unquantised cache's) and perplexity with the quantised cache, teacher-forced.
"""
from __future__ import annotations

import math

import torch

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..model.cache_spec import kv_bytes_per_token
from ..model.loader import load_model
from ..sampling import SamplingParams
from . import kv_tables
from .prompts import held_out_texts

VARIANTS = [("bf16", False), ("fp8", False), ("q8_0", False), ("q8_0", True), ("q4_0", False), ("q4_0", True)]


def perplexity(engine: LLMEngine, sequences: list[list[int]]) -> float:
    """Teacher-forced perplexity through the engine's runner and KV pools, in chunks of a prefill step
    (every KV cache group's table: sliding-window groups hold only their window, bench/kv_tables.py)."""
    nll, count = 0.0, 0
    chunk = min(engine.args.max_num_batched_tokens, engine.max_model_len)
    for ids in sequences:
        logits = kv_tables.all_logits(engine, ids, chunk)
        logp = torch.log_softmax(logits[:-1].float(), -1)
        target = torch.tensor(ids[1:], device=logp.device)
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += len(ids) - 1
    return math.exp(nll / count)


def run(args) -> list[dict]:
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    texts = held_out_texts(args.samples, args.chars)
    ids = [loaded.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    prompts = [{"prompt_token_ids": x[: len(x) // 2]} for x in ids]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def engine_for(cache_type, rotate):
        max_len = max(map(len, ids)) + args.new_tokens + 8
        return LLMEngine.from_args(EngineArgs(model=args.model, cache_type_k=cache_type, cache_type_v=cache_type,
                                              cache_rotate_k=rotate, max_model_len=max_len,
                                              enable_prefix_caching=False), loaded)

    def generate(engine):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[str(i)] for i in range(len(prompts))]

    base_engine = engine_for("auto", False)
    base_tokens, base_ppl = generate(base_engine), perplexity(base_engine, ids)
    rows = [{"cache": base_engine.runner.cache_types[0] + " (model dtype)", "bytes_per_token":
             kv_bytes_per_token(loaded.model), "greedy_agreement": 1.0, "perplexity": base_ppl}]
    for cache_type, rotate in VARIANTS:
        engine = engine_for(cache_type, rotate)
        if engine.runner.cache_types[0] == rows[0]["cache"].split()[0]:
            continue
        tokens = generate(engine)
        agreement = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) / len(x)
                     for x, y in zip(base_tokens, tokens)]
        rows.append({"cache": cache_type + (" + Hadamard K" if rotate else ""),
                     "bytes_per_token": kv_bytes_per_token(loaded.model, cache_type, cache_type),
                     "greedy_agreement": sum(agreement) / len(agreement), "perplexity": perplexity(engine, ids)})
    for row in rows:
        row["perplexity_delta_pct"] = 100 * (row["perplexity"] / base_ppl - 1)
    return rows


def main(args) -> int:
    rows = run(args)
    print(f"model {args.model}; {args.samples} held-out snippets of {args.chars} chars; "
          f"greedy continuations of {args.new_tokens} tokens\n")
    print("| KV cache (K and V) | bytes/token | greedy agreement | perplexity | delta |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cache']} | {r['bytes_per_token']:,} | {100 * r['greedy_agreement']:.1f}% | "
              f"{r['perplexity']:.3f} | {r['perplexity_delta_pct']:+.2f}% |")
    return 0
