#!/usr/bin/env python
"""Time lucebox's Triton kernels against their torch references on the GPU, in GB/s.

    python scripts/bench_kernels.py                       # everything, qwen3-8b shapes
    python scripts/bench_kernels.py --only quant --sweep  # also try launch configs per shape
    python scripts/bench_kernels.py --only quant --qtypes Q8_0 --ms 1   # decode rows of one format
    python scripts/bench_kernels.py --only gemv --shape qwen3-0.6b --sweep   # decode GEMVs with their
                                                          # prologues vs the unfused kernels
    python scripts/bench_kernels.py --only prefill        # prefill attention at 4K / 32K: the SDPA
                                                          # path vs the Triton kernel vs the old reference
    python scripts/bench_kernels.py --json out.json
    python scripts/bench_kernels.py --smoke               # CPU, Triton interpreter, tiny shapes:
                                                          # checks the script runs, times nothing real

Compiling every kernel variant for sm_90 without a GPU: scripts/compile_kernels.py.

Quantised and fused float GEMV rows are timed inside a CUDA graph over copies of the weights (no launch overhead,
no L2 reuse: as decode runs them); the other rows time each launch from Python (triton's do_bench).
Every kernel here is memory-bound at the sizes decode uses, so each row reports the bytes it must
move (weights/KV read once, activations in and out), the achieved GB/s, and that as a percentage
of the device bandwidth measured at the start of the same run (a large bf16 GEMV through cuBLAS,
which reads like our kernels do, and a device-to-device copy). Each Triton result is also checked
against its reference before it is timed. Prefill attention is compute-bound instead: its rows
report TFLOP/s and that as a percentage of a bf16 matmul measured in the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lucebox.model.kv_cache import PagedKVCache  # noqa: E402
from lucebox.kernels import dequant, triton_activation, triton_gemv, triton_norm  # noqa: E402
from lucebox.kernels import triton_dp4a as tdp  # noqa: E402
from lucebox.kernels import triton_dp4a_runs as tdr  # noqa: E402
from lucebox.kernels import prefill_attention as pa  # noqa: E402
from lucebox.kernels import triton_paged_attention as tpa  # noqa: E402
from lucebox.kernels import split_rows as layout  # noqa: E402
from lucebox.kernels import triton_split_rows as tsr  # noqa: E402
from lucebox.kernels import triton_quant_int8 as tqi  # noqa: E402
from lucebox.kernels import triton_quant_matmul as tqm  # noqa: E402
from lucebox.kernels.attention import paged_attention as attention_dispatch  # noqa: E402
from lucebox.kernels.attention import paged_attention_reference  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402

# Byte offsets of the fp16 scale fields in one block; random bytes there could be Inf/NaN.
FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.IQ4_NL: [0],
               Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_XS: [0]}
SHAPES = {  # (N, K) of each projection, and attention geometry
    "qwen3-8b": {"linears": {"q/o_proj": (4096, 4096), "k/v_proj": (1024, 4096), "gate/up_proj": (12288, 4096),
                             "down_proj": (4096, 12288), "lm_head": (151936, 4096)},
                 "heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096},
    "qwen3-0.6b": {"linears": {"q_proj": (2048, 1024), "k/v_proj": (1024, 1024), "o_proj": (1024, 2048),
                               "gate/up_proj": (3072, 1024), "down_proj": (1024, 3072), "lm_head": (151936, 1024)},
                   "heads": 16, "kv_heads": 8, "head_dim": 128, "hidden": 1024},
    "smoke": {"linears": {"tiny": (48, 512)}, "heads": 4, "kv_heads": 2, "head_dim": 32, "hidden": 96},
}


def bench(fn, device) -> float:
    """Milliseconds per call."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


L2_FLUSH_BYTES = 256 << 20  # operand copies per timing: together well past the H200's 50 MB L2


