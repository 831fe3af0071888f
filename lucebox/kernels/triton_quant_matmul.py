"""Fused dequantise-and-multiply for GGUF weights (Triton), and a Triton dequantiser for prefill.

Decode and verify multiply a few rows of activations (M = 1..64) by every weight once per step,
so they are bound by memory bandwidth: the kernel reads each packed weight byte once, unpacks it
in registers and multiplies it straight away, accumulating in float32. One program owns
BLOCK_N output features (rows of W) and a range of K; when there are too few programs to fill the
GPU the K range is split (split-K) and the float32 partials are summed afterwards by one small
kernel that also adds the bias and casts (in a fixed order, so results stay deterministic): that
kernel and the one-row GEMV helpers the other quantised kernels share are in triton_one_row.

Every format is consumed as "planes" (triton_quant_units: the formats, their units and planes, and
`supports` / `unit_layout`, re-exported here). A plane is dequantised to float32 and then, by MODE,
multiplied elementwise (0: M == 1), fed to tl.dot (1: M > 1) or stored (2: dequantise, for prefill,
where cuBLAS on the bf16 tile beats any fused kernel). In mode 2 the arithmetic is done without FMA
contraction, so it is bit-exact with `dequant.dequantize` (and so with gguf-py).

Large M (prefill): `quant_matmul` below is only the fused path; kernels/linear.py dequantises row
chunks with `dequantize` here and multiplies with torch.matmul (cuBLAS) when M > MAX_FUSED_M.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from .dispatch import next_pow2, num_sms, pdl_launch
from .routing import ACTIVATION_DTYPES, MAX_FUSED_M
from .triton_one_row import reduce_splits, store_one_row
from .triton_pdl import wait_for_previous_kernel
from .triton_quant_units import SUPPORTED_TYPES, format_id, supports, unit_layout, unit_product

__all__ = ["DECODE_LAUNCH", "SUPPORTED_TYPES", "dequantize", "quant_matmul", "supports", "unit_layout", "unit_product"]
# Decode (M = 1) launch: (BLOCK_N, warps) per format; formats not swept keep (32, 4).
# scripts/bench_kernels.py --only quant --sweep, H200, qwen3-8b shapes in CUDA graphs, 2026-12-03
DECODE_LAUNCH = {format_id(Q.Q8_0): (32, 8), format_id(Q.Q6_K): (32, 8), format_id(Q.Q4_K): (64, 4)}


@triton.jit
def _qmm_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, row_bytes, n_units, units_per_prog,
                stride_xm, stride_om, stride_os,
                FMT: tl.constexpr, UNIT_BYTES: tl.constexpr, UNIT_VALUES: tl.constexpr, BPU: tl.constexpr,
                P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr,
                HAS_BIAS: tl.constexpr, DOT_IEEE: tl.constexpr, SPLIT: tl.constexpr = False,
                PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    # Rows past N re-read row N-1 (always in bounds) so weight loads need no mask; their results
    # are dropped at the store.
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    w_row = w_ptr + rows[:, None] * row_bytes  # [BLOCK_N, 1] byte pointers
    o_row = o_ptr + rn.to(tl.int64)[:, None] * stride_om  # mode 2: row starts of the output
    if MODE == 0:
        acc = tl.zeros([BLOCK_N, P], dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([1, 1], dtype=tl.float32)
    u0 = pid_s * units_per_prog
    u1 = tl.minimum(u0 + units_per_prog, n_units)
    for u in range(u0, u1):
        acc = unit_product(acc, w_row, u, n_units, x_ptr + u * UNIT_VALUES, stride_xm, M, o_row + u * UNIT_VALUES,
                           n_mask, FMT, UNIT_BYTES, UNIT_VALUES, BPU, SPLIT, MODE, BLOCK_M, DOT_IEEE)
    if MODE == 0:
        store_one_row(tl.sum(acc, axis=1), rn, N, o_ptr, stride_os, b_ptr, HAS_BIAS)
    elif MODE == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        rm = tl.arange(0, BLOCK_M)
        ptrs = o_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
        tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=n_mask[:, None] & (rm[None, :] < M))


# ----------------------------------------------------------------------------- host side

def _is_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype, in_features: int,
                 bias: torch.Tensor | None = None, *, block_n: int | None = None,
                 split_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, tensor_cores: bool | None = None,
                 split_rows: bool = False) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for raw GGUF rows `qweight` [N, bytes_per_row]; fused for
    M = prod(x.shape[:-1]) <= MAX_FUSED_M. Output in x.dtype, accumulated in float32.
    tensor_cores: multiply dequantised tiles with tl.dot (mode 1, x padded to 16 rows) rather
    than elementwise (mode 0); default: only for M > 1. At M = 1 the kernel is bound by the
    instructions per weight, which the tensor-core path changes: a launch option to measure.
    split_rows: Q8_0 or Q6_K rows in the split layout (kernels/triton_split_rows.py)."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quant_matmul: unsupported activation dtype {x.dtype}")
    fmt, unit_bytes, unit_values, bpu, plane, n_units = unit_layout(qtype, in_features, split_rows)
    n = qweight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > MAX_FUSED_M:
        raise ValueError(f"quant_matmul (fused) handles at most {MAX_FUSED_M} rows, got {m}")
    out = x2.new_empty(m, n)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    mode = 1 if (tensor_cores if tensor_cores is not None else m > 1) else 0
    if mode == 0 and m != 1:
        raise ValueError(f"quant_matmul: the elementwise path multiplies one row, got {m}")
    block_m = 1 if mode == 0 else max(16, next_pow2(m))
    decode_block_n, decode_warps = DECODE_LAUNCH.get(fmt, (32, 4))
    wide = mode == 1 and block_m >= 64
    if block_n is None:
        # 64-row tiles reload and convert the activation tile once per weight tile: wider weight
        # tiles halve that work (the 33-64 row sweep's best on Q4_K, Q8_0 and Q6_K split rows)
        block_n = decode_block_n if mode == 0 else 128 if wide else 64
    programs_n = triton.cdiv(n, block_n)
    sms = num_sms(x.device)
    if split_k is None and wide:
        # four K slices unless the output alone would leave SMs idle (then one wave) or already
        # fills four waves (then fewer)
        split_k = max(1, min(n_units // 2, max(min(4, 4 * sms // programs_n), sms // programs_n)))
    elif split_k is None:
        # Loads are not software-pipelined across loop iterations here, so latency is hidden by
        # many resident programs: aim for several per SM, each keeping at least two units of K.
        waves = 8 if mode == 0 else 4
        split_k = max(1, min(waves * sms // programs_n, n_units // 2))
    split_k = max(1, min(split_k, n_units))
    per = triton.cdiv(n_units, split_k)
    split_k = triton.cdiv(n_units, per)
    if split_k > 1:
        target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        stride_os = m * n
    else:
        target, stride_os = out, 0
    has_bias = bias is not None and split_k == 1
    # 8 warps for the widest tiles keep the unrolled planes in registers (no local-memory spills)
    kwargs = {"num_warps": num_warps or (decode_warps if mode == 0 else 8 if block_m >= 64 else 4)}
    if num_stages is not None:
        kwargs["num_stages"] = num_stages
    _qmm_kernel[(programs_n, split_k)](
        x2, qweight, bias if has_bias else x2, target,
        m, n, qweight.shape[1], n_units, per, x2.stride(0), n, stride_os,
        FMT=fmt, UNIT_BYTES=unit_bytes, UNIT_VALUES=unit_values, BPU=bpu, P=plane,
        BLOCK_N=block_n, BLOCK_M=block_m, MODE=mode, HAS_BIAS=has_bias,
        DOT_IEEE=_is_fp32(x.dtype), SPLIT=split_rows, **kwargs, **pdl_launch(x.device, tiles=mode == 1))
    if split_k > 1:
        reduce_splits(target, bias, out)
    return out.reshape(*lead, n)


def dequantize(qweight: torch.Tensor, qtype, in_features: int,
               out_dtype: torch.dtype = torch.float32, *, block_n: int = 16,
               num_warps: int = 4, split_rows: bool = False) -> torch.Tensor:
    """Raw GGUF rows [N, bytes_per_row] (or split rows) -> [N, in_features] in out_dtype; bit-exact
    with `lucebox.kernels.dequant.dequantize` (float32 arithmetic, no FMA contraction, then a cast)."""
    fmt, unit_bytes, unit_values, bpu, plane, n_units = unit_layout(qtype, in_features, split_rows)
    n = qweight.shape[0]
    out = torch.empty(n, in_features, dtype=out_dtype, device=qweight.device)
    if n == 0:
        return out
    programs_n = triton.cdiv(n, block_n)
    per = max(1, min(n_units, triton.cdiv(n_units * programs_n, 8 * num_sms(qweight.device))))
    split = triton.cdiv(n_units, per)
    _qmm_kernel[(programs_n, split)](
        qweight, qweight, qweight, out, 1, n, qweight.shape[1], n_units, per,
        0, in_features, 0,
        FMT=fmt, UNIT_BYTES=unit_bytes, UNIT_VALUES=unit_values, BPU=bpu, P=plane,
        BLOCK_N=block_n, BLOCK_M=1, MODE=2, HAS_BIAS=False, DOT_IEEE=False, SPLIT=split_rows,
        num_warps=num_warps, enable_fp_fusion=False, **pdl_launch(out.device))
    return out
