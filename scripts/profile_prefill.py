"""Where one short prefill's time goes (issue 33: "profile first" for the fixed 30-100 ms a short prefill
costs): a random model of a named shape, a prompt of --tokens new tokens (on top of a cached prefix of
--prefix-len tokens, served from the prefix cache) taken through LLMEngine.step exactly as a request runs,
profiled with torch.profiler from add_request to its first token. Prints the top operators by device
time and by host time, and the host-device syncs of the step: CUDA synchronisations and device-to-host
copies the profiler saw, and every Tensor.item / .tolist / .cpu / .numpy / bool() call by call site.

    python scripts/profile_prefill.py --shape qwen3-8b --quant q4_k_m --tokens 256 --prefix-len 16384

`--device cpu --shape tiny` checks the script itself (no device syncs there, the Python calls still count)."""
from __future__ import annotations

import argparse
import collections
import contextlib
import random
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lucebox.bench import prefix, shapes
from lucebox.bench.speed import Clock, default_args, engine_args

# Host calls that wait for the device (on CUDA); counted by call site in the profiled step.
SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
# Profiler events that are a host wait: CUDA runtime syncs and .item()'s op (bool(), int() too) ...
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
# ... and the runtime's copies (device-to-host ones wait; host-to-device ones from pinned memory do not).
COPY_EVENTS = ("cudaMemcpy",)


@contextlib.contextmanager
def count_syncing_calls(counts: collections.Counter):
    """Count calls of SYNCING_METHODS on tensors by their caller's file:line, while the block runs."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in SYNCING_METHODS}

    def counting(name: str, method):
        def call(self, *a, **k):
            caller = sys._getframe(1)
            where = Path(caller.f_code.co_filename)
            site = "/".join(where.parts[-3:]) if "lucebox" in where.parts else where.name
            counts[f"Tensor.{name} at {site}:{caller.f_lineno} ({caller.f_code.co_name})"] += 1
            return method(self, *a, **k)
        return call
    try:
        for name in SYNCING_METHODS:
            setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        yield counts
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--tokens", type=int, default=256, help="new prompt tokens of the profiled prefill")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of a cached prefix under them (0: a fresh prompt)")
    p.add_argument("--rows", type=int, default=20, help="operators per table")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    clock, rng = Clock(device), random.Random(0)
    loaded, _ = shapes.load_under_test(None, args.shape, args.quant, "auto", device)
    given = default_args(shape=args.shape, quant=args.quant, device=args.device)
    engine = prefix.prefix_engine(loaded, given, engine_args, [args.prefix_len], [args.tokens])
    vocab = loaded.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def prefill_once(profiled: bool):
        head = tokens(args.prefix_len)
        if head:  # the prefix goes into the cache first, untimed
            prefix.first_token(engine, clock, head)
        if not profiled:
            return prefix.first_token(engine, clock, head + tokens(args.tokens))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        calls = collections.Counter()
        with profile(activities=activities) as prof, count_syncing_calls(calls):
            ttft, cached = prefix.first_token(engine, clock, head + tokens(args.tokens))
        return ttft, cached, prof, calls
    for _ in range(2):  # kernel compilation and first-call costs stay out of the profile
        prefill_once(profiled=False)
    plain, _ = prefill_once(profiled=False)
    ttft, cached, prof, calls = prefill_once(profiled=True)
    print(f"{args.shape} {args.quant} on {device}: {args.tokens} new tokens on a {args.prefix_len}-token prefix "
          f"({cached} served from the prefix cache); TTFT {1e3 * plain:.2f} ms unprofiled, "
          f"{1e3 * ttft:.2f} ms profiled")
    events = prof.key_averages()
    if on_gpu:
        print("\ntop operators by device time (one prefill, add_request to first token):")
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    print("\ntop operators by host time:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    for label, names in (("host-device syncs", SYNC_EVENTS), ("runtime copies", COPY_EVENTS)):
        seen = {e.key: e.count for e in events if e.key.startswith(names)}
        print(f"{label} in the step (profiler events): "
              + (", ".join(f"{k} x{v}" for k, v in sorted(seen.items())) or "none seen"))
    print(f"syncing tensor calls (item / tolist / cpu / numpy / bool / int / float): {sum(calls.values())} in all")
    for site, n in calls.most_common(args.rows):
        print(f"  {n:5d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
