"""Tree verify attention on the GPU: what the tree mask costs, and a tree verify against a decode.

For each context length and batch, times the Triton paged-attention kernel on:
  decode        1 query per sequence (the baseline: ratio 1.0)
  chain N       N queries per sequence, plain causal (no tree_mask)
  tree N        N queries per sequence, a random DFS-ordered tree of N nodes (tree_mask set)
and checks each output against the torch reference. The tree rows differ from the chain rows
only by the mask, so `tree N / chain N` is the mask's price and `tree N / decode` the attention
part of issue 28's bound (a 32-node verify within 1.6x a decode step, whole model).

    python scripts/bench_tree_attention.py                     # qwen3-8b geometry, bf16 KV
    python scripts/bench_tree_attention.py --cache-types bf16 q8_0 --json out.json
    python scripts/bench_tree_attention.py --smoke             # CPU + Triton interpreter, tiny
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from kernel_timing import bench  # noqa: E402
from lucebox.kernels import triton_paged_attention as tpa  # noqa: E402
from lucebox.kernels.attention import paged_attention_reference  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402
from lucebox.model.kv_cache import PagedKVCache  # noqa: E402

GEOMETRY = {"qwen3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "smoke": (4, 2, 32)}


def random_tree(n: int, rng: random.Random) -> list[int]:
    """Parents of a random tree in DFS order: each node hangs off a node of the current path."""
    parents, path = [-1], [0]
    for i in range(1, n):
        del path[rng.randint(1, len(path)):]
        parents.append(path[-1])
        path.append(i)
    return parents


def case(geometry, ctx: int, q_len: int, batch: int, tree: bool, cache_type: str, dtype, device, block_size=16):
    heads, kv_heads, head_dim = geometry
    per_seq = -(-(ctx + q_len) // block_size)
    blocks = per_seq * batch
    caches = [PagedKVCache(blocks, block_size, kv_heads, head_dim, cache_type, dtype, device) for _ in range(2)]
    for cache in caches:
        slots = torch.arange(blocks * block_size, device=device)
        for chunk in slots.split(1 << 16):
            cache.write(torch.randn(chunk.numel(), kv_heads, head_dim, device=device, dtype=dtype), chunk)
    perm = torch.randperm(blocks).tolist()  # scattered pages, as after a while of serving
    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    rng = random.Random(ctx * 131 + q_len)
    parents = [random_tree(q_len, rng) for _ in range(batch)] if tree else None
    fb = ForwardBatch.build([[0] * q_len] * batch, [ctx] * batch, tables, block_size, device, tree_parents=parents)
    q = torch.randn(batch * q_len, heads, head_dim, device=device, dtype=dtype)
    return q, caches[0], caches[1], fb


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=[g for g in GEOMETRY if g != "smoke"])
    p.add_argument("--cache-types", nargs="+", default=["bf16"])
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 4096, 32768])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--nodes", nargs="+", type=int, default=[16, 22, 32, 64])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = p.parse_args()
    if SMOKE:
        device, geometry, dtype = torch.device("cpu"), GEOMETRY["smoke"], torch.float32
        args.contexts, args.batches, args.nodes, args.cache_types = [40], [2], [5], ["f32"]
    elif not torch.cuda.is_available():
        sys.exit("bench_tree_attention.py needs a GPU (or --smoke to check the script on the CPU)")
    else:
        device, geometry, dtype = torch.device("cuda"), GEOMETRY[args.shape], torch.bfloat16
    torch.manual_seed(0)
    heads, _, head_dim = geometry
    scale = head_dim ** -0.5
    rows = []
    for cache_type in args.cache_types:
        for ctx in args.contexts:
            for batch in args.batches:
                base = None
                for kind, q_len in [("decode", 1)] + [(k, n) for n in args.nodes for k in ("chain", "tree")]:
                    q, kc, vc, fb = case(geometry, ctx, q_len, batch, kind == "tree", cache_type, dtype, device)
                    out = tpa.paged_attention(q, kc, vc, fb, scale)
                    err = None
                    if ctx <= 4096:
                        err = (out.float() - paged_attention_reference(q, kc, vc, fb, scale).float()).abs().max().item()
                    us = bench(lambda: tpa.paged_attention(q, kc, vc, fb, scale), device) * 1e3
                    base = us if kind == "decode" else base
                    rows.append({"cache": cache_type, "ctx": ctx, "batch": batch, "rows": kind, "q_len": q_len,
                                 "us": round(us, 2), "vs_decode": round(us / base, 3),
                                 "abs_err": None if err is None else f"{err:.2g}"})
                    del q, kc, vc, fb
    keys = list(rows[0])
    print(f"# tree verify attention, {args.shape if not SMOKE else 'smoke'} (heads {heads}, head_dim {head_dim})\n")
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join("" if r[k] is None else str(r[k]) for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
