"""Flags the shape benches share (speed, throughput, kv-pool): what to measure and how its KV and output look."""
from __future__ import annotations

import argparse

from ..config import EngineArgs
from . import shapes


def add_model_flags(p: argparse.ArgumentParser, shape_default: str = "") -> None:
    """--model / --shape / --quant / --dtype / --device; shape_default: what runs without --model or --shape."""
    p.add_argument("--model", default=None, help="checkpoint to measure (default: --shape, else "
                                                 f"{shape_default or 'the default model'})")
    p.add_argument("--shape", default=None, help=f"random weights of a named shape: {', '.join(shapes.SHAPES)}")
    p.add_argument("--quant", default=None, help=f"weights of --shape: {', '.join(shapes.QUANTS)} (default bf16)")
    p.add_argument("--dtype", default="auto", help=EngineArgs.HELP["dtype"])
    p.add_argument("--device", default="auto", help=EngineArgs.HELP["device"])


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """--cache-type-k / -v, --enforce-eager, --seed and --json."""
    p.add_argument("--cache-type-k", default="auto", help=EngineArgs.HELP["cache_type_k"])
    p.add_argument("--cache-type-v", default="auto", help=EngineArgs.HELP["cache_type_v"])
    p.add_argument("--enforce-eager", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help=EngineArgs.HELP["enforce_eager"])
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--json", default=None, help="also write every figure and the run's metadata to this JSON file")
