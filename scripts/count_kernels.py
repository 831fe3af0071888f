"""How many kernels one decode (or verify) forward launches, and from where, without a GPU.

    python scripts/count_kernels.py --shape qwen3.6-35b-a3b --quant q4_k_m   # a small model of that shape's
    python scripts/count_kernels.py --shape qwen3-8b --tokens 16             # layer pattern; a verify row

A small-step decode on a fast GPU is often bound by its kernel count (each costs launch and drain,
a few microseconds, even in a CUDA graph) rather than by its bytes. This builds a model with the
named shape's layer pattern but small dimensions and a few layers (the count per layer does not
depend on them), routes every op as on a GPU (Triton kernels on), records each Triton launch
instead of running it, and lists the torch ops that would be device kernels, by call site. The
numbers are structural: per forward, per layer pattern; times need the GPU (scripts/profile_decode.py).
"""
from __future__ import annotations

import argparse
import collections
import os
import traceback

os.environ.setdefault("LUCEBOX_TRITON", "1")

import torch  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lucebox.bench import shapes  # noqa: E402
from lucebox.kernels import dispatch  # noqa: E402

# Ops that make no device kernel: views, allocations and host-side bookkeeping.
NO_KERNEL = {"view", "as_strided", "reshape", "expand", "unsqueeze", "slice", "select", "detach", "detach_", "alias",
             "t", "transpose", "squeeze", "permute", "_reshape_alias", "split", "split_with_sizes", "unbind", "narrow",
             "chunk", "empty", "empty_like", "new_empty", "empty_strided", "_unsafe_view", "lift_fresh",
             "promote_types", "result_type", "is_nonzero", "item", "_local_scalar_dense", "size", "stride", "dim"}


def small(shape: str, layers: int) -> dict:
    """The shape's config with small dimensions and `layers` layers (its per-layer pattern kept)."""
    full = shapes.SHAPES[shape]
    cfg = dict(full, num_hidden_layers=layers, vocab_size=1024, hidden_size=256,
               num_attention_heads=4, num_key_value_heads=2)
    for key, value in full.items():  # per-layer lists (layer_types, ...): their first `layers` entries
        if isinstance(value, list) and len(value) == full.get("num_hidden_layers"):
            cfg[key] = value[:layers]
    if "intermediate_size" in cfg:
        cfg["intermediate_size"] = 512
    if "num_experts" in cfg:
        cfg.update(num_experts=16, moe_intermediate_size=256)
        if "shared_expert_intermediate_size" in cfg:
            cfg["shared_expert_intermediate_size"] = 256
    if "linear_num_key_heads" in cfg:
        cfg.update(linear_num_key_heads=2, linear_num_value_heads=4, head_dim=64)
    return cfg


class Sites(TorchDispatchMode):
    """Counts the torch ops that would be device kernels, by op and by lucebox call site."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in NO_KERNEL or name == "to" and out is args[0]:  # a .to() that changes nothing
            return out
        frames = [f for f in traceback.extract_stack() if "/lucebox/" in f.filename]
        where = f"{frames[-1].filename.split('/lucebox/')[-1]}:{frames[-1].lineno}" if frames else "?"
        self.sites[name, where] += 1
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-35b-a3b", choices=[s for s in shapes.SHAPES if s != "tiny"])
    p.add_argument("--quant", default="q4_k_m")
    p.add_argument("--layers", type=int, default=4, help="layers of the small model (hybrids: 3 DeltaNet to 1 attention)")
    p.add_argument("--tokens", type=int, default=1, help="1: a decode row; more: a verify row")
    p.add_argument("--callers", action="store_true", help="also list the Triton launches by model call site")
    args = p.parse_args()
    import profile_decode  # scripts/: the forward exactly as bench speed times it

    dispatch._current_choice = lambda: (True, True)  # route as on a GPU (every launch below is recorded only)
    launches: collections.Counter = collections.Counter()
    callers: collections.Counter = collections.Counter()

    def record(name: str) -> None:
        launches.update([name])
        if args.callers:  # the innermost frame of the model's code
            frames = [f for f in traceback.extract_stack() if "/lucebox/model/" in f.filename]
            where = f"{frames[-1].filename.split('/lucebox/')[-1]}:{frames[-1].lineno}" if frames else "?"
            callers[name, where] += 1

    jit.JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: record(self.fn.__name__))
    shapes.SHAPES["count-kernels"] = small(args.shape, args.layers)
    loaded, _ = shapes.load_under_test(None, "count-kernels", args.quant, "auto", torch.device("cpu"))
    _, forward = profile_decode.runner_for(loaded, 64, args.tokens, False)
    forward()
    launches.clear()
    callers.clear()
    with Sites() as mode:
        forward()
    torch_ops = sum(mode.sites.values())
    print(f"{args.shape} ({args.layers} layers, small dimensions) {args.quant}, {args.tokens} token(s): "
          f"{sum(launches.values())} Triton launches + {torch_ops} torch kernels a forward")
    print("\nTriton kernels:")
    for name, n in launches.most_common():
        print(f"{n:5d}  {name}")
    if args.callers:
        print("\nTriton launches by model call site:")
        for (name, where), n in sorted(callers.items(), key=lambda kv: kv[0][1]):
            print(f"{n:5d}  {name:28s} {where}")
    print("\ntorch ops by call site:")
    for (name, where), n in sorted(mode.sites.items(), key=lambda kv: kv[0][1]):
        print(f"{n:5d}  {name:20s} {where}")


if __name__ == "__main__":
    main()
