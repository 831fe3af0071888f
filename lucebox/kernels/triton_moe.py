"""Expert products of a sparse MoE layer (Triton): each routed (token, expert) pair multiplied by that
expert's weights read in place through its id, float or quantised GGUF rows (dequantised in
registers by triton_quant_matmul.unit_product, the code of the dense quantised kernels).

    act[r] = act(gate_e(x[t])) * up_e(x[t])         for pair r = t * top_k + j, e = ids[t, j]
    out[t] = sum_j weights[t, j] * down_e(act[r])

The gated activation `act` is a compile-time choice (ACTIVATIONS: silu, SwiGLU; gelu-tanh, Gemma
4's GeGLU). weights_on_input=True (Laguna, DeepSeek style) weighs each expert's input instead:
act[r] = act(gate_e(w x[t]), up_e(w x[t])), out[t] = sum_j down_e(act[r]); the products are linear,
so the gate_up kernels scale their float32 sums by w and the down kernels weigh by 1.

The stacked weights are [E, 2I, H] (gate rows, then up rows) and [E, H, I]: as 2-D rows, expert e's
output row n of gate_up is row e * 2I + n. Two products, two ways (kernels/moe.py picks):
  pairs   (decode: a few tokens) GEMV-style, weights x one row elementwise, one program per (pair,
          BLOCK_N rows[, split of K]); gate and up rows of the same features side by side, so act*up
          is the epilogue (or, split over K, of the kernel summing the splits); the down product's
          program walks a group of the token's experts and applies their routing weights, so the sum
          over top_k needs no pass of its own unless the experts are split over programs
          (reduce_splits then sums the groups, as the dense GEMVs' split-K). A shared expert of the
          experts' formats and sizes runs as one more pair: expert id E reads its own tensors.
  grouped (verify, prefill) pairs grouped by expert on the device (triton_moe_align) in blocks of
          BLOCK_M rows of one expert; a program multiplies one block by BLOCK_N rows of its expert
          with tl.dot, so each expert's weights are read once per block rather than once per pair;
          act*up fused as above, the weighted down rows summed per token by a small last kernel.
Rounding follows the unfused torch reference (model/moe.py): each product is rounded to x's dtype
before act*up, before its routing weight and before the sum; sums accumulate in float32 (a weight
on the input scales the float32 product, where the reference rounds w x to x's dtype first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2, num_sms, pdl_launch
from .moe import Shared, add_shared
from .triton_moe_align import align_by_expert, max_blocks
from .triton_one_row import reduce_splits
from .triton_pdl import wait_for_previous_kernel
from .triton_moe_stack import ACTIVATIONS, Stack, check_operands, check_shared_pair, consts, decode_launch
from .triton_moe_stack import float_stack, quant_stack  # noqa: F401  (re-exported: kernels/moe.py, tests)
from .triton_quant_matmul import unit_product

GELU_TANH_SCALE = tl.constexpr(2 * 0.7978845608028654)  # 2 sqrt(2 / pi): 0.5 (1 + tanh(y)) == sigmoid(2 y)


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _unit(acc, w_ptr, rows, row_len, u, n_units, K, xk,
          FMT: tl.constexpr, UNIT_BYTES: tl.constexpr, UNIT_VALUES: tl.constexpr, BPU: tl.constexpr,
          P: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """acc += W[rows, unit u] x[unit u] for rows [BLOCK_N] (int64) of the stacked 2-D weights. MODE 0:
    xk is x's row start, acc [BLOCK_N, P] elementwise; MODE 1: xk [1, BLOCK_M] row starts, acc
    [BLOCK_N, BLOCK_M] through tl.dot."""
    if FMT < 0:
        cols = u * P + tl.arange(0, P)
        ok = cols < K
        w = tl.load(w_ptr + rows[:, None] * row_len + cols[None, :], mask=ok[None, :], other=0.0)
        if MODE == 0:
            acc += w.to(tl.float32) * tl.load(xk + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
        else:
            xt = tl.load(xk + cols[:, None], mask=ok[:, None], other=0.0)
            if DOT_IEEE:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(xt.dtype), xt, acc)
    else:
        acc = unit_product(acc, w_ptr + rows[:, None] * row_len, u, n_units, xk + u * UNIT_VALUES, 0, BLOCK_M,
                           xk, rows, FMT, UNIT_BYTES, UNIT_VALUES, BPU, False, MODE, BLOCK_M, DOT_IEEE)
    return acc


@triton.jit
def _act_mul(gate, up, dt, ACT: tl.constexpr):
    """act(gate) * up rounded as the unfused ops round (each step to dt), in float32. ACT 0: silu;
    1: gelu-tanh, x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) (== 0.5 x (1 + tanh(...)))."""
    g = gate.to(dt).to(tl.float32)
    if ACT == 0:
        z = g
    else:
        z = GELU_TANH_SCALE * (g + 0.044715 * g * g * g)
    s = (g / (1.0 + tl.exp(-z))).to(dt).to(tl.float32)
    return (s * up.to(dt).to(tl.float32)).to(dt)


# ----------------------------------------------------------------------------- pairs (decode)

@triton.jit
def _expert_rows(w_ptr, s_ptr, expert, E, rows_each, SHARED_W: tl.constexpr):
    """(the weights holding expert `expert`, its first row there): expert E, with SHARED_W, is the
    shared expert, whose rows are their own tensor."""
    if SHARED_W:
        own = expert == E
        return tl.where(own, s_ptr, w_ptr), tl.where(own, 0, expert * rows_each)
    return w_ptr, expert * rows_each


@triton.jit
def _pairs_gate_up_kernel(x_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, o_ptr, E, I, K, row_len, n_units, units_per_prog,
                          stride_os, TOPK: tl.constexpr, FMT: tl.constexpr, UNIT_BYTES: tl.constexpr,
                          UNIT_VALUES: tl.constexpr, BPU: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
                          SPLIT: tl.constexpr, ACT: tl.constexpr, ON_INPUT: tl.constexpr,
                          SHARED_W: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    r = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + r).to(tl.int64)
    w_ptr, first = _expert_rows(w_ptr, s_ptr, expert, E, 2 * I, SHARED_W)
    gate = first + tl.minimum(rn, I - 1)  # rows past I re-read row I-1; dropped at the store
    xk = x_ptr + (r // TOPK).to(tl.int64) * K
    acc_g = tl.zeros([BLOCK_N, P], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, P], dtype=tl.float32)
    u0 = tl.program_id(2) * units_per_prog
    for u in range(u0, tl.minimum(u0 + units_per_prog, n_units)):
        acc_g = _unit(acc_g, w_ptr, gate, row_len, u, n_units, K, xk, FMT, UNIT_BYTES, UNIT_VALUES, BPU, P,
                      0, 1, False)
        acc_u = _unit(acc_u, w_ptr, gate + I, row_len, u, n_units, K, xk, FMT, UNIT_BYTES, UNIT_VALUES, BPU, P,
                      0, 1, False)
    ok = rn < I
    gate_sum, up_sum = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    if ON_INPUT:  # W (w x) == w (W x)
        w = tl.load(wts_ptr + r).to(tl.float32)
        gate_sum, up_sum = gate_sum * w, up_sum * w
    if SPLIT:  # float32 partials [splits, R, 2I], summed by _act_mul_splits_kernel
        out = o_ptr + tl.program_id(2) * stride_os + r * 2 * I + rn
        tl.store(out, gate_sum, mask=ok)
        tl.store(out + I, up_sum, mask=ok)
    else:
        tl.store(o_ptr + r * I + rn, _act_mul(gate_sum, up_sum, o_ptr.dtype.element_ty, ACT), mask=ok)


@triton.jit
def _act_mul_splits_kernel(part_ptr, o_ptr, R, I, splits, BLOCK: tl.constexpr, ACT: tl.constexpr,
                           PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < R * I
    at = (i // I) * 2 * I + i % I
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        gate += tl.load(part_ptr + s * R * 2 * I + at, mask=ok, other=0.0)
        up += tl.load(part_ptr + s * R * 2 * I + I + at, mask=ok, other=0.0)
    tl.store(o_ptr + i, _act_mul(gate, up, o_ptr.dtype.element_ty, ACT), mask=ok)


@triton.jit
def _pairs_down_kernel(a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, o_ptr, E, H, I, row_len, n_units, stride_os,
                       per_group, TOPK: tl.constexpr, FMT: tl.constexpr, UNIT_BYTES: tl.constexpr,
                       UNIT_VALUES: tl.constexpr, BPU: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
                       SHARED_W: tl.constexpr = False, PDL: tl.constexpr = False):
    """Token t's experts of group g (per_group of them) for BLOCK_N output features: their routing-
    weighted sum, the output itself with one group, else the group's float32 partial."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, H - 1)
    dt = a_ptr.dtype.element_ty
    res = tl.zeros([BLOCK_N], dtype=tl.float32)
    for jj in range(per_group):
        r = t * TOPK + tl.program_id(1) * per_group + jj
        base, first = _expert_rows(w_ptr, s_ptr, tl.load(ids_ptr + r).to(tl.int64), E, H, SHARED_W)
        acc = tl.zeros([BLOCK_N, P], dtype=tl.float32)
        for u in range(n_units):
            acc = _unit(acc, base, first + rows, row_len, u, n_units, I, a_ptr + r * I, FMT, UNIT_BYTES,
                        UNIT_VALUES, BPU, P, 0, 1, False)
        y = tl.sum(acc, axis=1).to(dt).to(tl.float32)
        res += (y * tl.load(wts_ptr + r).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(o_ptr + tl.program_id(1) * stride_os + t * H + rn, res.to(o_ptr.dtype.element_ty), mask=rn < H)


# ----------------------------------------------------------------------------- grouped (verify, prefill)

@triton.jit
def _grouped_gate_up_kernel(x_ptr, slots_ptr, block_expert_ptr, wts_ptr, w_ptr, o_ptr, R, I, K, row_len,
                            n_units, TOPK: tl.constexpr, FMT: tl.constexpr, UNIT_BYTES: tl.constexpr,
                            UNIT_VALUES: tl.constexpr, BPU: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr, ACT: tl.constexpr,
                            ON_INPUT: tl.constexpr, PDL: tl.constexpr = False):
    """act of block b's slots (sorted by expert; padding slots too, from a real token: never read)."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b).to(tl.int64)
    if expert >= 0:
        m = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slots_ptr + m)
        token = tl.minimum(pair, R - 1) // TOPK
        xk = (x_ptr + token.to(tl.int64) * K)[None, :]
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        gate = expert * 2 * I + tl.minimum(rn, I - 1)
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for u in range(n_units):
            acc_g = _unit(acc_g, w_ptr, gate, row_len, u, n_units, K, xk, FMT, UNIT_BYTES, UNIT_VALUES, BPU, P,
                          1, BLOCK_M, DOT_IEEE)
            acc_u = _unit(acc_u, w_ptr, gate + I, row_len, u, n_units, K, xk, FMT, UNIT_BYTES, UNIT_VALUES, BPU,
                          P, 1, BLOCK_M, DOT_IEEE)
        if ON_INPUT:  # W (w x) == w (W x); padding slots weigh 0
            w = tl.load(wts_ptr + pair, mask=pair < R, other=0.0).to(tl.float32)[None, :]
            acc_g, acc_u = acc_g * w, acc_u * w
        act = _act_mul(acc_g, acc_u, o_ptr.dtype.element_ty, ACT)
        tl.store(o_ptr + m.to(tl.int64)[None, :] * I + rn[:, None], act, mask=(rn < I)[:, None])


@triton.jit
def _grouped_down_kernel(a_ptr, slots_ptr, block_expert_ptr, wts_ptr, w_ptr, o_ptr, R, H, I, row_len, n_units,
                         FMT: tl.constexpr, UNIT_BYTES: tl.constexpr, UNIT_VALUES: tl.constexpr,
                         BPU: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         DOT_IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """Each pair's routing-weighted down row [R, H], for block b's slots."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b).to(tl.int64)
    if expert >= 0:
        m = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slots_ptr + m)
        ak = (a_ptr + m.to(tl.int64) * I)[None, :]
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = expert * H + tl.minimum(rn, H - 1)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for u in range(n_units):
            acc = _unit(acc, w_ptr, rows, row_len, u, n_units, I, ak, FMT, UNIT_BYTES, UNIT_VALUES, BPU, P,
                        1, BLOCK_M, DOT_IEEE)
        real = pair < R
        dt = o_ptr.dtype.element_ty
        weight = tl.load(wts_ptr + pair, mask=real, other=0.0).to(tl.float32)
        y = acc.to(dt).to(tl.float32) * weight[None, :]
        tl.store(o_ptr + pair.to(tl.int64)[None, :] * H + rn[:, None], y.to(dt),
                 mask=(rn < H)[:, None] & real[None, :])


