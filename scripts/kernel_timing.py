"""Timing and operand helpers of the kernel benchmarks (scripts/bench_kernels.py, bench_quant_kernels.py,
bench_sampler.py): per-call milliseconds, CUDA-graph replays over copies of the operands, GB/s, the
device's bandwidth, random GGUF rows, the result tables."""
from __future__ import annotations

import time

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from tqdm import tqdm

# Byte offsets of the fp16 scale fields in one block; random bytes there could be Inf/NaN.
FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.IQ4_NL: [0],
               Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_XS: [0]}

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


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def markdown(table: list) -> str:
    if not table:
        return ""
    keys = list(dict.fromkeys(k for r in table for k in r))
    fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in table]
    return "\n".join(lines)
