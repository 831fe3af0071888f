"""`lucebox bench tp`: tensor parallelism on a random --shape, TP=1 against TP=N in one run.

Each size gets its own engine (ranks build their shards from the seed: bench/random_shards.py) and
measures, at batch 1: the TTFT of a --prompt-len prompt, decode tok/s at --context through engine
steps, the runner's forward alone for one token and for a verify of 16 (as `bench speed`), and on
CUDA the collectives' kernel time of a one-token forward on rank 0 (torch.profiler: the NCCL
all-reduces and the LM head's all-gather), and forced-acceptance speculation (bench/forced.py: 15
drafts of the engine's own greedy continuation, the bound on what DFlash can deliver). Scaling is
decode tok/s over TP=1's; its efficiency that over the size. The decode limit of a size is rank 0's bytes a token at the GEMV bandwidth measured
in the same run (every rank reads its shard at once).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..engine.tensor_parallel import launch
from ..errors import RequestError
from ..model.loader import resolve_device, resolve_dtype
from ..sampling import SamplingParams
from . import kv_tables, limits, shapes
from .forced import RecordedContinuationProposer, forced_decoding, greedy_output
from .random_shards import RandomShards
from .spec import decode_runs, median_of
from .speed import VERIFY_TOKENS, Clock, bare_forward, reference, timed_request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, choices=sorted(shapes.SHAPES), help="random weights of this shape")
    p.add_argument("--quant", default="bf16", help="weight storage: bf16 / f16 / f32 or a GGUF mix (q4_k_m, q8_0, ...)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, each its own engine")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of the TTFT row")
    p.add_argument("--context", type=int, default=512, help="context of the decode and verify rows")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens a timed decode")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each row; the median is reported")
    p.add_argument("--dtype", default="auto", help=EngineArgs.HELP["dtype"])
    p.add_argument("--device", default="auto", help="cuda (rank r on cuda:r) or cpu (gloo)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs at every size (default: the engine's, off under tensor parallelism)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def _say(text: str) -> None:
    print(f"[bench tp] {text}", file=sys.stderr, flush=True)


def start(args, size: int, device: torch.device) -> LLMEngine:
    """An engine of `size` ranks over the random shape (size 1: the whole model in this process)."""
    act = None if args.dtype == "auto" else resolve_dtype(args.dtype, None, device)
    # a speculator of 15 drafts whose proposer the measurements swap (forced.py): none, then the recording
    spec = {"method": "ngram", "num_speculative_tokens": VERIFY_TOKENS - 1, "adaptive": False}
    engine_args = EngineArgs(max_model_len=max(args.prompt_len, args.context) + args.decode_tokens + 2 * VERIFY_TOKENS,
                             max_num_seqs=1, enable_prefix_caching=False, device=args.device,
                             tensor_parallel_size=size, cuda_graphs=args.cuda_graphs, speculative_config=spec)
    if size == 1:
        loaded = shapes.build_random_model(args.shape, args.quant, device, act, seed=args.seed)
        return LLMEngine.from_args(replace(engine_args, model=loaded.source), loaded)
    return launch(engine_args, shards=RandomShards(args.shape, args.quant, args.seed, act))


def collective_seconds(step, steps: int) -> float:
    """Device time of the NCCL kernels a call of `step` launches on this rank (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile
    step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower())
    return total / 1e6 / steps