@triton.jit
def _sum_top_k_kernel(p_ptr, o_ptr, total, H, TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out [T, H] = the sum over j of rows t * TOPK + j of p [T * TOPK, H], in float32, in order."""
    wait_for_previous_kernel(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    first = (i // H) * TOPK * H + i % H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(p_ptr + first + j * H, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_ptr + i, acc.to(o_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- host side

def _down_weights(weights: torch.Tensor, weights_on_input: bool) -> torch.Tensor:
    """The down products' routing weights: ones where the gate_up products applied them."""
    return torch.ones_like(weights) if weights_on_input else weights


def pairs_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Stack, down: Stack, *,
                  activation: str = "silu", weights_on_input: bool = False, block_n: int | None = None,
                  plane: int = 128, split_k: int | None = None, groups: int | None = None,
                  num_warps: int | None = None, shared: Shared | None = None,
                  shared_pair: tuple[Stack, Stack] | None = None) -> torch.Tensor:
    """out [T, H] of x [T, H] routed to ids / weights [T, k], GEMV-style (decode). activation: a key
    of ACTIVATIONS; weights_on_input: weigh each expert's input, not its output. split_k: the
    gate_up product's K split over programs; groups: the down product's top_k experts split over
    that many programs a token (a divisor of k); default: enough programs to fill the GPU. block_n,
    num_warps: both products' (default: per weight format). shared: the shared expert, combined
    where the groups are summed; shared_pair: the shared expert's (gate_up, down) stacks of one expert
    in the experts' formats, routed as expert id E (triton_moe_route's shared route)."""
    inter = check_operands(x, ids, weights, gate_up, down, activation)
    if shared_pair is not None:
        check_shared_pair(gate_up, down, *shared_pair)
    tokens, top_k = ids.shape
    hidden = x.shape[-1]
    pairs = tokens * top_k
    out = x.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.to(x.dtype).contiguous()
    gate_up, down = gate_up.with_plane(plane), down.with_plane(plane)
    shared_rows = (gate_up.rows, down.rows) if shared_pair is None else (shared_pair[0].rows, shared_pair[1].rows)
    launch = pdl_launch(x.device)
    waves = 8 * num_sms(x.device)
    block, warps = decode_launch(gate_up, block_n, num_warps)
    tiles = triton.cdiv(inter, block)
    if split_k is None:
        split_k = max(1, min(waves // (pairs * tiles), gate_up.n_units // 2))
    per = triton.cdiv(gate_up.n_units, max(1, min(split_k, gate_up.n_units)))
    split_k = triton.cdiv(gate_up.n_units, per)
    act = x.new_empty(pairs, inter)
    target = torch.empty(split_k, pairs, 2 * inter, dtype=torch.float32, device=x.device) if split_k > 1 else act
    act_id = ACTIVATIONS[activation]
    _pairs_gate_up_kernel[(pairs, tiles, split_k)](
        x, ids, weights, gate_up.rows, shared_rows[0], target, gate_up.experts, inter, hidden, gate_up.rows.shape[1],
        gate_up.n_units, per, pairs * 2 * inter, TOPK=top_k, BLOCK_N=block, SPLIT=split_k > 1, ACT=act_id,
        ON_INPUT=weights_on_input, SHARED_W=shared_pair is not None, num_warps=warps, **consts(gate_up), **launch)
    if split_k > 1:
        _act_mul_splits_kernel[(triton.cdiv(pairs * inter, 256),)](target, act, pairs, inter, split_k, BLOCK=256,
                                                                  ACT=act_id, **launch)
    block, warps = decode_launch(down, block_n, num_warps)
    tiles = triton.cdiv(hidden, block)
    if groups is None:
        wanted = triton.cdiv(waves, tokens * tiles)
        groups = max(g for g in range(1, top_k + 1) if top_k % g == 0 and g <= max(1, wanted))
    if top_k % groups:
        raise ValueError(f"pairs_experts: groups ({groups}) must divide top_k ({top_k})")
    target = torch.empty(groups, tokens, hidden, dtype=torch.float32, device=x.device) if groups > 1 else out
    _pairs_down_kernel[(tokens, groups, tiles)](
        act, ids, _down_weights(weights, weights_on_input), down.rows, shared_rows[1], target, down.experts, hidden,
        inter, down.rows.shape[1], down.n_units, tokens * hidden, top_k // groups, TOPK=top_k, BLOCK_N=block,
        SHARED_W=shared_pair is not None, num_warps=warps, **consts(down), **launch)
    if groups > 1:
        reduce_splits(target, None, out, None if shared is None else
                      Shared(shared.value.contiguous(), shared.gate, shared.scale))
    elif shared is not None:
        out = add_shared(out, shared)
    return out


def grouped_block_m(pairs: int, experts: int) -> int:
    """Rows a block of the grouped products: about the pairs an expert gets, 16 to 64."""
    return max(16, min(64, next_pow2(triton.cdiv(pairs, experts))))


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Stack, down: Stack, *,
                    activation: str = "silu", weights_on_input: bool = False, block_m: int | None = None,
                    block_n: int = 64, plane: int = 64, num_warps: int | None = None,
                    num_stages: int | None = None) -> torch.Tensor:
    """out [T, H] as pairs_experts, with the pairs grouped by expert on the device (verify, prefill)."""
    inter = check_operands(x, ids, weights, gate_up, down, activation)
    tokens, top_k = ids.shape
    hidden = x.shape[-1]
    pairs = tokens * top_k
    out = x.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    x, weights = x.contiguous(), weights.to(x.dtype).contiguous()
    gate_up, down = gate_up.with_plane(plane), down.with_plane(plane)
    block_m = block_m or grouped_block_m(pairs, gate_up.experts)
    slots, block_expert = align_by_expert(ids.reshape(-1), gate_up.experts, block_m)
    blocks = max_blocks(pairs, gate_up.experts, block_m)
    launch = pdl_launch(x.device)
    options = {"num_warps": num_warps or (8 if block_m >= 64 else 4)}
    if num_stages is not None:
        options["num_stages"] = num_stages
    dot_ieee = x.dtype == torch.float32
    act = x.new_empty(blocks * block_m, inter)  # in slot order
    _grouped_gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, slots, block_expert, weights, gate_up.rows, act, pairs, inter, hidden, gate_up.rows.shape[1],
        gate_up.n_units, TOPK=top_k, BLOCK_N=block_n, BLOCK_M=block_m, DOT_IEEE=dot_ieee,
        ACT=ACTIVATIONS[activation], ON_INPUT=weights_on_input, **consts(gate_up), **options, **launch)
    rows = x.new_empty(pairs, hidden)
    _grouped_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, slots, block_expert, _down_weights(weights, weights_on_input), down.rows, rows, pairs, hidden, inter, down.rows.shape[1], down.n_units,
        BLOCK_N=block_n, BLOCK_M=block_m, DOT_IEEE=dot_ieee, **consts(down), **options, **launch)
    block = 512
    _sum_top_k_kernel[(triton.cdiv(tokens * hidden, block),)](rows, out, tokens * hidden, hidden, TOPK=top_k,
                                                             BLOCK=block, **launch)
    return out
