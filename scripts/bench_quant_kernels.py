"""The quantised products of scripts/bench_kernels.py (--only quant): each format's fused kernel at 1-64
activation rows against dequantise + matmul and the dense bf16 product, and with --sweep each path's best
launch (float tiles, split rows, int8 activations)."""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

from kernel_timing import bench, bench_in_graph, copies, gbps, random_quant, rel_err, row
from lucebox.kernels import dequant
from lucebox.kernels import split_rows as layout
from lucebox.kernels import triton_dp4a as tdp
from lucebox.kernels import triton_dp4a_runs as tdr
from lucebox.kernels import triton_quant_int8 as tqi
from lucebox.kernels import triton_quant_matmul as tqm
from lucebox.kernels import triton_split_rows as tsr


def bench_quant(args, shape, peak, device) -> list:
    table = []
    qtypes = [getattr(Q, q) for q in args.qtypes]
    ms_list = [1] if args.smoke else args.ms
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
        for m in ([128] if args.smoke else [512, 4096]):
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
