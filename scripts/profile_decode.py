"""Where one decode forward's time goes: a random model of a named shape, one token at a given
context through the runner, timed eagerly and through a CUDA graph, then a torch.profiler trace
of a few eager forwards (top operators by device time and by host time), a cProfile of the same
(Python's own share) and one graph replay.

    python scripts/profile_decode.py --shape qwen3-8b --context 512 [--quant bf16] [--rows 25]

Run it with LUCEBOX_TRITON=0 as well to see the torch reference path's share."""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from lucebox.bench import shapes
from lucebox.bench.speed import Clock
from lucebox.config import EngineArgs
from lucebox.engine.engine import LLMEngine
from lucebox.model.cache_spec import kv_bytes_per_token


def runner_for(loaded, context: int, graphs: bool):
    per_token = kv_bytes_per_token(loaded.model, "auto", "auto")
    tokens = (context // EngineArgs.block_size + 4) * EngineArgs.block_size
    engine = LLMEngine.from_args(EngineArgs(model=loaded.source, max_model_len=context + 64, max_num_seqs=1,
                                            enable_prefix_caching=False, cuda_graphs=graphs,
                                            kv_cache_memory=per_token * tokens), loaded)
    table: list[int] = []
    engine.scheduler.blocks.allocate(table, context + 1)
    return engine, (lambda: engine.runner.forward([[1]], [context], [table]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda")
    clock = Clock(device)
    loaded, _ = shapes.load_under_test(None, args.shape, args.quant, "auto", device)
    print(f"{args.shape} {args.quant}, context {args.context}, LUCEBOX_TRITON={os.environ.get('LUCEBOX_TRITON')}")
    for graphs in (False, True):
        engine, forward = runner_for(loaded, args.context, graphs)
        ms = 1e3 * clock.per_call(forward, 20)
        print(f"forward ({'CUDA graph' if graphs else 'eager'}): {ms:.2f} ms")
        if not graphs:
            forward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    forward()
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 5
            print(f"eager: {kernels:.0f} device kernels per forward; top by device time (5 forwards):")
            print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
            print("top by host time:")
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
            python = cProfile.Profile()  # the host time that no operator accounts for
            python.enable()
            for _ in range(5):
                forward()
            torch.cuda.synchronize()
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
