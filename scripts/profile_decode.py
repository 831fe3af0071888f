"""Where one decode (or verify) forward's time goes: a random model of a named shape, `--tokens` tokens
at a given context through the runner exactly as `lucebox bench speed` times them (1: a decode row;
more: a verify row with all logits, hybrids keeping each position's DeltaNet stash), timed eagerly
and through a CUDA graph, then a torch.profiler trace of a few eager forwards (top operators by
device time and by host time), a cProfile of the same (Python's own share) and one graph replay.

    python scripts/profile_decode.py --shape qwen3-8b --context 512 [--tokens 16] [--quant bf16]

Run it with LUCEBOX_TRITON=0 as well to see the torch reference path's share; `--device cpu` with a
tiny shape checks the script itself."""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from lucebox.bench import kv_tables, shapes
from lucebox.bench.speed import Clock, bare_forward, engine_args
from lucebox.engine.engine import LLMEngine


def runner_for(loaded, context: int, tokens: int, graphs: bool):
    """An engine sized as the bench sizes it and the forward of `tokens` tokens at `context`; with more
    than one token it keeps verify graph buckets, as a speculating engine does."""
    spec = {"method": "ngram", "num_speculative_tokens": tokens - 1, "adaptive": False} if tokens > 1 else None
    given = argparse.Namespace(cache_type_k="auto", cache_type_v="auto", cuda_graphs=graphs)
    engine = LLMEngine.from_args(engine_args(given, context + 2 * tokens, loaded, speculative_config=spec), loaded)
    tables = kv_tables.allocate(engine, context + tokens, context)
    return engine, bare_forward(engine.runner, list(range(1, tokens + 1)), context, *tables)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1, help="tokens in the forward: 1 = decode, 16 = a verify")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    clock = Clock(device)
    loaded, _ = shapes.load_under_test(None, args.shape, args.quant, "auto", device)
    print(f"{args.shape} {args.quant}, context {args.context}, {args.tokens} token(s), "
          f"LUCEBOX_TRITON={os.environ.get('LUCEBOX_TRITON')}")
    for graphs in (False, True) if on_gpu else (False,):
        engine, forward = runner_for(loaded, args.context, args.tokens, graphs)
        ms = 1e3 * clock.per_call(forward, 20)
        print(f"forward ({'CUDA graph' if graphs else 'eager'}): {ms:.2f} ms")
        if not graphs:
            forward()
            _sync(device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
            with profile(activities=activities) as prof:
                for _ in range(5):
                    forward()
                _sync(device)
            events = prof.key_averages()
            if on_gpu:
                kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 5
                print(f"eager: {kernels:.0f} device kernels per forward; top by device time (5 forwards):")
                print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
            print("top by host time:")
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
            python = cProfile.Profile()  # the host time that no operator accounts for
            python.enable()
            for _ in range(5):
                forward()
            _sync(device)
            python.disable()
            print("Python functions by own time (5 forwards):")
            pstats.Stats(python).sort_stats("tottime").print_stats(args.rows)
        else:
            forward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                forward()
                torch.cuda.synchronize()
            print("one graph replay, top kernels by device time:")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.rows,
                                            max_name_column_width=60))
        del engine


if __name__ == "__main__":
    main()
