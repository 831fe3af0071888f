"""Triton GEMV for one decode token, with the op before it fused into its prologue (the references
and the dispatch are in kernels/linear.py).

    y = W @ p(x)    p: identity | RMSNorm(x [+ residual]) | silu(gate) * up

At batch 1 a decoder layer is a chain of small kernels, and on a fast GPU each costs a few
microseconds of launch and drain whatever its size: on a 0.6B model, more than the bytes it
moves. Fusing the RMSNorm (with its residual add) into the q/k/v and gate/up projections and the
SiLU-and-mul into the down projection removes three of a layer's kernels, and cuBLAS's split-K
reductions go with its GEMVs. Each program computes BLOCK_N outputs over all of K, so nothing
is reduced across programs; the prologue is recomputed by every program from the input vector
(K values, served from L2), which costs nothing next to its BLOCK_N rows of weights. With a
residual, program 0 also writes the summed stream (the next residual).

Rounding follows the unfused ops: the residual sum is rounded to the dtype, normalised in
float32, rounded, multiplied by the norm weight and rounded again; silu is rounded before the
product, which is rounded too. The dot products accumulate in float32 in another order than
cuBLAS's (tests compare with a tolerance).
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, num_sms, pdl_launch

IDENTITY, NORM, SILU_MUL = 0, 1, 2
TILE = 16384  # weights a program holds per iteration (BLOCK_N x BLOCK_K): 64 a thread at 8 warps
RESIDENT_MAX_K = 4096  # the longest input a program keeps in registers (32 floats a thread at 4 warps)


@functools.cache
def _kernel():
    """Defined on first use: importing this module must not import Triton (see triton_norm). The
    helper is a module global: kernels resolve the functions they call there."""
    global triton, tl, _input, wait_for_previous_kernel
    import triton
    import triton.language as tl

    from .triton_pdl import wait_for_previous_kernel

    @triton.jit
    def _input(x_ptr, r_ptr, nw_ptr, cols, ok, K, inv, dt, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
        """The GEMV's input at `cols`, after the prologue, in float32."""
        if PROLOGUE == 1:
            t = tl.load(x_ptr + cols, mask=ok, other=0.0)
            if HAS_RES:
                t = (t.to(tl.float32) + tl.load(r_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
            h = (t.to(tl.float32) * inv).to(dt).to(tl.float32)
            xv = (tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32) * h).to(dt).to(tl.float32)
        elif PROLOGUE == 2:  # x is [gate | up], K each
            g = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + cols, mask=ok, other=0.0).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            xv = (s * u).to(dt).to(tl.float32)
        else:
            xv = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        return xv

    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, nw_ptr, total_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, eps,
                     PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RESIDENT: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        pid = tl.program_id(0)
        dt = x_ptr.dtype.element_ty
        inv = 1.0
        if PROLOGUE == 1:  # the row's RMS first (and the summed stream, by program 0)
            squares = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                ok = cols < K
                t = tl.load(x_ptr + cols, mask=ok, other=0.0)
                if HAS_RES:
                    t = (t.to(tl.float32) + tl.load(r_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
                    if pid == 0:
                        tl.store(total_ptr + cols, t, mask=ok)
                t = t.to(tl.float32)
                squares += t * t
            inv = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if RESIDENT:  # BLOCK_K >= K: the input stays in registers while the program walks row blocks
            cols = tl.arange(0, BLOCK_K)
            ok = cols < K
            xv = _input(x_ptr, r_ptr, nw_ptr, cols, ok, K, inv, dt, PROLOGUE, HAS_RES)
            for block in range(pid, tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
                rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
                r_ok = rows < N
                w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :],
                            mask=r_ok[:, None] & ok[None, :], other=0.0)
                out = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
                if HAS_BIAS:
                    out += tl.load(b_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
                tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=r_ok)
        else:  # one block of rows, over K in steps
            rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            r_ok = rows < N
            w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                ok = cols < K
                xv = _input(x_ptr, r_ptr, nw_ptr, cols, ok, K, inv, dt, PROLOGUE, HAS_RES)
                w = tl.load(w_rows + cols[None, :], mask=r_ok[:, None] & ok[None, :], other=0.0)
                acc += w.to(tl.float32) * xv[None, :]
            out = tl.sum(acc, axis=1)
            if HAS_BIAS:
                out += tl.load(b_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=r_ok)

    return _gemv_kernel


def launch_config(n: int, k: int, prologue: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, programs): programs 0 is one program per block of rows; more is
    RESIDENT (BLOCK_K >= K: that many programs walk the row blocks with the input kept in
    registers). An RMSNorm prologue over rows of up to 4096 keeps its input (it is worked out once
    a program instead of once a row block), four programs an SM; otherwise tiles of 16384 weights,
    up to 4096 along K, with at least a program per SM.
    scripts/bench_kernels.py --only gemv --sweep --shape qwen3-0.6b / qwen3-8b, H200, 2026-12-03"""
    sms = num_sms(device)
    if prologue == NORM and next_pow2(k) <= RESIDENT_MAX_K:
        block_k = next_pow2(k)
        return 4, block_k, 4 if 4 * block_k >= TILE else 8, 4 * sms
    block_k = min(next_pow2(k), RESIDENT_MAX_K)
    block_n = max(1, TILE // block_k)
    while block_n > 1 and -(-n // block_n) < sms:
        block_n //= 2
    return block_n, block_k, 8, 0


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prologue: int = IDENTITY,
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [1, N] = weight [N, K] @ prologue(x) for one row x ([1, K], or [1, 2K] = [gate | up] for
    SILU_MUL); with NORM and a residual, also the summed stream x + residual [1, K] (else None)."""
    n, k = weight.shape
    if x.shape[0] != 1 or x.shape[-1] != (2 * k if prologue == SILU_MUL else k):
        raise ValueError(f"gemv: input {tuple(x.shape)} does not fit weights {tuple(weight.shape)}")
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else None
    r = residual.contiguous() if residual is not None else x
    block_n, block_k, warps, programs = config or launch_config(n, k, prologue, x.device)
    if programs and block_k < k:
        raise ValueError(f"gemv: a resident input needs BLOCK_K >= K, got {block_k} < {k}")
    row_blocks = -(-n // block_n)
    _kernel()[(min(programs, row_blocks) if programs else row_blocks,)](
        x, r, norm_weight if norm_weight is not None else x, total if total is not None else x, weight,
        bias if bias is not None else weight, y, n, k, weight.stride(0), float(eps),
        PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, RESIDENT=programs > 0, num_warps=warps, **pdl_launch(y.device))
    return y, total
