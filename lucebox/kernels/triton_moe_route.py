"""A MoE router's choice of experts in one kernel (Triton): a token's logits -> its top-k expert ids
and their weights, where torch takes a cast, the scoring, top-k, a sum, a division and another cast
(six kernels a MoE layer, each a few microseconds at decode sizes). model/moe.Routing.choose is the
reference; kernels/moe.route_experts dispatches.

One program a token: logits [E] (any float dtype) in float32, soft-capped (softcap * tanh(x /
softcap)) where set, scored by softmax or sigmoid, the top k chosen by score (+ the selection bias,
where set) one after another (the highest first; ties to the lowest id), weighed by score,
renormalised to sum 1 where set, times a per-expert scale where given (Gemma 4), stored in the
caller's dtype. With a shared expert (Qwen 3.5 MoE), the logits row holds its gate logit after the
E experts' and the token gets a (k+1)-th route: expert id E, weight sigmoid(gate logit) (1 where the
shared expert is ungated), the routed weights times the routed scaling factor, so that the expert
kernels compute the shared expert as one more pair.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2, pdl_launch
from .triton_pdl import wait_for_previous_kernel


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, scale_ptr, ids_ptr, w_ptr, E, stride_l, softcap, routed_scale,
                  BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr,
                  SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr = False,
                  SHARED: tl.constexpr = 0, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0).to(tl.float32)
    if SOFTCAP:
        x = softcap * (2.0 / (1.0 + tl.exp(-2.0 * x / softcap)) - 1.0)  # softcap * tanh(x / softcap)
    if SOFTMAX:
        x = tl.where(ok, x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
    else:
        p = 1.0 / (1.0 + tl.exp(-x))
    key = p
    if HAS_BIAS:
        key = p + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(ok, key, float("-inf"))
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        at = tl.min(tl.where(key == best, e, BLOCK_E), axis=0)
        ids = tl.where(k == i, at.to(tl.int64), ids)
        weights = tl.where(k == i, tl.sum(tl.where(e == at, p, 0.0), axis=0), weights)
        key = tl.where(e == at, float("-inf"), key)
    if NORM:
        weights = weights / tl.sum(weights, axis=0)
    if SCALE:
        weights = weights * tl.load(scale_ptr + ids, mask=k < TOP_K, other=0.0).to(tl.float32)
    if SHARED:  # 1: ungated, 2: behind sigmoid(logit E)
        weights = weights * routed_scale
        ids = tl.where(k == TOP_K, E, ids)
        gate = 1.0
        if SHARED == 2:
            gate = 1.0 / (1.0 + tl.exp(-tl.load(logits_ptr + t * stride_l + E).to(tl.float32)))
        weights = tl.where(k == TOP_K, gate, weights)
    out_k = TOP_K + (SHARED > 0)
    tl.store(ids_ptr + t * out_k + k, ids, mask=k < out_k)
    tl.store(w_ptr + t * out_k + k, weights.to(w_ptr.dtype.element_ty), mask=k < out_k)


def route(logits: torch.Tensor, top_k: int, *, softmax: bool = True, softcap: float = 0.0,
          bias: torch.Tensor | None = None, norm: bool = True, dtype: torch.dtype = torch.float32,
          expert_scale: torch.Tensor | None = None, shared: str | None = None,
          routed_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64, weights [T, k] in `dtype`) of router logits [T, E] (see the module);
    expert_scale [E]: each chosen weight times its expert's entry, last. shared: "gated" (logits
    [T, E + 1], the last column the shared expert's gate) or "ungated": ids and weights [T, k + 1],
    route k the shared expert (id E), the routed weights times routed_scale."""
    tokens, columns = logits.shape
    shared_mode = {None: 0, "ungated": 1, "gated": 2}[shared]
    experts = columns - (shared_mode == 2)
    if not 0 < top_k <= experts:
        raise ValueError(f"top-{top_k} of {experts} experts")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out_k = top_k + (shared_mode > 0)
    ids = torch.empty(tokens, out_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(tokens, out_k, dtype=dtype, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, bias if bias is not None else logits, expert_scale if expert_scale is not None else logits, ids,
            weights, experts, logits.stride(0), float(softcap), float(routed_scale), BLOCK_E=max(16, next_pow2(experts)),
            TOP_K=top_k, BLOCK_K=max(2, next_pow2(out_k)), SOFTMAX=softmax, SOFTCAP=softcap > 0,
            HAS_BIAS=bias is not None, NORM=norm, SCALE=expert_scale is not None, SHARED=shared_mode,
            num_warps=4 if experts > 128 else 1, **pdl_launch(logits.device))
    return ids, weights