def measure(engine: LLMEngine, args, size: int, clock: Clock, rng: random.Random, ref: dict | None) -> dict:
    model, vocab = engine.model, engine.model.config.vocab_size
    engine.speculator.proposer = RecordedContinuationProposer({})  # no drafts: plain decode steps
    timed_request(engine, clock, [1] * 32, 4)  # first-call costs stay out of every figure
    ttfts, decodes = [], []
    for r in range(args.repeats + 1):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        ttft, *_ = timed_request(engine, clock, prompt, 1)
        prompt = [rng.randrange(vocab) for _ in range(args.context)]
        _, (t0, t1), *_ = timed_request(engine, clock, prompt, 1 + args.decode_tokens)
        if r:  # run 0 warms this length's shapes up
            ttfts.append(ttft)
            decodes.append(args.decode_tokens / (t1 - t0))
    table, windows = kv_tables.allocate(engine, args.context + VERIFY_TOKENS, args.context)
    try:
        one = bare_forward(engine.runner, [1], args.context, table, windows)
        many = bare_forward(engine.runner, list(range(1, VERIFY_TOKENS + 1)), args.context, table, windows)
        calls = 4 * args.repeats
        decode_s, verify_s = clock.per_call(one, calls), clock.per_call(many, calls)
        collective = collective_seconds(one, calls) if size > 1 and clock.cuda else None
    finally:
        kv_tables.free(engine, table, windows)
    prompt = [rng.randrange(vocab) for _ in range(args.context)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    plain = median_of([decode_runs(engine, [prompt], params) for _ in range(args.repeats)])
    forced = forced_decoding(engine, prompt, params, greedy_output(engine, prompt, params), args.repeats)
    forced["speedup"] = forced["tok_s"] / plain["tok_s"]
    per_token = limits.weight_bytes_per_token(model) + limits.state_bytes_per_token(model)
    row = {"size": size, "ttft_s": statistics.median(ttfts), "decode_tok_s": statistics.median(decodes),
           "decode_forward_s": decode_s, "verify_forward_s": verify_s, "verify_ratio": verify_s / decode_s,
           "collective_s": collective, "rank0_weight_bytes_per_token": per_token, "forced": forced}
    row["prefill_tok_s"] = args.prompt_len / row["ttft_s"]
    if ref:
        row["decode_limit_tok_s"] = ref["gemv_gb_s"] * 1e9 / per_token
    return row


def run(args: argparse.Namespace) -> dict:
    if args.sizes[0] != 1 or min(args.sizes) < 1 or args.repeats < 1 or args.decode_tokens < 2:
        raise RequestError("--sizes starts with 1 (the baseline) and lists positive sizes; --repeats >= 1, "
                           "--decode-tokens >= 2")
    device = resolve_device(args.device)
    clock, rng = Clock(device), random.Random(args.seed)
    result = {"meta": shapes.run_metadata(args, device), "shape": args.shape, "quant": args.quant, "rows": []}
    ref = result["reference"] = reference(device, clock) if device.type == "cuda" else None
    for size in args.sizes:
        _say(f"TP={size}: building the engine")
        engine = start(args, size, device)
        try:
            result["rows"].append(row := measure(engine, args, size, clock, rng, ref))
        finally:
            engine.shutdown()
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        _say(f"TP={size}: decode {row['decode_tok_s']:,.1f} tok/s, TTFT {1e3 * row['ttft_s']:.1f} ms")
    base = result["rows"][0]["decode_tok_s"]
    for row in result["rows"]:
        row["decode_speedup"] = row["decode_tok_s"] / base
        row["efficiency"] = row["decode_speedup"] / row["size"]
    return result


def print_report(result: dict) -> None:
    print(f"random {result['shape']} ({result['quant']}) on {result['meta']['device']}")
    print("| TP | prefill tok/s (TTFT) | decode tok/s | x TP=1 (efficiency) | decode limit | forward 1 / 16 tokens "
          "| verify / decode | collectives a step | forced speculation (15 drafts) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in result["rows"]:
        f = r["forced"]
        limit = f"{r['decode_limit_tok_s']:,.0f}" if "decode_limit_tok_s" in r else "-"
        coll = (f"{1e3 * r['collective_s']:.3f} ms ({100 * r['collective_s'] / r['decode_forward_s']:.0f}%)"
                if r["collective_s"] is not None else "-")
        print(f"| {r['size']} | {r['prefill_tok_s']:,.0f} ({1e3 * r['ttft_s']:.1f} ms) | {r['decode_tok_s']:,.1f} | "
              f"{r['decode_speedup']:.2f}x ({100 * r['efficiency']:.0f}%) | {limit} | "
              f"{1e3 * r['decode_forward_s']:.2f} / {1e3 * r['verify_forward_s']:.2f} ms | {r['verify_ratio']:.2f}x | "
              f"{coll} | {f['tok_s']:,.1f} tok/s, tau {f['tau']:.2f}, {f['speedup']:.2f}x |")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        _say(f"wrote {args.json}")
    return 0
