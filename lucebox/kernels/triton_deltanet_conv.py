"""Triton causal depthwise conv (+ silu) of DeltaNet's decode / verify rows, and the move of each
advancing sequence's conv window (references and dispatch: kernels/gated_delta.py).

Two launch shapes:
- by row (`conv_steps_triton`): one program per (row, block of channels) sums the kernel's taps
  over the row's inputs -- earlier rows of its sequence (a tree row: its ancestors), or the slot's
  window for inputs before the step; a second launch then moves the windows, once every row has
  read the old ones. Any number of rows a sequence (a prefill graph bucket stepping token by token).
- by sequence (`conv_gate_steps_triton`, short steps: decode and verify): one program per
  (sequence, block of channels) convolves the sequence's rows in order and then moves those
  columns of its window itself -- it alone reads and writes them -- and the first block's program
  also writes the rows' decay g and beta (triton_gated_delta's gates): one launch for all three.
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, pdl_launch

BLOCK_C = 256  # conv channels per program (design choice, not measured)
# Rows a sequence up to which the one-launch form runs: a program steps its sequence's rows one
# after another, so long steps spread over the by-row grid instead (design choice, not measured).
SEQ_ROWS_MAX = 32


@functools.cache
def _kernel():
    """Defined on first use: importing this module must not import Triton (see triton_norm)."""
    global triton, tl, wait_for_previous_kernel, _gate_row, _conv_row, _window_move
    import triton
    import triton.language as tl

    from . import triton_gated_delta
    from .triton_pdl import wait_for_previous_kernel
    triton_gated_delta._kernel()
    _gate_row = triton_gated_delta._gate_row

    @triton.jit
    def _conv_row(qkv, conv, weight, out, parents, depths, stash_raw, stash_mixed, t, j, slot, cols, ok,
                  stride_xt, stride_cn, stride_cc, stride_ot, stride_st, positions,
                  KERNEL: tl.constexpr, BC: tl.constexpr, STASH: tl.constexpr, TREE: tl.constexpr):
        """Row t (index j in its sequence): silu of the causal depthwise conv over its inputs, the ones
        before the step read from the slot's window; with STASH, the raw and convolved rows kept at
        stash row slot * positions + j. TREE: the inputs are t's ancestors (parents[t], ...), the
        window below depth depths[t]."""
        d = j  # inputs of t's own path before it
        if TREE:
            d = tl.load(depths + t).to(tl.int64)
        at = tl.zeros([BC], dtype=tl.int64) + d  # as a vector for masks
        acc = tl.zeros([BC], dtype=tl.float32)
        row = t  # the input `back` steps up t's path (TREE: its back-th ancestor)
        for back in tl.static_range(KERNEL):
            w = KERNEL - 1 - back
            if back > 0:
                if TREE:
                    row = tl.load(parents + tl.maximum(row, 0)).to(tl.int64)
                else:
                    row = t - back
            x_row = tl.load(qkv + tl.maximum(row, 0) * stride_xt + cols, mask=ok & (at >= back), other=0.0)
            x_old = tl.load(conv + slot * stride_cn + cols * stride_cc + (KERNEL - 1 + d - back),
                            mask=ok & (at < back), other=0.0)
            x = x_row.to(tl.float32) + x_old.to(tl.float32)
            acc += tl.load(weight + cols * KERNEL + w, mask=ok, other=0.0).to(tl.float32) * x
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(out + t * stride_ot + cols, y.to(out.dtype.element_ty), mask=ok)
        if STASH:
            keep = ok & ((tl.zeros([BC], dtype=tl.int64) + j) < positions)  # by index, as stash_rows: not depth
            stash_row = slot * positions + j
            raw = tl.load(qkv + t * stride_xt + cols, mask=ok, other=0.0)
            tl.store(stash_raw + stash_row * stride_st + cols, raw.to(tl.float32), mask=keep)
            tl.store(stash_mixed + stash_row * stride_st + cols, y.to(out.dtype.element_ty).to(tl.float32), mask=keep)

    @triton.jit
    def _window_move(qkv, conv, slot, first, advance, cols, ok, stride_xt, stride_cn, stride_cc,
                     WIDTH: tl.constexpr, WP: tl.constexpr):
        """With n = advance > 0: these columns of the slot's window become the WIDTH inputs ending at
        the sequence's row n - 1 (older ones from the window itself), all loaded before any store."""
        i = tl.arange(0, WP)
        n = tl.zeros([WP], dtype=tl.int64) + advance  # as a vector, for masks
        back = WIDTH - 1 - i  # window column i is input n - 1 - back of the sequence
        live = i < WIDTH
        base = conv + slot * stride_cn + cols[:, None] * stride_cc
        x_row = tl.load(qkv + (first + n - 1 - back)[None, :] * stride_xt + cols[:, None],
                        mask=ok[:, None] & (live & (n > back))[None, :], other=0.0)
        x_old = tl.load(base + (n + i)[None, :], mask=ok[:, None] & (live & (n <= back))[None, :], other=0.0)
        values = x_row.to(tl.float32) + x_old
        tl.store(base + i[None, :], values, mask=ok[:, None] & (live & (n > 0))[None, :])

    @triton.jit
    def _conv_steps(qkv, conv, weight, out, slots, seq, local, stash_raw, stash_mixed, parents, depths, channels,
                    stride_xt, stride_cn, stride_cc, stride_ot, stride_st, positions,
                    KERNEL: tl.constexpr, BC: tl.constexpr, STASH: tl.constexpr, TREE: tl.constexpr,
                    PDL: tl.constexpr = False):
        """Row program_id(0), channels of block program_id(1)."""
        wait_for_previous_kernel(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        slot = tl.load(slots + tl.load(seq + t)).to(tl.int64)
        _conv_row(qkv, conv, weight, out, parents, depths, stash_raw, stash_mixed, t, tl.load(local + t).to(tl.int64),
                  slot, cols, cols < channels, stride_xt, stride_cn, stride_cc, stride_ot, stride_st, positions,
                  KERNEL, BC, STASH, TREE)

    @triton.jit
    def _conv_windows(qkv, conv, slots, starts, advance, channels, stride_xt, stride_cn, stride_cc,
                      WIDTH: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
        """Sequence program_id(0)'s window, channels of block program_id(1)."""
        wait_for_previous_kernel(PDL)
        b = tl.program_id(0)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        _window_move(qkv, conv, tl.load(slots + b).to(tl.int64), tl.load(starts + b).to(tl.int64),
                     tl.load(advance + b).to(tl.int64), cols, cols < channels, stride_xt, stride_cn, stride_cc,
                     WIDTH, WP)

    @triton.jit
    def _conv_gate_steps(qkv, conv, weight, out, slots, starts, ends, advance, stash_raw, stash_mixed, parents,
                         depths, channels, stride_xt, stride_cn, stride_cc, stride_ot, stride_st, positions,
                         a, b, a_log, dt_bias, g, beta, g_stash, beta_stash, stash_rows, heads, stride_a, stride_b,
                         KERNEL: tl.constexpr, WIDTH: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
                         STASH: tl.constexpr, TREE: tl.constexpr, BH: tl.constexpr, GATE_STASH: tl.constexpr,
                         PDL: tl.constexpr = False):
        """Sequence program_id(0)'s rows, channels of block program_id(1): each row's conv, then the
        window's move; block 0's program also writes the rows' g and beta."""
        wait_for_previous_kernel(PDL)
        s = tl.program_id(0)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = cols < channels
        slot = tl.load(slots + s).to(tl.int64)
        first = tl.load(starts + s).to(tl.int64)
        last = tl.load(ends + s).to(tl.int64)
        for t in range(first, last):
            _conv_row(qkv, conv, weight, out, parents, depths, stash_raw, stash_mixed, t, t - first, slot, cols, ok,
                      stride_xt, stride_cn, stride_cc, stride_ot, stride_st, positions, KERNEL, BC, STASH, TREE)
        tl.debug_barrier()  # every thread's reads of the old window before any thread moves it
        _window_move(qkv, conv, slot, first, tl.load(advance + s).to(tl.int64), cols, ok, stride_xt, stride_cn,
                     stride_cc, WIDTH, WP)
        if tl.program_id(1) == 0:
            for t in range(first, last):
                _gate_row(a, b, a_log, dt_bias, g, beta, g_stash, beta_stash, stash_rows, t, heads, stride_a, stride_b,
                          BH, GATE_STASH)

    return _conv_steps, _conv_windows, _conv_gate_steps


def _check(qkv, conv, weight=None) -> None:
    if qkv.stride(1) != 1 or conv.stride(2) != 1 or (weight is not None and not weight.is_contiguous()):
        raise ValueError("conv_steps: qkv rows, conv windows and the weight need unit stride")


def conv_steps_triton(qkv, conv, weight, slots, starts, advance, seq, local, stash=None,
                      positions: int = 0, tree=None) -> torch.Tensor:
    """kernels.gated_delta.conv_steps on the by-row kernels (same contract)."""
    _check(qkv, conv, weight)
    tokens, channels = qkv.shape
    out = torch.empty_like(qkv)
    block = min(BLOCK_C, next_pow2(channels))
    raw, mixed = stash if stash is not None else (conv, conv)  # never written without STASH
    parents, depths = tree[:2] if tree is not None else (local, local)  # never read without TREE
    if tokens:
        kernel = _kernel()[0]
        kernel[(tokens, triton.cdiv(channels, block))](
            qkv, conv, weight, out, slots, seq, local, raw, mixed, parents, depths, channels,
            qkv.stride(0), conv.stride(0), conv.stride(1), out.stride(0), raw.stride(0), positions,
            KERNEL=weight.shape[1], BC=block, STASH=stash is not None, TREE=tree is not None,
            **pdl_launch(qkv.device))
    conv_windows_triton(qkv, conv, slots, starts, advance)
    return out


def conv_windows_triton(rows, conv, slots, starts, advance) -> None:
    """kernels.gated_delta.conv_windows on the Triton kernel (same contract)."""
    _check(rows, conv)
    channels, width = conv.shape[1:]
    block = min(BLOCK_C, next_pow2(channels))
    if slots.shape[0]:
        kernel = _kernel()[1]
        kernel[(slots.shape[0], triton.cdiv(channels, block))](
            rows, conv, slots, starts, advance, channels, rows.stride(0), conv.stride(0), conv.stride(1),
            WIDTH=width, WP=next_pow2(width), BC=block, **pdl_launch(rows.device))


def conv_gate_steps_triton(qkv, a, b, conv, weight, a_log, dt_bias, slots, starts, ends, advance, local,
                           stash=None, positions: int = 0, tree=None, gate_stash=None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.gated_delta.conv_gate_steps on the by-sequence kernel, one launch (same contract)."""
    from .triton_gated_delta import gate_outputs

    _check(qkv, conv, weight)
    channels, heads = qkv.shape[1], a.shape[1]
    out = torch.empty_like(qkv)
    g, beta, g_stash, beta_stash, stash_rows = gate_outputs(a, b, gate_stash)
    block = min(BLOCK_C, next_pow2(channels))
    raw, mixed = stash if stash is not None else (conv, conv)  # never written without STASH
    parents, depths = tree[:2] if tree is not None else (local, local)  # never read without TREE
    if slots.shape[0]:
        kernel = _kernel()[2]
        kernel[(slots.shape[0], triton.cdiv(channels, block))](
            qkv, conv, weight, out, slots, starts, ends, advance, raw, mixed, parents, depths, channels,
            qkv.stride(0), conv.stride(0), conv.stride(1), out.stride(0), raw.stride(0), positions,
            a, b, a_log, dt_bias, g, beta, g_stash, beta_stash, stash_rows, heads, a.stride(0), b.stride(0),
            KERNEL=weight.shape[1], WIDTH=conv.shape[2], WP=next_pow2(conv.shape[2]), BC=block,
            STASH=stash is not None, TREE=tree is not None, BH=next_pow2(heads), GATE_STASH=gate_stash is not None, **pdl_launch(qkv.device))
    return out, g, beta
