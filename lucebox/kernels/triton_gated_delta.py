"""Triton gated delta rule, token by token, and the causal conv before it (reference and dispatch:
kernels/gated_delta.py).

One program per (sequence, value head, block of BV value columns): it loads its [dk, BV] tile of
the state from the sequence's slot, steps the sequence's tokens (rows starts[b]..ends[b]-1) in
registers, writes each token's output, and stores the tile back once, after token advance[b] - 1
(the token loop is split there; no branch reads a device value). Slots, bounds and advance are read
on the device and the grid depends only on shapes, so a launch is the same inside a CUDA graph for any
lengths. GVA: value head h reads q/k head h // (Hv / Hk). With NORMALIZE, q and k are the conv's
raw outputs and the kernel l2-normalises them (q also scaled), so no normalised copy is made.

The conv before it: triton_deltanet_conv.py.
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
    global triton, tl, wait_for_previous_kernel, store_rounded, _delta_update, _delta_output, _delta_step, _gate_row
    import triton
    import triton.language as tl

    from .triton_dp4a import store_rounded
    from .triton_pdl import wait_for_previous_kernel

    @triton.jit
    def _delta_update(s, t, k, v, g, beta, h, kh, rows, cols, row_ok, col_ok,
                      stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, NORMALIZE: tl.constexpr):
        """The state tile s after token t."""
        k_t = tl.load(k + t * stride_kt + kh * stride_kh + rows, mask=row_ok, other=0.0).to(tl.float32)
        if NORMALIZE:  # k / |k| (eps 1e-6, as kernels.gated_delta.l2_normalize)
            k_t = k_t * (1.0 / tl.sqrt(tl.sum(k_t * k_t, axis=0) + 1e-6))
        v_t = tl.load(v + t * stride_vt + h * stride_vh + cols, mask=col_ok, other=0.0).to(tl.float32)
        g_t = tl.load(g + t * stride_gt + h).to(tl.float32)
        beta_t = tl.load(beta + t * stride_bt + h).to(tl.float32)
        s = s * tl.exp(g_t)
        predicted = tl.sum(k_t[:, None] * s, axis=0)
        return s + k_t[:, None] * ((v_t - predicted) * beta_t)[None, :]

    @triton.jit
    def _delta_output(s, t, q, out, h, kh, rows, cols, row_ok, col_ok, stride_qt, stride_qh, stride_ot, stride_oh,
                      scale, NORMALIZE: tl.constexpr):
        """Token t's output from the state tile after it."""
        q_t = tl.load(q + t * stride_qt + kh * stride_qh + rows, mask=row_ok, other=0.0).to(tl.float32)
        if NORMALIZE:
            q_t = q_t * (scale / tl.sqrt(tl.sum(q_t * q_t, axis=0) + 1e-6))
        tl.store(out + t * stride_ot + h * stride_oh + cols, tl.sum(q_t[:, None] * s, axis=0), mask=col_ok)

    @triton.jit
    def _delta_step(s, t, q, k, v, g, beta, out, h, kh, rows, cols, row_ok, col_ok,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                    stride_ot, stride_oh, scale, OUTPUTS: tl.constexpr, NORMALIZE: tl.constexpr):
        """The state tile s after token t (and t's output written)."""
        s = _delta_update(s, t, k, v, g, beta, h, kh, rows, cols, row_ok, col_ok,
                          stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, NORMALIZE)
        if OUTPUTS:
            _delta_output(s, t, q, out, h, kh, rows, cols, row_ok, col_ok, stride_qt, stride_qh, stride_ot, stride_oh,
                          scale, NORMALIZE)
        return s

    @triton.jit
    def _gated_delta_steps(q, k, v, g, beta, out, state, slots, starts, ends, advance,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                           stride_ot, stride_oh, stride_sn, stride_sh, stride_sk,
                           scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, OUTPUTS: tl.constexpr, NORMALIZE: tl.constexpr,
                           PDL: tl.constexpr = False):
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
        # the first `keep` tokens, the tile stored after them (once), then the rest (a verify's drafts,
        # a graph bucket's padding): bounds are device values, so no branch depends on them
        split = tl.minimum(first + keep, last)
        for t in range(first, split):
            s = _delta_step(s, t, q, k, v, g, beta, out, h, kh, rows, cols, row_ok, col_ok,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                            stride_ot, stride_oh, scale, OUTPUTS, NORMALIZE)
        kept = tl.zeros([BV], dtype=tl.int64) + keep  # as a vector: masks want tensors
        tl.store(tile, s, mask=tile_ok & ((kept > 0) & (first + kept <= last))[None, :])
        for t in range(split, last):
            s = _delta_step(s, t, q, k, v, g, beta, out, h, kh, rows, cols, row_ok, col_ok,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                            stride_ot, stride_oh, scale, OUTPUTS, NORMALIZE)

    @triton.jit
    def _gate_row(a, b, a_log, dt_bias, g, beta, g_stash, beta_stash, stash_rows, t, heads, stride_a, stride_b,
                  BH: tl.constexpr, STASH: tl.constexpr):
        """Row t: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), float32; STASH: also at
        row stash_rows[t] of g_stash / beta_stash."""
        h = tl.arange(0, BH)
        ok = h < heads
        x = tl.load(a + t * stride_a + h, mask=ok, other=0.0).to(tl.float32) + tl.load(
            dt_bias + h, mask=ok, other=0.0).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
        decay = -tl.exp(tl.load(a_log + h, mask=ok, other=0.0).to(tl.float32)) * softplus
        y = tl.load(b + t * stride_b + h, mask=ok, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-y))
        tl.store(g + t * heads + h, decay, mask=ok)
        tl.store(beta + t * heads + h, sig, mask=ok)
        if STASH:
            at = tl.load(stash_rows + t).to(tl.int64) * heads + h
            tl.store(g_stash + at, decay, mask=ok)
            tl.store(beta_stash + at, sig, mask=ok)

    @triton.jit
    def _gates(a, b, a_log, dt_bias, g, beta, g_stash, beta_stash, stash_rows, heads, stride_a, stride_b,
               BH: tl.constexpr, STASH: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        _gate_row(a, b, a_log, dt_bias, g, beta, g_stash, beta_stash, stash_rows, tl.program_id(0).to(tl.int64),
                  heads, stride_a, stride_b, BH, STASH)

    @triton.jit
    def _gated_norm(x, gate, weight, out, q_ptr, src_heads, size, heads, eps, stride_x, stride_g, stride_o,
                    stride_q, BN: tl.constexpr, ROUND: tl.constexpr = False, REORDER: tl.constexpr = False,
                    PDL: tl.constexpr = False):
        """Row r: rms_norm(x) * weight * silu(gate), rounded where the torch reference rounds (x and
        the normalised row to out's dtype, weight * normalised too). Row r is head r % heads of token
        r // heads; REORDER: it normalises head src_heads[r % heads] of that token instead. ROUND: the
        token's output row [heads * size] is rounded to int8 as well (store_rounded's packed rows at
        q_ptr; size a multiple of 32, BN == size)."""
        wait_for_previous_kernel(PDL)
        r = tl.program_id(0).to(tl.int64)
        src = r
        if REORDER:
            src = (r // heads) * heads + tl.load(src_heads + r % heads).to(tl.int64)
        cols = tl.arange(0, BN)
        ok = cols < size
        ty = out.dtype.element_ty
        v = tl.load(x + src * stride_x + cols, mask=ok, other=0.0).to(ty).to(tl.float32)
        normed = (v * (1.0 / tl.sqrt(tl.sum(v * v, axis=0) / size + eps))).to(ty)
        scaled = (tl.load(weight + cols, mask=ok, other=0.0).to(ty) * normed).to(tl.float32)
        z = tl.load(gate + src * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        h = (scaled * (z / (1.0 + tl.exp(-z)))).to(ty)
        tl.store(out + r * stride_o + cols, h, mask=ok)
        if ROUND:
            b = (r % heads) * (BN // 32) + tl.arange(0, BN // 32)
            store_rounded(q_ptr + (r // heads) * stride_q, tl.reshape(h.to(tl.float32), [BN // 32, 32]), b,
                          b < heads * (BN // 32), heads * (BN // 32))

    @triton.jit
    def _gated_delta_tree(q, k, v, g, beta, out, state, slots, starts, seq, masks, run_end, advance,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                          stride_ot, stride_oh, stride_sn, stride_sh, stride_sk,
                          scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
        """Row t, when it starts a run (run_end[t] >= 0): the slot's [dk, BV] tile stepped over t's
        ancestors (bit i of masks[t]; -1: every earlier row), then over rows t..run_end[t] in order,
        each one's output stored; the tile written back after row advance - 1 of an advancing
        sequence. Other rows' programs do nothing (the grid stays one program per row)."""
        wait_for_previous_kernel(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        cols = tl.program_id(2) * BV + tl.arange(0, BV)
        rows = tl.arange(0, BK)
        row_ok, col_ok = rows < DK, cols < DV
        last = tl.load(run_end + t).to(tl.int64)
        live = last >= 0
        starts_run = (tl.zeros([BV], dtype=tl.int64) + last) >= 0  # as a vector: masks want tensors
        tile_ok = row_ok[:, None] & (col_ok & starts_run)[None, :]
        b = tl.load(seq + t)
        first = tl.load(starts + b).to(tl.int64)
        slot = tl.load(slots + b).to(tl.int64)
        bits = tl.load(masks + t)
        keep = tl.zeros([BV], dtype=tl.int64) + tl.load(advance + b).to(tl.int64)  # as a vector: masks want tensors
        tile = state + slot * stride_sn + h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
        s = tl.load(tile, mask=tile_ok, other=0.0)
        kh = h // GROUP
        for r in range(first, tl.where(live, last + 1, first)):
            i = r - first
            on_path = (r >= t) | (bits == -1) | (((bits >> tl.minimum(i, 63)) & 1) == 1)
            if on_path:  # an ancestor of t, or a row of its run
                s = _delta_update(s, r, k, v, g, beta, h, kh, rows, cols, row_ok, col_ok,
                                  stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, NORMALIZE)
                if r >= t:
                    _delta_output(s, r, q, out, h, kh, rows, cols, row_ok, col_ok, stride_qt, stride_qh,
                                  stride_ot, stride_oh, scale, NORMALIZE)
                    tl.store(tile, s, mask=tile_ok & (keep == i + 1)[None, :])

    return _gated_delta_steps, _gates, _gated_norm, _gated_delta_tree


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"gated_delta_steps: {name} needs unit stride in its last dimension")
    return x


def gated_delta_steps_triton(q, k, v, g, beta, state, slots, starts, ends, advance, outputs: bool = True,
                             normalize: bool = False, scale: float = 1.0) -> torch.Tensor | None:
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
    kernel = _kernel()[0]
    kernel[(num_seqs, v_heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, o, state, slots, starts, ends, advance,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), state.stride(0), state.stride(1), state.stride(2), float(scale),
        GROUP=v_heads // k.shape[1], DK=dk, DV=dv, BK=next_pow2(dk), BV=block_v, OUTPUTS=outputs,
        NORMALIZE=normalize, **pdl_launch(v.device))
    return out


def gated_delta_tree_triton(q, k, v, g, beta, state, slots, starts, seq, masks, advance, run_end,
                            normalize: bool = False, scale: float = 1.0) -> torch.Tensor:
    """kernels.gated_delta_tree.gated_delta_tree on the Triton kernel (same contract)."""
    q, k, v = (_rows(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("gated_delta_tree: g and beta need unit stride per head")
    tokens, (v_heads, dk, dv) = v.shape[0], state.shape[1:]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if tokens == 0:
        return out
    block_v = min(BLOCK_V, next_pow2(dv))
    kernel = _kernel()[3]
    kernel[(tokens, v_heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, out, state, slots, starts, seq, masks, run_end, advance,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2), float(scale),
        GROUP=v_heads // k.shape[1], DK=dk, DV=dv, BK=next_pow2(dk), BV=block_v, NORMALIZE=normalize,
        **pdl_launch(v.device))
    return out


def gate_outputs(a, b, stash=None) -> tuple:
    """(g, beta, g_stash, beta_stash, stash rows) for a launch of _gate_row over a and b [T, Hv]: the
    outputs allocated, the stash checked (without one, the outputs stand in for it, never written)."""
    tokens, heads = a.shape
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("gates: a and b need unit stride per head")
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    g_stash, beta_stash, rows = stash if stash is not None else (g, beta, g)
    if stash is not None and not (g_stash.dtype == beta_stash.dtype == torch.float32
                                  and g_stash.stride() == beta_stash.stride() == (heads, 1)):
        raise ValueError("gates: the stash takes float32 rows of one entry a head")
    return g, beta, g_stash, beta_stash, rows


def gates_triton(a, b, a_log, dt_bias, stash=None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.gated_delta.gates on the Triton kernel (same contract)."""
    tokens, heads = a.shape
    g, beta, g_stash, beta_stash, rows = gate_outputs(a, b, stash)
    if tokens:
        kernel = _kernel()[1]
        kernel[(tokens,)](a, b, a_log, dt_bias, g, beta, g_stash, beta_stash, rows, heads, a.stride(0), b.stride(0),
                          BH=next_pow2(heads), STASH=stash is not None, **pdl_launch(a.device))
    return g, beta


def gated_rms_norm_triton(x, gate, weight, eps: float, dtype: torch.dtype, rounded: bool = False,
                          head_order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.gated_delta.gated_rms_norm on the Triton kernel, as (out, None); rounded: x [T,
    heads, size] with size a power of two from 32, and the second item is out's token rows [T,
    heads * size] rounded to int8 (triton_dp4a.quantize_rows' packing) by the same launch.
    head_order [heads]: output head j of a token is its head head_order[j] normalised."""
    size = x.shape[-1]
    x2, g2 = x.reshape(-1, size), gate.reshape(-1, size)
    if x2.stride(1) != 1 or g2.stride(1) != 1:
        raise ValueError("gated_rms_norm: x and gate need unit stride per row")
    heads = x.shape[-2] if rounded or head_order is not None else 1
    if head_order is not None and (x.dim() != 3 or tuple(head_order.shape) != (heads,)):
        raise ValueError(f"gated_rms_norm: a head order of {tuple(head_order.shape)} for rows {tuple(x.shape)}")
    if rounded and (x.dim() != 3 or size < 32 or size != next_pow2(size) or heads * size % 256):
        raise ValueError(f"gated_rms_norm: rows of {tuple(x.shape)} cannot be rounded to int8 per token")
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    packed = None
    if rounded:
        from .triton_dp4a import rounded_rows_like
        packed = rounded_rows_like(out.view(x.shape[0], heads * size))
    q = packed if packed is not None else out
    if x2.shape[0]:
        kernel = _kernel()[2]
        kernel[(x2.shape[0],)](x2, g2, weight, out, q, head_order if head_order is not None else x2, size, heads,
                               float(eps), x2.stride(0), g2.stride(0), out.stride(0), q.stride(0), BN=next_pow2(size),
                               ROUND=rounded, REORDER=head_order is not None, **pdl_launch(x.device))
    return out.view(x.shape), packed
