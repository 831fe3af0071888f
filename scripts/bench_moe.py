#!/usr/bin/env python
"""Time the MoE expert products (kernels/triton_moe.py) on the GPU against the bytes of the routed
experts they must read, and against the torch path they replace.

    python scripts/bench_moe.py                                  # both shapes, bf16 Q4_K Q8_0 IQ4_XS, 1 2 16 4096 tokens
    python scripts/bench_moe.py --shapes qwen3.6-35b-a3b --qtypes bf16 --tokens 1 16
    python scripts/bench_moe.py --json out.json
    python scripts/bench_moe.py --sweep --shapes qwen3.6-35b-a3b --qtypes Q4_K --tokens 1 4096   # launch configs
    python scripts/bench_moe.py --smoke                          # CPU, Triton interpreter, tiny shapes: the script runs
    python scripts/bench_moe.py --compile-only [--arch 90]       # no GPU needed: compile every kernel variant

Each row is one (shape, weights, tokens) with random routes (top-k distinct experts a token, uniform):
  routed   the kernel routing.py picks (pairs up to MOE_PAIRS_MAX_TOKENS tokens, else grouped)
  pairs / grouped   both kernels at 1, 2 and 16 tokens (where the threshold between them is chosen)
  old      Experts' torch path: gathered routed matrices + bmm under a CUDA graph (decode/verify as the
           engine ran them), the per-expert loop with its host sync at 4096 tokens (eager)
Decode and verify sizes replay from one CUDA graph over several route sets (so one call's experts
are out of L2 when the next call runs, as across a model's layers). GB/s counts each routed expert
once (gate_up + down bytes, plus activations in and out), as a share of --peak-gbps; prefill rows
also give TFLOP/s (6 * tokens * top_k * hidden * inter). Each result is checked against the old path
(check=ok within 3e-2 relative). The first run compiles ~45 kernel variants (Triton caches them: a
second run in the same machine session is quicker); --qtypes / --tokens narrow a run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from kernel_timing import bench_in_graph  # noqa: E402
from lucebox.kernels import moe as kmoe  # noqa: E402
from lucebox.kernels import routing  # noqa: E402
from lucebox.model.moe import Experts  # noqa: E402
from lucebox.weights.quant import QuantTensor  # noqa: E402

SHAPES = {  # (hidden, experts, top_k, moe_intermediate)
    "qwen3.6-35b-a3b": (2048, 256, 8, 512),
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "smoke": (256, 6, 2, 256),
}
# Byte offsets of the fp16 scale fields in one block; random bytes there could be Inf/NaN.
FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.IQ4_NL: [0],
               Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_XS: [0]}
L2_BYTES = 50 << 20  # the H200's L2: route sets cycle until this is well exceeded


def random_quant(qtype, shape: tuple[int, int, int], device, seed: int) -> QuantTensor:
    experts, n, k = shape
    block, size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (experts * n * (k // block), size), dtype=torch.uint8, device=device, generator=g)
    for off in FP16_FIELDS[qtype]:
        scale = (torch.rand(raw.shape[0], 1, device=device, generator=g) * 0.02 - 0.01).half()
        raw[:, off:off + 2] = scale.view(torch.uint8)
    return QuantTensor(raw.reshape(experts * n, -1), qtype, shape)


def make_experts(shape, wtype: str, device) -> Experts:
    hidden, experts, _, inter = shape
    module = Experts(experts, hidden, inter)
    if wtype == "bf16":
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.02)
        return module.to(device, torch.bfloat16)
    qtype = Q[wtype]
    gate_up = random_quant(qtype, (experts, 2 * inter, hidden), device, 1)
    down = random_quant(qtype, (experts, hidden, inter), device, 2)
    del module.gate_up_proj, module.down_proj
    module.gate_up_proj, module.down_proj = gate_up, down
    return module


def expert_bytes(module: Experts) -> int:
    """Bytes of one expert's gate_up and down weights."""
    total = 0
    for w in (module.gate_up_proj, module.down_proj):
        data = w if isinstance(w, torch.Tensor) else w.data
        total += data.numel() * data.element_size() // module.num_experts
    return total


def route_sets(tokens: int, experts: int, top_k: int, count: int, device) -> list:
    g = torch.Generator(device=device).manual_seed(tokens)
    sets = []
    for _ in range(count):
        ids = torch.rand(tokens, experts, device=device, generator=g).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device=device, generator=g)
        sets.append((ids, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)))
    return sets


def time_calls(fn, operands: list, device, graph: bool) -> float:
    """Milliseconds per fn(operand), cycling through the operands: replayed from one CUDA graph
    (kernel_timing.bench_in_graph), or eagerly (fn syncs with the host)."""
    if graph or device.type != "cuda":
        return bench_in_graph(fn, operands, device)
    for o in operands:  # compile and warm up
        fn(o)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(1, min(20, int(200 / max(1e-3, _eager_ms(fn, operands[0])))))
    start.record()
    for _ in range(reps):
        for o in operands:
            fn(o)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (reps * len(operands))


