"""A DFlash draft block's attention over its context: SDPA (the path at or below SPLIT_KEYS_ABOVE keys)
against split_key_attention (above it) at each context length, timed through CUDA graph replays as the
draft graphs run them, per layer call. Checks the two agree; the fastest split of each length and where
SDPA stops winning say whether SPLIT_KEYS_ABOVE and KEY_SPLIT (lucebox/spec/draft_attention.py) are right.

    python scripts/bench_draft_attention.py                  # qwen3-8b geometry, bf16, 16 queries
    python scripts/bench_draft_attention.py --contexts 4096 65536 --splits 8192 32768 --json out.json
    python scripts/bench_draft_attention.py --device cpu --contexts 512 2048 --repeats 2   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lucebox.spec import draft_attention  # noqa: E402


def sdpa(q, keys, values, mask, scale):
    groups = q.shape[0] // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(groups, 0)
    v = values.transpose(0, 1).repeat_interleave(groups, 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def split(size: int, queries: int):
    """The key slices as a draft pass runs them: the context's slices, then the block's own K/V."""
    def attend(q, keys, values, mask, scale):
        saved, draft_attention.KEY_SPLIT = draft_attention.KEY_SPLIT, size
        try:
            parts = draft_attention.key_slices((keys[:-queries], values[:-queries]), keys[-queries:],
                                               values[-queries:], mask)
            return draft_attention.split_key_attention(q, parts, scale).to(q.dtype)
        finally:
            draft_attention.KEY_SPLIT = saved
    return attend


def timed_ms(fn, args, repeats: int, device: torch.device) -> float:
    """Milliseconds a call: CUDA graph replays on a GPU (what a draft graph does), plain calls on the CPU."""
    if device.type != "cuda":
        fn(*args)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(*args)
        return 1e3 * (time.perf_counter() - start) / repeats
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384, 32768, 131072, 262144])
    p.add_argument("--splits", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=16, help="the draft block")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    print(f"draft attention, {args.heads} heads / {args.kv_heads} K/V heads x {args.head_dim}, {args.queries} "
          f"queries, {dtype}, {device}; SPLIT_KEYS_ABOVE = {draft_attention.SPLIT_KEYS_ABOVE}, "
          f"KEY_SPLIT = {draft_attention.KEY_SPLIT}")
    print("| keys | path | ms a layer | K/V GB/s | max abs diff vs SDPA |")
    print("|---:|---|---:|---:|---:|")
    for m in args.contexts:
        q = torch.randn(args.heads, args.queries, args.head_dim, device=device, dtype=dtype, generator=g)
        keys, values = (torch.randn(m, args.kv_heads, args.head_dim, device=device, dtype=dtype, generator=g)
                        for _ in range(2))
        mask = torch.ones(args.queries, m, dtype=torch.bool, device=device)
        mask[:, m - m // 8:m - args.queries] = False  # a bucket's padding columns past the context
        scale = args.head_dim ** -0.5
        want = sdpa(q, keys, values, mask, scale).float()
        kv_bytes = 2 * keys.numel() * keys.element_size()
        for name, fn in [("sdpa", sdpa)] + [(f"split {s}", split(s, args.queries)) for s in args.splits]:
            diff = (fn(q, keys, values, mask, scale).float() - want).abs().max().item()
            ms = timed_ms(fn, (q, keys, values, mask, scale), args.repeats, device)
            rows.append({"keys": m, "path": name, "ms": ms, "kv_gb_s": kv_bytes / ms / 1e6, "max_abs_diff": diff})
            print(f"| {m:,} | {name} | {ms:.3f} | {kv_bytes / ms / 1e6:,.1f} | {diff:.2e} |", flush=True)
        del q, keys, values, mask, want
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