def bench_in_graph(fn, operands: list, device) -> float:
    """Milliseconds per fn(operand), the calls cycling through `operands` (copies of the same
    weights, so none is still in L2 when its turn comes) and replayed from one CUDA graph: the
    kernel's own time without Python's launch overhead, which for the per-layer matrices of a
    decode step is larger than the kernel (as in the engine, where decode replays graphs)."""
    if device.type != "cuda":
        return bench(lambda: [fn(o) for o in operands], device) / len(operands)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for o in operands:  # compile and warm up outside the capture
            fn(o)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for o in operands:
            fn(o)
    graph.replay()
    torch.cuda.synchronize()
    reps = 10
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (reps * len(operands))


def copies(t: torch.Tensor) -> list:
    """t and enough copies of it to overflow L2 between two uses of the same one (at most 8)."""
    n = max(1, min(8, -(-L2_FLUSH_BYTES // (t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(n - 1)]


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def measure_bandwidth(device) -> dict:
    n = (1 << 30) if device.type == "cuda" else (1 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = bench(lambda: b.copy_(a), device)
    rows = n // (2 * 8192)
    w = torch.randn(rows, 8192, device=device, dtype=torch.bfloat16)
    x = torch.randn(8192, device=device, dtype=torch.bfloat16)
    gemv_ms = bench(lambda: torch.mv(w, x), device)
    del a, b, w
    return {"copy_GBps": gbps(2 * n, copy_ms), "gemv_bf16_GBps": gbps(rows * 8192 * 2, gemv_ms)}


def random_quant(qtype, n: int, k: int, device, seed: int = 0) -> torch.Tensor:
    block, size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (n * (k // block), size), dtype=torch.uint8, device=device, generator=g)
    for off in FP16_FIELDS[qtype]:
        scale = (torch.rand(raw.shape[0], 1, device=device, generator=g) * 0.02 - 0.01).half()
        raw[:, off:off + 2] = scale.view(torch.uint8)
    return raw.reshape(n, -1)


def row(table: list, **kw) -> None:
    table.append(kw)
    tqdm.write("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()))


# ----------------------------------------------------------------------------- quantised matmul

def bench_quant(args, shape, peak, device) -> list:
    table = []
    qtypes = [getattr(Q, q) for q in args.qtypes]
    ms_list = [1] if SMOKE else args.ms
    jobs = [(q, name, nk, m) for q in qtypes for name, nk in shape["linears"].items() for m in ms_list]
    for qtype, name, (n, k), m in tqdm(jobs, desc="quant matmul"):
        raw = random_quant(qtype, n, k, device)
        x = torch.randn(m, k, device=device, dtype=args.dtype)
        ref = F.linear(x, dequant.dequantize(raw, qtype, x.dtype))
        out = tqm.quant_matmul(x, raw, qtype, k)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        nbytes = raw.numel() + x.numel() * x.element_size() + m * n * x.element_size()
        raws = copies(raw)
        t_tri = bench_in_graph(lambda w: tqm.quant_matmul(x, w, qtype, k), raws, device)
        # The reference as it would run on the GPU without Triton: torch dequantise, then matmul.
        t_ref = bench(lambda: F.linear(x, dequant.dequantize(raw, qtype, x.dtype)), device)
        w16 = dequant.dequantize(raw, qtype, x.dtype)
        # the same layer stored in bf16 (cuBLAS), replayed from a graph alike
        t_dense = bench_in_graph(lambda w: F.linear(x, w), copies(w16), device)
        best = {}
        if args.sweep and device.type == "cuda":
            paths = args.sweep_paths
            best = sweep_quant(x, raws, qtype, k, m, ref, device) if "float" in paths else {}
            if qtype in layout.SPLIT_TYPES and "split" in paths:
                best |= sweep_split_rows(x, raws, qtype, k, m, ref, device)
            if qtype in (Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.Q6_K, Q.IQ4_XS) and "int8" in paths:
                best |= sweep_int8(x, raws, qtype, k, m, ref, device)
        row(table, kernel="quant_matmul", qtype=qtype.name, layer=name, N=n, K=k, M=m, rel_err=err,
            us=t_tri * 1e3, GBps=gbps(nbytes, t_tri), pct_peak=100 * gbps(nbytes, t_tri) / peak,
            ref_us=t_ref * 1e3, speedup_vs_ref=t_ref / t_tri, dense_bf16_us=t_dense * 1e3, **best)
        del raw, raws, w16
    # Prefill path: Triton dequantise to bf16, then cuBLAS.
    for qtype in qtypes:
        name, (n, k) = next(iter(shape["linears"].items()))
        raw = random_quant(qtype, n, k, device)
        for m in ([128] if SMOKE else [512, 4096]):
            x = torch.randn(m, k, device=device, dtype=args.dtype)
            t_deq = bench(lambda: tqm.dequantize(raw, qtype, k, x.dtype), device)
            t_all = bench(lambda: F.linear(x, tqm.dequantize(raw, qtype, k, x.dtype)), device)
            row(table, kernel="dequantize+matmul", qtype=qtype.name, layer=name, N=n, K=k, M=m,
                dequant_us=t_deq * 1e3, dequant_GBps=gbps(raw.numel() + n * k * 2, t_deq),
                total_us=t_all * 1e3, TFLOPs=2 * m * n * k / (t_all * 1e-3) / 1e12)
    return table


def sweep_quant(x, raws, qtype, k, m, ref, device) -> dict:
    """The float kernel's launch grid per path: the best overall, and each path's best time and error
    (a path's own arithmetic, e.g. the bf16 tiles' PTX, checked against the reference)."""
    best, found = None, {}
    block_ns = (16, 32, 64) if m == 1 else (32, 64, 128)
    # Paths: at M = 1 the elementwise one and the tensor-core one (dequantised tiles through tl.dot,
    # x padded to 16 rows).
    paths = {"elementwise": {"tensor_cores": False}} if m == 1 else {}
    paths["tensor cores"] = {"tensor_cores": True}
    for path, options in paths.items():
        found[f"{path}_rel_err"] = rel_err(tqm.quant_matmul(x, raws[0], qtype, k, **options), ref)
        for block_n in block_ns:
            for warps in (4, 8):
                for split in (None, 1, 4, 16):
                    try:
                        t = bench_in_graph(lambda w: tqm.quant_matmul(
                            x, w, qtype, k, block_n=block_n, split_k=split, num_warps=warps, **options),
                            raws, device)
                    except Exception:  # e.g. out of shared memory for a config: skip it
                        continue
                    found[f"{path}_best_us"] = min(found.get(f"{path}_best_us", math.inf), t * 1e3)
                    if best is None or t < best[0]:
                        best = (t, block_n, warps, split, path)
    if not best:
        return found
    return found | {"best_us": best[0] * 1e3, "best_block_n": best[1], "best_warps": best[2],
                    "best_split": str(best[3]), "best_path": best[4]}


def sweep_split_rows(x, raws, qtype, k, m, ref, device) -> dict:
    """The same product over split rows (kernels/triton_split_rows.py, the Q8_0 / Q6_K layout models
    take on the GPU): the one-row GEMV at M = 1, the fused kernel (verify) above; checked against
    the reference first, then timed like the rest, at the default launch and over a grid."""
    splits = [layout.split_rows(w, qtype) for w in raws]
    if m == 1:
        def product(w, **launch):
            return tsr.gemv(x, w, qtype, k, **launch)
    else:
        def product(w, **launch):
            return tqm.quant_matmul(x, w, qtype, k, split_rows=True, **launch)
    err = rel_err(product(splits[0]), ref)
    default = bench_in_graph(product, splits, device)
    best_t, best = best_launch(product, splits, m, (16, 32, 64), device)
    found = {"split_rel_err": err, "split_default_us": default * 1e3, "split_best_us": best_t * 1e3,
             "split_best": best}
    return found


def sweep_int8(x, raws, qtype, k, m, ref, device) -> dict:
    """The product on int8 activations (kernels/triton_quant_int8.py; the rounding launch inside the
    time): the dp4a GEMV at M = 1, integer tensor cores above; Q4_K on ggml rows, Q8_0 and Q6_K on
    split rows. Its error against the float product, the default launch and the best of a grid; at
    M = 1 also the kernels that keep each thread's sums apart (triton_dp4a_runs, also Q5_K and IQ4_XS)."""
    split_rows = qtype in (Q.Q8_0, Q.Q6_K)
    weights = [layout.split_rows(w, qtype) for w in raws] if split_rows else raws
    found = {}
    if (qtype, split_rows) in tqi._KERNELS:
        def product(w, **launch):
            return tqi.matmul(x, w, qtype, split_rows, k, **launch)
        err = rel_err(product(weights[0]), ref)
        default = bench_in_graph(product, weights, device)
        best_t, best = best_launch(product, weights, m, (32, 64), device)
        found = {"int8_rel_err": err, "int8_default_us": default * 1e3, "int8_best_us": best_t * 1e3,
                 "int8_best": best}
    if m == 1 and (qtype, split_rows) in tdr.RUNS_KERNELS:
        def runs(w, **launch):
            return tdp.gemv(x, w, qtype, split_rows, k, runs=True, **launch)
        at_default = bench_in_graph(runs, weights, device)
        grid = itertools.product((16, 32, 64, 128), (4, 8), (None, 1, 2, 4, 16), (1, 2))
        best = (math.inf, "none ran")
        for block_n, warps, split_k, unroll in grid:
            launch = {"block_n": block_n, "num_warps": warps, "split_k": split_k, "unroll": unroll}
            try:
                t = bench_in_graph(lambda w: runs(w, **launch), weights, device)
            except Exception:  # e.g. out of registers for a config: skip it
                continue
            if t < best[0]:
                best = (t, f"{block_n}x{warps}w split {split_k} unroll {unroll}")
        found |= {"runs_rel_err": rel_err(runs(weights[0]), ref), "runs_default_us": at_default * 1e3,
                  "runs_best_us": best[0] * 1e3, "runs_best": best[1]}
    return found


def best_launch(product, weights, m, one_row_block_ns, device) -> tuple[float, str]:
    """The fastest launch of product(w, **launch) over a grid (rows a program, warps, split-K; for one
    row also the loop's software-pipelining stages 1-3): (its time in ms, its description)."""
    grid = (itertools.product(one_row_block_ns, (4, 8), (None, 4, 16), (1, 2, 3)) if m == 1 else
            itertools.product((32, 64, 128), (4, 8), (None, 1, 4, 8, 16), (1,)))
    best = (math.inf, "none ran")
    for block_n, warps, split_k, stages in grid:
        launch = {"block_n": block_n, "split_k": split_k, "num_warps": warps} | ({"stages": stages} if m == 1 else {})
        try:
            t = bench_in_graph(lambda w: product(w, **launch), weights, device)
        except Exception:  # e.g. out of shared memory for a config: skip it
            continue
        if t < best[0]:
            best = (t, f"{block_n}x{warps}w split {split_k}" + (f" stages {stages}" if m == 1 else ""))
    return best


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# ----------------------------------------------------------------------------- paged attention

def attention_case(shape, ctx: int, q_len: int, batch: int, cache_type: str, dtype, device, block_size=16):
    h, kvh, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    per_seq = math.ceil((ctx + q_len) / block_size)
    num_blocks = per_seq * batch
    k_cache = PagedKVCache(num_blocks, block_size, kvh, d, cache_type, dtype, device)
    v_cache = PagedKVCache(num_blocks, block_size, kvh, d, cache_type, dtype, device)
    perm = torch.randperm(num_blocks).tolist()  # scattered pages, as after a while of serving
    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    for cache in (k_cache, v_cache):  # fill every slot (values only matter for the check)
        slots = torch.arange(num_blocks * block_size, device=device)
        for chunk in slots.split(1 << 16):
            cache.write(torch.randn(chunk.numel(), kvh, d, device=device, dtype=dtype), chunk)
    fb = ForwardBatch.build([[0] * q_len] * batch, [ctx] * batch, tables, block_size, device)
    q = torch.randn(batch * q_len, h, d, device=device, dtype=dtype)
    kv_bytes = 2 * batch * (ctx + q_len) * k_cache.bytes_per_token
    return q, k_cache, v_cache, fb, kv_bytes + 2 * q.numel() * q.element_size()


@contextlib.contextmanager
def torch_reference():
    """LUCEBOX_TRITON=0 for the duration: the dispatching functions run their torch reference."""
    old = os.environ.get("LUCEBOX_TRITON")
    os.environ["LUCEBOX_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["LUCEBOX_TRITON"]
        else:
            os.environ["LUCEBOX_TRITON"] = old


def bench_attention(args, shape, peak, device) -> list:
    table = []
    ctxs = [40] if SMOKE else [512, 4096, 32768]
    jobs = [(c, ql, b, ct) for ct in args.cache_types for c in ctxs for ql in (1, 16) for b in (1, 8)]
    # a prefill bucket's chunk on a cached prefix (an agent's turn): the tall tiles
    jobs += [(c, 256, 1, ct) for ct in args.cache_types for c in ([40] if SMOKE else [4096, 16384, 32768])]
    for ctx, q_len, batch, cache_type in tqdm(jobs, desc="paged attention"):
        q, kc, vc, fb, nbytes = attention_case(shape, ctx, q_len, batch, cache_type, args.dtype, device)
        scale = shape["head_dim"] ** -0.5
        with torch_reference():
            ref = attention_dispatch(q, kc, vc, fb, scale)
            t_ref = (bench(lambda: attention_dispatch(q, kc, vc, fb, scale), device)
                     if ctx <= 4096 or args.slow_ref else float("nan"))
        out = tpa.paged_attention(q, kc, vc, fb, scale)
        err = (out.float() - ref.float()).abs().max().item()
        t = bench(lambda: tpa.paged_attention(q, kc, vc, fb, scale), device)
        extra = {}
        if args.sweep and device.type == "cuda":
            extra = sweep_attention(q, kc, vc, fb, scale, device)
        row(table, kernel="paged_attention", cache=cache_type, ctx=ctx, q_len=q_len, batch=batch, abs_err=err,
            us=t * 1e3, GBps=gbps(nbytes, t), pct_peak=100 * gbps(nbytes, t) / peak, ref_us=t_ref * 1e3,
            speedup_vs_ref=t_ref / t, **extra)
        del q, kc, vc
    return table


def sweep_attention(q, kc, vc, fb, scale, device) -> dict:
    """The fastest launch: splits of the keys, key tile, warps, and (steps of many queries: prefill
    chunks) query rows a program and pipeline stages."""
    best = None
    tall = q.shape[0] > 32
    for config in itertools.product((1, 2, 4, 8, 16, 32, 64), (32, 64, 128), (4, 8),
                                    (64, 128) if tall else (None,), (2, 3) if tall else (None,)):
        splits, block_kv, warps, rows, stages = config
        try:
            t = bench(lambda: tpa.paged_attention(q, kc, vc, fb, scale, num_splits=splits, block_kv=block_kv,
                                                  num_warps=warps, rows=rows, num_stages=stages), device)
        except Exception:  # a launch that does not fit the GPU (shared memory, registers)
            continue
        if best is None or t < best[0]:
            best = (t, *config)
    if best is None:
        return {}
    names = ("best_us", "best_splits", "best_block_kv", "best_warps", "best_rows", "best_stages")
    return dict(zip(names, (best[0] * 1e3, *best[1:])))


# ----------------------------------------------------------------------------- prefill attention

PREFILL_CASES = [  # (new tokens, cached tokens before them, sliding window)
    (4096, 0, None), (32768, 0, None),  # a whole prompt in one chunk
    (4096, 28672, None),  # the last 4K chunk of a chunked 32K prompt
    (32768, 0, 4096),  # a Mistral-style window layer over a 32K prompt
    # Around prefill_attention.MIN_QUERY_LEN: where SDPA overtakes the Triton kernel.
    (32, 4096, None), (64, 4096, None), (128, 4096, None), (256, 4096, None), (512, 4096, None),
]
SMOKE_PREFILL_CASES = [(96, 0, None), (80, 40, None), (96, 0, 16), (32, 40, None)]


def measure_matmul(device) -> float:
    """bf16 matmul TFLOP/s (8192^3 on the GPU), the ceiling prefill attention is compared with."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, device)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def bench_prefill(args, shape, peak, device) -> list:
    """One sequence's prefill chunk: the SDPA path (prefill_attention), the Triton paged kernel (what
    GPU prefill ran before it) and the old torch reference (dense mask, repeated GQA heads). FLOPs
    count only the visible (causal, in-window) query-key pairs: 4 * heads * head_dim per pair."""
    table = []
    tflops_peak = measure_matmul(device)
    tqdm.write(f"  bf16 matmul: {tflops_peak:.0f} TFLOP/s (the peak used for pct_matmul)")
    cases = SMOKE_PREFILL_CASES if SMOKE else PREFILL_CASES
    jobs = [(ct, *case) for ct in args.cache_types for case in cases]
    scale = shape["head_dim"] ** -0.5
    for cache_type, q_len, ctx, window in tqdm(jobs, desc="prefill attention"):
        q, kc, vc, fb, _ = attention_case(shape, ctx, q_len, 1, cache_type, args.dtype, device)
        pos = torch.arange(ctx, ctx + q_len, dtype=torch.float64)
        pairs = (pos + 1 if window is None else (pos + 1).clamp(max=window)).sum().item()
        flops = 4 * shape["heads"] * shape["head_dim"] * pairs
        out = pa.prefill_attention(q, kc, vc, fb, scale, window)
        tri = tpa.paged_attention(q, kc, vc, fb, scale, window)
        try:  # the reference's dense mask (and any math-kernel fallback) may not fit at 32K
            ref = paged_attention_reference(q, kc, vc, fb, scale, window)
            err = (out.float() - ref.float()).abs().max().item()
            t_ref = bench(lambda: paged_attention_reference(q, kc, vc, fb, scale, window), device)
            del ref
        except torch.OutOfMemoryError:
            ref_err = (out.float() - tri.float()).abs().max().item()
            tqdm.write(f"  reference out of memory; |sdpa - triton| = {ref_err:.3g}")
            err = t_ref = float("nan")
        del tri
        t = bench(lambda: pa.prefill_attention(q, kc, vc, fb, scale, window), device)
        t_tri = bench(lambda: tpa.paged_attention(q, kc, vc, fb, scale, window), device)
        tf = flops / (t * 1e-3) / 1e12
        row(table, kernel="prefill_attention", cache=cache_type, q_len=q_len, ctx=ctx, window=str(window),
            abs_err=err, ms=t, TFLOPs=tf, pct_matmul=100 * tf / tflops_peak, triton_ms=t_tri,
            triton_TFLOPs=flops / (t_tri * 1e-3) / 1e12, ref_ms=t_ref, speedup_vs_triton=t_tri / t,
            speedup_vs_ref=t_ref / t)
        del q, kc, vc, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return table


# ----------------------------------------------------------------------------- RMSNorm

def bench_norm(args, shape, peak, device) -> list:
    table = []
    hidden = shape["hidden"]
    for rows in tqdm([1, 16] if SMOKE else [1, 16, 64, 4096], desc="rms norm"):
        g = torch.Generator(device=device).manual_seed(rows)
        x, r = (torch.randn(rows, hidden, device=device, dtype=args.dtype, generator=g) for _ in range(2))
        w = torch.rand(hidden, device=device, dtype=args.dtype, generator=g)
        out, _ = triton_norm.rms_norm_residual_triton(x, r, w, 1e-6)
        want, _ = triton_norm.rms_norm_residual_reference(x, r, w, 1e-6)
        err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
        nbytes = 4 * x.numel() * x.element_size() + w.numel() * w.element_size()
        t = bench(lambda: triton_norm.rms_norm_residual_triton(x, r, w, 1e-6), device)
        t_ref = bench(lambda: triton_norm.rms_norm_residual_reference(x, r, w, 1e-6), device)
        row(table, kernel="rms_norm_residual", rows=rows, hidden=hidden, rel_err=err, us=t * 1e3,
            GBps=gbps(nbytes, t), pct_peak=100 * gbps(nbytes, t) / peak, ref_us=t_ref * 1e3,
            speedup_vs_ref=t_ref / t)
    return table


# ----------------------------------------------------------------------------- decode GEMV with a prologue

def decode_matrices(shape) -> list:
    """(name, N, K, prologue) of a decoder layer's projections once q/k/v and gate/up are fused."""
    lin, hidden = shape["linears"], shape["hidden"]
    if "k/v_proj" not in lin:  # the smoke shape
        return [("norm+qkv", 40, hidden, triton_gemv.NORM), ("silu*up+down", hidden, 72, triton_gemv.SILU_MUL)]
    q = lin.get("q_proj", lin.get("q/o_proj"))[0]
    kv = lin["k/v_proj"][0]
    o_n, o_k = lin.get("o_proj", lin.get("q/o_proj"))
    gate = lin["gate/up_proj"][0]
    return [("norm+qkv", q + 2 * kv, hidden, triton_gemv.NORM), ("o", o_n, o_k, triton_gemv.IDENTITY),
            ("norm+gate_up", 2 * gate, hidden, triton_gemv.NORM), ("silu*up+down", hidden, gate, triton_gemv.SILU_MUL)]


def bench_gemv(args, shape, peak, device) -> list:
    """Per projection of a decode step: the Triton GEMV with its prologue against what the model
    ran before it (the Triton norm or SiLU-mul kernel, then cuBLAS), both replayed from a graph."""
    table = []
    for name, n, k, prologue in tqdm(decode_matrices(shape), desc="decode gemv"):
        g = torch.Generator(device=device).manual_seed(n + k)
        weight = (torch.randn(n, k, device=device, generator=g) / k ** 0.5).to(args.dtype)
        x = torch.randn(1, 2 * k if prologue == triton_gemv.SILU_MUL else k, device=device, generator=g).to(args.dtype)
        residual = torch.randn(1, k, device=device, generator=g).to(args.dtype)
        norm_w = torch.rand(k, device=device, generator=g).to(args.dtype)
        res = residual if prologue == triton_gemv.NORM else None

        def unfused(w):
            if prologue == triton_gemv.NORM:
                h, _ = triton_norm.rms_norm_residual_triton(x, residual, norm_w, 1e-6)
            elif prologue == triton_gemv.SILU_MUL:
                h = triton_activation.silu_and_mul_triton(*x.chunk(2, dim=-1))
            else:
                h = x
            return F.linear(h, w)

        def fused(w, config=None):
            return triton_gemv.gemv(x, w, None, prologue, res, norm_w, 1e-6, config=config)[0]

        err = ((fused(weight).float() - unfused(weight).float()).abs().max() / unfused(weight).float().abs().max()).item()
        operands = copies(weight)
        nbytes = n * k * weight.element_size()
        t_ref = bench_in_graph(unfused, operands, device)
        t = bench_in_graph(fused, operands, device)
        best = None
        if args.sweep and not SMOKE:
            configs = [(bn, min(triton_gemv.next_pow2(k), max(64, tile // bn)), warps, 0)
                       for bn in (1, 2, 4, 8, 16) for tile in (4096, 8192, 16384) for warps in (4, 8)]
            if triton_gemv.next_pow2(k) <= 4096:  # the input kept in registers, programs walking the rows
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                configs += [(bn, triton_gemv.next_pow2(k), warps, per_sm * sms)
                            for bn in (1, 2, 4) for warps in (4, 8) for per_sm in (1, 2, 4)]
            timed = []
            for config in dict.fromkeys(configs):
                try:
                    timed.append((bench_in_graph(lambda w, c=config: fused(w, c), operands, device), config))
                    tqdm.write(f"  {name} {config}: {timed[-1][0] * 1e3:.2f} us")
                except Exception as e:  # a config the compiler rejects (registers) is skipped
                    tqdm.write(f"  {name} {config}: {type(e).__name__}")
            best = min(timed)
        row(table, matrix=name, N=n, K=k, MB=nbytes / 1e6, rel_err=err, unfused_us=t_ref * 1e3, fused_us=t * 1e3,
            pct_peak=100 * gbps(nbytes, t) / peak, speedup=t_ref / t, config=str(triton_gemv.launch_config(n, k, prologue, device)),
            best_us=best[0] * 1e3 if best else None, best_config=str(best[1]) if best else None)
    return table


def markdown(table: list) -> str:
    if not table:
        return ""
    keys = list(dict.fromkeys(k for r in table for k in r))
    fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in table]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=[s for s in SHAPES if s != "smoke"])
    p.add_argument("--only", choices=["quant", "attention", "prefill", "norm", "gemv"], action="append")
    p.add_argument("--qtypes", nargs="+", default=["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q4_0",
                                                   "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
    p.add_argument("--ms", nargs="+", type=int, default=[1, 4, 16, 64], help="activation rows of the quant rows")
    p.add_argument("--cache-types", nargs="+", default=["bf16", "fp8", "q8_0"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sweep", action="store_true", help="also time a grid of launch configs per row")
    p.add_argument("--sweep-paths", nargs="+", choices=["float", "split", "int8"], default=["float", "split", "int8"],
                   help="the quant products --sweep covers: float kernels, split rows, int8 activations")
    p.add_argument("--slow-ref", action="store_true", help="time the torch attention reference at 32K too")
    p.add_argument("--json", help="write all rows and the measured bandwidth here")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if SMOKE:
        device, shape, args.dtype = torch.device("cpu"), SHAPES["smoke"], torch.float32
        os.environ["LUCEBOX_TRITON"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA/ROCm GPU (or --smoke to check the script on the CPU)")
    else:
        device, shape = torch.device("cuda"), SHAPES[args.shape]
    torch.manual_seed(0)
    import triton
    bw = measure_bandwidth(device)
    peak = bw["gemv_bf16_GBps"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"# {name}; torch {torch.__version__}; triton {triton.__version__}; shape {args.shape}")
    print(f"measured: device copy {bw['copy_GBps']:.0f} GB/s (read+write); bf16 GEMV {peak:.0f} GB/s "
          f"(the peak used for pct_peak)\n")
    results = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
               "shape": args.shape, "bandwidth": bw, "rows": {}}
    only = args.only or ["quant", "attention", "prefill", "norm", "gemv"]
    for part, fn in (("quant", bench_quant), ("attention", bench_attention), ("prefill", bench_prefill),
                     ("norm", bench_norm), ("gemv", bench_gemv)):
        if part in only:
            table = fn(args, shape, peak, device)
            results["rows"][part] = table
            print(f"\n## {part}\n\n{markdown(table)}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