def _eager_ms(fn, operand) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(operand)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def bench_case(name, shape, wtype, module, tokens, args, device) -> list:
    hidden, experts, top_k, inter = shape
    per_expert = expert_bytes(module)
    count = 1 if tokens > 64 else max(2, min(32, -(-4 * L2_BYTES // (per_expert * min(experts, tokens * top_k)))))
    if device.type != "cuda":
        count = 1
    sets = route_sets(tokens, experts, top_k, count, device)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    routed = sum(torch.unique(ids).numel() for ids, _ in sets) / count
    nbytes = routed * per_expert + 2 * x.numel() * x.element_size()
    flops = 6 * tokens * top_k * hidden * inter
    gate_up, down = module.gate_up_proj, module.down_proj
    kernel = routing.moe_kernel(tokens, True)
    kernels = {"routed": kernel}
    if tokens <= 16:
        kernels |= {"pairs": routing.MOE_PAIRS, "grouped": routing.MOE_GROUPED}
    with torch.no_grad():
        os.environ["LUCEBOX_TRITON"] = "0"
        old = module(x, *sets[0])
        os.environ.pop("LUCEBOX_TRITON")
        rows = []
        for label, which in kernels.items():
            err = rel_err(kmoe.expert_matmul(x, *sets[0], gate_up, down, which), old)
            ms = time_calls(lambda s, which=which: kmoe.expert_matmul(x, *s, gate_up, down, which), sets, device,
                            graph=True)
            rows.append({"shape": name, "weights": wtype, "tokens": tokens, "kernel": f"{label}:{which}",
                         "ms": ms, "GBps": nbytes / ms / 1e6, "pct_peak": 100 * nbytes / ms / 1e6 / args.peak_gbps,
                         "TFLOPs": flops / ms / 1e9, "rel_err": err, "check": "ok" if err <= 3e-2 else "WRONG",
                         "experts_read": routed})
        if args.sweep:
            rows += sweep(x, sets, gate_up, down, tokens, nbytes, old, device, args,
                          {"shape": name, "weights": wtype, "tokens": tokens})
        if not args.no_old:
            os.environ["LUCEBOX_TRITON"] = "0"
            label = "old:gathered" if tokens <= 64 else "old:grouped(eager)"  # beyond, the host-synced loop
            try:
                ms = time_calls(lambda s: module(x, *s), sets, device, graph=tokens <= 64)
            except Exception as e:  # not capturable (e.g. the reference dequantiser copies a table from the host)
                print(f"    old path in a CUDA graph: {type(e).__name__}; timed eagerly")
                torch.cuda.synchronize()
                ms, label = time_calls(lambda s: module(x, *s), sets, device, graph=False), label + "(eager)"
            rows.append({"shape": name, "weights": wtype, "tokens": tokens, "kernel": label, "ms": ms,
                         "GBps": nbytes / ms / 1e6, "pct_peak": 100 * nbytes / ms / 1e6 / args.peak_gbps,
                         "TFLOPs": flops / ms / 1e9, "rel_err": 0.0, "experts_read": routed})
        os.environ.pop("LUCEBOX_TRITON", None)
    return rows


def sweep(x, sets, gate_up, down, tokens, nbytes, old, device, args, where: dict) -> list:
    """Launch configs of the kernels this size runs (pairs up to 16 tokens, grouped from 2): the
    fastest of each kernel, checked against the old path first."""
    from lucebox.kernels import triton_moe as tm

    stacks = kmoe.stacked(gate_up), kmoe.stacked(down)
    floats = stacks[0].fmt == tm.FLOAT
    grids = []
    if tokens <= 16:
        grids.append(("pairs", tm.pairs_experts,
                      [{"block_n": bn, "num_warps": w, "plane": pl, "split_k": sk}
                       for bn in (16, 32, 64) for w in (4, 8) for pl in ((64, 128, 256) if floats else (0,))
                       for sk in (None, 1)]))
    if tokens > 1:
        grids.append(("grouped", tm.grouped_experts,
                      [{"block_n": bn, "block_m": bm, "num_warps": w, "num_stages": st, "plane": pl}
                       for bn in (32, 64, 128) for bm in ((16, 32) if tokens <= 64 else (32, 64))
                       for w in (4, 8) for st in (2, 3, 4) for pl in ((32, 64) if floats else (0,))]))
    rows = []
    for label, run, configs in grids:
        best = None
        for config in configs:
            config = {k: v for k, v in config.items() if v or k == "split_k"}
            try:
                err = rel_err(run(x, *sets[0], *stacks, **config), old)
                ms = time_calls(lambda s, config=config: run(x, *s, *stacks, **config), sets, device, graph=True)
            except Exception as e:  # e.g. out of shared memory: that config cannot run here
                print(f"    {label} {config}: {type(e).__name__}: {str(e)[:120]}")
                continue
            if err > 3e-2:
                print(f"    {label} {config}: WRONG (rel_err {err:.3g})")
                continue
            if best is None or ms < best[0]:
                best = (ms, config, err)
        if best:
            ms, config, err = best
            rows.append({**where, "kernel": f"best {label} {config}", "ms": ms, "GBps": nbytes / ms / 1e6,
                         "pct_peak": 100 * nbytes / ms / 1e6 / args.peak_gbps, "rel_err": err})
    return rows


def compile_only(arch: str) -> None:
    """Compile, for a GPU this machine need not have, every kernel variant the wrappers launch at
    the benchmark's shapes (bf16 and float32 activations, each weight type)."""
    from compile_kernels import compile_launches
    from kernel_launches import Recorder

    from lucebox.kernels import triton_moe, triton_moe_align, triton_one_row

    launches = []
    names = {triton_moe: ("_pairs_gate_up_kernel", "_act_mul_splits_kernel", "_pairs_down_kernel",
                          "_grouped_gate_up_kernel", "_grouped_down_kernel", "_sum_top_k_kernel"),
             triton_moe_align: ("_count_kernel", "_offsets_kernel", "_scatter_kernel"),
             triton_one_row: ("_sum_splits_kernel",)}
    real = {(m, n): getattr(m, n) for m, ns in names.items() for n in ns}
    for (module, name), fn in real.items():
        setattr(module, name, Recorder(fn, launches))
    sms = triton_moe.num_sms
    triton_moe.num_sms = lambda device: 132  # the launch heuristics as on an H200, not the CPU's nominal 4
    try:
        for shape in (SHAPES["qwen3.6-35b-a3b"], SHAPES["qwen3-30b-a3b"]):
            hidden, experts, top_k, inter = shape
            for wtype in ("bf16", "f32", "Q4_K", "Q8_0", "IQ4_XS", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "IQ4_NL"):
                dtype = torch.float32 if wtype == "f32" else torch.bfloat16
                if wtype in ("bf16", "f32"):
                    gate_up = triton_moe.float_stack(torch.zeros(experts, 2 * inter, hidden, dtype=dtype))
                    down = triton_moe.float_stack(torch.zeros(experts, hidden, inter, dtype=dtype))
                else:
                    qtype = Q[wtype]
                    size = lambda n, k: (experts * n, k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])  # noqa: E731
                    gate_up = triton_moe.quant_stack(torch.zeros(size(2 * inter, hidden), dtype=torch.uint8), qtype,
                                                     (experts, 2 * inter, hidden))
                    down = triton_moe.quant_stack(torch.zeros(size(hidden, inter), dtype=torch.uint8), qtype,
                                                  (experts, hidden, inter))
                for tokens in (1, 2, 16, 64, 4096):
                    x = torch.zeros(tokens, hidden, dtype=dtype)
                    ids, weights = torch.zeros(tokens, top_k, dtype=torch.long), torch.zeros(tokens, top_k, dtype=dtype)
                    if tokens <= 16:
                        triton_moe.pairs_experts(x, ids, weights, gate_up, down)
                    if tokens > 1:
                        triton_moe.grouped_experts(x, ids, weights, gate_up, down)
    finally:
        triton_moe.num_sms = sms
        for (module, name), fn in real.items():
            setattr(module, name, fn)
    compile_launches(launches, arch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3.6-35b-a3b", "qwen3-30b-a3b"],
                   choices=[s for s in SHAPES if s != "smoke"])
    p.add_argument("--qtypes", nargs="+", default=["bf16", "Q4_K", "Q8_0", "IQ4_XS"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 16, 4096])
    p.add_argument("--peak-gbps", type=float, default=4000.0, help="the bandwidth the GB/s are a share of")
    p.add_argument("--no-old", action="store_true", help="skip the torch path")
    p.add_argument("--sweep", action="store_true", help="also try launch configs (slow: one compile each)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--arch", default="90", help="--compile-only's target: 90 (sm_90) or gfx942 etc.")
    args = p.parse_args()
    if args.compile_only:
        compile_only(args.arch)
        return
    if args.smoke:
        device, shapes, args.qtypes, args.tokens = torch.device("cpu"), ["smoke"], ["Q4_K"], [1, 3]
    elif not torch.cuda.is_available():
        sys.exit("bench_moe: needs a GPU (or --smoke / --compile-only)")
    else:
        device, shapes = torch.device("cuda"), args.shapes
    started, rows, failures = time.perf_counter(), [], 0
    for name in shapes:
        shape = SHAPES[name]
        for wtype in args.qtypes:
            module = make_experts(shape, "bf16" if wtype == "bf16" else wtype, device)
            if device.type == "cpu" and wtype == "bf16":
                module = module.float()
            for tokens in args.tokens:
                try:
                    case = bench_case(name, shape, wtype, module, tokens, args, device)
                except Exception as e:  # one failing case (e.g. out of memory) does not lose the others
                    print(f"FAILED shape={name} weights={wtype} tokens={tokens}: {type(e).__name__}: {e}", flush=True)
                    os.environ.pop("LUCEBOX_TRITON", None)
                    failures += 1
                    continue
                for r in case:
                    rows.append(r)
                    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                          flush=True)
            del module
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{len(rows)} rows in {time.perf_counter() - started:.0f} s, {failures} cases failed")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
