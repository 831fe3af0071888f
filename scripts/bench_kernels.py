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

Compiling every kernel variant for sm_90 without a GPU: scripts/compile_kernels.py. The quantised products'
rows live in scripts/bench_quant_kernels.py, the timing helpers every kernel bench shares in kernel_timing.py.

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
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench_quant_kernels import bench_quant  # noqa: E402
from kernel_timing import (  # noqa: E402
    bench, bench_in_graph, copies, gbps, markdown, measure_bandwidth, row)
from lucebox.model.kv_cache import PagedKVCache  # noqa: E402
from lucebox.kernels import triton_activation, triton_gemv, triton_norm  # noqa: E402
from lucebox.kernels import prefill_attention as pa  # noqa: E402
from lucebox.kernels import triton_paged_attention as tpa  # noqa: E402
from lucebox.kernels.attention import paged_attention as attention_dispatch  # noqa: E402
from lucebox.kernels.attention import paged_attention_reference  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402

SHAPES = {  # (N, K) of each projection, and attention geometry
    "qwen3-8b": {"linears": {"q/o_proj": (4096, 4096), "k/v_proj": (1024, 4096), "gate/up_proj": (12288, 4096),
                             "down_proj": (4096, 12288), "lm_head": (151936, 4096)},
                 "heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096},
    "qwen3-0.6b": {"linears": {"q_proj": (2048, 1024), "k/v_proj": (1024, 1024), "o_proj": (1024, 2048),
                               "gate/up_proj": (3072, 1024), "down_proj": (1024, 3072), "lm_head": (151936, 1024)},
                   "heads": 16, "kv_heads": 8, "head_dim": 128, "hidden": 1024},
    "smoke": {"linears": {"tiny": (48, 512)}, "heads": 4, "kv_heads": 2, "head_dim": 32, "hidden": 96},
}


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
    jobs = [(c, ql, b, ct) for ct in args.cache_types for c in ctxs for ql in (1, 16) if ql in args.q_lens
            for b in (1, 8)]
    # a prefill bucket's chunk on a cached prefix (an agent's turn): the tall tiles
    jobs += [(c, 256, 1, ct) for ct in args.cache_types for c in ([40] if SMOKE else [4096, 16384, 32768])
             if 256 in args.q_lens]
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
    # tall tiles (prefill chunks) compile slowly: fewer splits and 128-row programs only
    for config in itertools.product((1, 2, 4, 8, 16) if tall else (1, 2, 4, 8, 16, 32, 64), (32, 64, 128), (4, 8),
                                    (128,) if tall else (None,), (2, 3) if tall else (None,)):
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=[s for s in SHAPES if s != "smoke"])
    p.add_argument("--only", choices=["quant", "attention", "prefill", "norm", "gemv"], action="append")
    p.add_argument("--qtypes", nargs="+", default=["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q4_0",
                                                   "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
    p.add_argument("--ms", nargs="+", type=int, default=[1, 4, 16, 64], help="activation rows of the quant rows")
    p.add_argument("--cache-types", nargs="+", default=["bf16", "fp8", "q8_0"])
    p.add_argument("--q-lens", nargs="+", type=int, choices=[1, 16, 256], default=[1, 16, 256],
                   help="attention rows: decode (1), verify (16), a 256-token chunk on a cached prefix (256)")
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
