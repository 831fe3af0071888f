"""Triton gated delta rule, token by token (reference and dispatch: kernels/gated_delta.py).

One program per (sequence, value head, block of BV value columns): it loads its [dk, BV] tile of
the state from the sequence's slot, steps the sequence's tokens (rows starts[b]..ends[b]-1) in
registers, writes each token's output, and stores the tile back after token advance[b] - 1 (a
masked store per token: no branch on device values). Slots, bounds and advance are read on the
device and the grid depends only on shapes, so a launch is the same inside a CUDA graph for any
lengths. GVA: value head h reads q/k head h // (Hv / Hk).
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, pdl_launch

# Value columns per program: a [dk, BV] float32 tile in registers (128 x 32 = 32 values a thread
# at 4 warps); design choice, not measured yet (scripts/check_deltanet_gpu.py times it).
BLOCK_V = 32


@functools.cache
def _kernel():
    """Defined on first use: importing this module must not import Triton (see triton_norm)."""
    global triton, tl, wait_for_previous_kernel
    import triton
    import triton.language as tl

    from .triton_pdl import wait_for_previous_kernel

    @triton.jit
    def _gated_delta_steps(q, k, v, g, beta, out, state, slots, starts, ends, advance,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                           stride_ot, stride_oh, stride_sn, stride_sh, stride_sk,
                           GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, OUTPUTS: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        cols = tl.program_id(2) * BV + tl.arange(0, BV)
        rows = tl.arange(0, BK)
        row_ok, col_ok = rows < DK, cols < DV
        tile_ok = row_ok[:, None] & col_ok[None, :]
        slot = tl.load(slots + b).to(tl.int64)
        first = tl.load(starts + b).to(tl.int64)
        last = tl.load(ends + b).to(tl.int64)
        keep = tl.load(advance + b).to(tl.int64)
        tile = state + slot * stride_sn + h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
        s = tl.load(tile, mask=tile_ok, other=0.0)
        kh = h // GROUP
        for t in range(first, last):
            k_t = tl.load(k + t * stride_kt + kh * stride_kh + rows, mask=row_ok, other=0.0).to(tl.float32)
            v_t = tl.load(v + t * stride_vt + h * stride_vh + cols, mask=col_ok, other=0.0).to(tl.float32)
            g_t = tl.load(g + t * stride_gt + h).to(tl.float32)
            beta_t = tl.load(beta + t * stride_bt + h).to(tl.float32)
            s = s * tl.exp(g_t)
            predicted = tl.sum(k_t[:, None] * s, axis=0)
            s = s + k_t[:, None] * ((v_t - predicted) * beta_t)[None, :]
            if OUTPUTS:
                q_t = tl.load(q + t * stride_qt + kh * stride_qh + rows, mask=row_ok, other=0.0).to(tl.float32)
                tl.store(out + t * stride_ot + h * stride_oh + cols, tl.sum(q_t[:, None] * s, axis=0), mask=col_ok)
            at = tl.zeros([BK, BV], dtype=tl.int64) + t  # the token index as a tile: a mask of the tile's shape
            tl.store(tile, s, mask=tile_ok & (at == first + keep - 1))

    return _gated_delta_steps


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"gated_delta_steps: {name} needs unit stride in its last dimension")
    return x


def gated_delta_steps_triton(q, k, v, g, beta, state, slots, starts, ends, advance,
                             outputs: bool = True) -> torch.Tensor | None:
    """kernels.gated_delta.gated_delta_steps on the Triton kernel (same contract)."""
    q = k if q is None else q  # a commit reads no q
    q, k, v = (_rows(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("gated_delta_steps: g and beta need unit stride per head")
    num_seqs, (v_heads, dk, dv) = slots.shape[0], state.shape[1:]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device) if outputs else None
    if num_seqs == 0:
        return out
    block_v = min(BLOCK_V, next_pow2(dv))
    o = out if outputs else state  # any tensor: never written without OUTPUTS
    _kernel()[(num_seqs, v_heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, o, state, slots, starts, ends, advance,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), state.stride(0), state.stride(1), state.stride(2),
        GROUP=v_heads // k.shape[1], DK=dk, DV=dv, BK=next_pow2(dk), BV=block_v, OUTPUTS=outputs,
        **pdl_launch(v.device))
    return out
