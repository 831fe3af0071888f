"""`lucebox bench throughput`: batched decode throughput, KV bytes per token, prefix-cache hit rate.

Output tok/s at several concurrency levels is reported with its ratio to one sequence, measured
in the same run, so the figure says how much continuous batching buys on this machine.
"""
from __future__ import annotations

import json
import random
import time

import torch

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..model.cache_spec import kv_bytes_per_token
from ..model.kv_cache import CACHE_TYPES
from ..model.loader import load_model
from ..sampling import SamplingParams


def _run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    # Time decode only: run until every prompt is prefilled, then count the tokens produced after.
    produced, start = 0, None
    while engine.has_unfinished():
        outs = engine.step()
        if start is None and all(s.num_computed >= len(s.prompt_token_ids) for s in engine.scheduler.running) \
                and not engine.scheduler.waiting:
            _sync(engine)
            start, produced = time.perf_counter(), 0
            continue
        if start is not None:
            produced += len(outs)  # one token per sequence per decode step
    _sync(engine)
    return produced, time.perf_counter() - start


def _sync(engine):
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def multi_turn_hit_rate(engine: LLMEngine, conversations: int, turns: int, rng: random.Random) -> float:
    """Conversations sharing a system prompt; each turn resends the whole history (as chat clients do)."""
    vocab = engine.model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(48)]
    histories = [list(system) for _ in range(conversations)]
    prompt_tokens = cached = 0
    for turn in range(turns):
        for c, history in enumerate(histories):
            history += [rng.randrange(vocab) for _ in range(rng.randint(8, 24))]  # the user's message
            engine.add_request(f"t{turn}-{c}", {"prompt_token_ids": list(history)},
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    c = int(out.request_id.split("-")[1])
                    histories[c] += out.outputs[0].token_ids
                    prompt_tokens += len(out.prompt_token_ids)
                    cached += out.num_cached_tokens
    return cached / prompt_tokens


def run(args) -> dict:
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    engine_args = EngineArgs(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.concurrency),
                             max_model_len=args.prompt_len + args.output_len + 64, enable_prefix_caching=False)
    engine = LLMEngine.from_args(engine_args, loaded)
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    rows = []
    for n in args.concurrency:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(n)]
        _run_batch(engine, prompts[:1], 4)  # warm-up
        tokens, seconds = _run_batch(engine, prompts, args.output_len)
        rows.append({"concurrency": n, "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds})
    base = rows[0]["tok_s"]
    for row in rows:
        row["ratio_to_1"] = row["tok_s"] / base
    cfg, dtype = loaded.config, loaded.model.dtype
    kv = {t: kv_bytes_per_token(loaded.model, t, t) for t in CACHE_TYPES[1:] if _supported(t, cfg.head_dim)}
    cached_engine = LLMEngine.from_args(EngineArgs(model=args.model, dtype=args.dtype, device=args.device,
                                                   max_model_len=2048), loaded)
    hit = multi_turn_hit_rate(cached_engine, conversations=8, turns=4, rng=rng)
    return {"model": args.model, "device": str(loaded.model.device), "dtype": str(dtype).replace("torch.", ""),
            "prompt_len": args.prompt_len, "output_len": args.output_len, "throughput": rows,
            "kv_bytes_per_token": kv, "multi_turn_prefix_hit_rate": hit}


def _supported(cache_type: str, head_dim: int) -> bool:
    return cache_type not in ("q8_0", "q4_0") or head_dim % 32 == 0


def print_report(result: dict) -> None:
    print(f"model {result['model']} on {result['device']} ({result['dtype']}), "
          f"prompt {result['prompt_len']} tokens, {result['output_len']} output tokens per sequence\n")
    print("| concurrent sequences | output tok/s | ratio to 1 |\n|---:|---:|---:|")
    for row in result["throughput"]:
        print(f"| {row['concurrency']} | {row['tok_s']:.1f} | {row['ratio_to_1']:.2f}x |")
    print("\n| KV cache type (K and V) | bytes per token |\n|---|---:|")
    for name, size in result["kv_bytes_per_token"].items():
        print(f"| {name} | {size:,.0f} |")
    print(f"\nprefix-cache hit rate, 8 conversations x 4 turns sharing a system prompt: "
          f"{100 * result['multi_turn_prefix_hit_rate']:.1f}% of prompt tokens")


def main(args) -> int:
    result = run(args)
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
