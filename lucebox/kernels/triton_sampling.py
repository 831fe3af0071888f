"""Triton sampling and acceptance for a CUDA-graph step: spec.verify.accept_in_graph in two launches
(the reference there is ~30 torch kernels, a full-vocabulary sort among them).

One program per logits row computes everything its row can decide alone:
  - the row's kept set: temperature, then top-k, top-p over the top-k set, min-p, as the Sampler
    does, but without sorting: each filter is a threshold on the scaled logit x, found by bisection
    over the float's bits (32 counting passes for top-k, 32 mass passes for top-p; only rows with
    the filter on pay them), so "kept" is x >= threshold. A top-k row (k <= BLOCK) first lists its
    candidates in one pass over the row: the tokens at or above the k-th largest of its lanes'
    maxima (each of BLOCK lanes has seen every BLOCK-th token), a lower bound of the k-th largest
    x; the searches and the draw then pass over that list (usually a few times k tokens), not the
    vocabulary. Ties at the bound that overflow the list (BLOCK entries) fall back to the row;
  - whether the row's draft d is accepted (u < p(d): a deterministic draft is one-hot q);
  - a candidate token: drawn from p without d (the residual after rejecting d), from p on a row
    without a draft, by Gumbel-max (argmax of x - log E over the kept tokens, E = -log U).
Greedy rows accept while d is the argmax and offer the argmax. A second launch, one program per
sequence, takes the first row not accepted: (drafts accepted, that row's candidate). Drawing a
candidate on every row, not only the chosen one, keeps the rows independent; each candidate uses
its own noise, so the committed token is still distributed as the residual of the row that
rejected (or p at the bonus row) -- sampling from the target alone.

The noise is counter-based (Philox, tl.rand): a seed read from device memory, which the host
changes every step, and the token's (row, column) as the counter; the draft's uniform uses the
next seed. Top-p ties differ from the sort-based reference: tokens tied at the cut are all kept
(kept iff the mass strictly above the token is below top_p), where a sort keeps an arbitrary part.
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, pdl_launch

BLOCK = 1024


@functools.cache
def _kernels():
    """Defined on first use: importing this module must not import Triton (see triton_norm)."""
    # the kernels look their helpers up among the module globals
    global triton, tl, _key, _value, _scaled, wait_for_previous_kernel
    import triton
    import triton.language as tl

    from .triton_pdl import wait_for_previous_kernel

    @triton.jit
    def _key(x):
        """float32 -> int32 in the same order (negative floats have their magnitude bits flipped)."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _value(key):
        """The inverse of _key, for an int64 key in int32 range."""
        b = key.to(tl.int32)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _scaled(base, cols, vocab, temperature):
        # IEEE division (a plain / may compile to an approximate one): the same x as torch's logits / T
        return tl.div_rn(tl.load(base + cols, mask=cols < vocab, other=float("-inf")), temperature)

    @triton.jit
    def _row_kernel(logits, stride, draft, argmax, temperature, top_k, top_p, min_p, greedy, seed_ptr,
                    accepted, candidate, kept_from, listed_logits, listed_cols, vocab, query_len,
                    BLOCK: tl.constexpr, LISTING: tl.constexpr = True, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        seq = row // query_len
        d = tl.load(draft + row)
        top = tl.load(argmax + row)
        if tl.load(greedy + seq) != 0:
            tl.store(accepted + row, ((d >= 0) & (d == top)).to(tl.int8))
            tl.store(candidate + row, top)
            tl.store(kept_from + row, float("inf"))  # nothing is drawn
        else:
            temp = tl.load(temperature + seq)
            k = tl.load(top_k + seq)
            p = tl.load(top_p + seq)
            mp = tl.load(min_p + seq)
            seed = tl.load(seed_ptr)
            base = logits + row.to(tl.int64) * stride
            offs = tl.arange(0, BLOCK)
            hi_acc = tl.full([BLOCK], float("-inf"), tl.float32)
            lo_acc = tl.full([BLOCK], float("inf"), tl.float32)
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                x = _scaled(base, cols, vocab, temp)
                hi_acc = tl.maximum(hi_acc, x)
                lo_acc = tl.minimum(lo_acc, tl.where(cols < vocab, x, float("inf")))
            m = tl.max(hi_acc, 0)
            threshold = tl.min(lo_acc, 0)  # every token kept so far
            # The passes below run over `length` logits at `src`: the row, or the top-k candidates
            # listed in one pass (then every search is a pass over at most BLOCK values, not the row).
            src, length, listed = base, vocab, False
            if LISTING:  # (nested: `and` would mix the constexpr with a runtime value)
                if (k < vocab) & (k <= BLOCK):
                    # The k-th largest lane maximum bounds the k-th largest x from below.
                    lo = _key(threshold).to(tl.int64)
                    hi = _key(m).to(tl.int64) + 1
                    for _ in range(32):
                        mid = lo + (hi - lo) // 2
                        enough = tl.sum((hi_acc >= _value(mid)).to(tl.int32), 0) >= k
                        lo = tl.where(enough, mid, lo)
                        hi = tl.where(enough, hi, mid)
                    bound = _value(lo)
                    listed_row = listed_logits + row.to(tl.int64) * BLOCK
                    n = 0
                    for start in range(0, vocab, BLOCK):
                        cols = start + offs
                        raw = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
                        keep = (cols < vocab) & (tl.div_rn(raw, temp) >= bound)
                        at = n + tl.cumsum(keep.to(tl.int32), 0) - 1
                        tl.store(listed_row + at, raw, mask=keep & (at < BLOCK))
                        tl.store(listed_cols + row.to(tl.int64) * BLOCK + at, cols, mask=keep & (at < BLOCK))
                        n += tl.sum(keep.to(tl.int32), 0)
                    if n <= BLOCK:  # else (ties at the bound) the passes read the whole row
                        src, length, listed = listed_row, n, True
            if k < vocab:  # the k-th largest x: the largest t with count(x >= t) >= k
                lo = _key(threshold).to(tl.int64)  # count = length >= k
                hi = _key(m).to(tl.int64) + 1  # count = 0 < k
                for _ in range(32):
                    mid = lo + (hi - lo) // 2
                    t = _value(mid)
                    count = tl.zeros([BLOCK], tl.int32)
                    for start in range(0, length, BLOCK):
                        cols = start + offs
                        count += (_scaled(src, cols, length, temp) >= t).to(tl.int32)
                    enough = tl.sum(count, 0) >= k
                    lo = tl.where(enough, mid, lo)
                    hi = tl.where(enough, hi, mid)
                threshold = _value(lo)
            if p < 1.0:  # keep x iff the top-k mass strictly above x is below top_p of the top-k mass
                mass = tl.zeros([BLOCK], tl.float32)
                for start in range(0, length, BLOCK):
                    x = _scaled(src, start + offs, length, temp)
                    mass += tl.where(x >= threshold, tl.exp(x - m), 0.0)
                target = p * tl.sum(mass, 0)
                lo = _key(threshold).to(tl.int64) - 1  # mass above = all of it >= target
                hi = _key(m).to(tl.int64)  # mass above the max = 0 < target
                for _ in range(32):
                    mid = lo + (hi - lo) // 2
                    t = _value(mid)
                    above = tl.zeros([BLOCK], tl.float32)
                    for start in range(0, length, BLOCK):
                        x = _scaled(src, start + offs, length, temp)
                        above += tl.where((x > t) & (x >= threshold), tl.exp(x - m), 0.0)
                    below = tl.sum(above, 0) < target
                    lo = tl.where(below, lo, mid)
                    hi = tl.where(below, mid, hi)
                threshold = tl.maximum(threshold, _value(hi))
            if mp > 0.0:
                threshold = tl.maximum(threshold, m + tl.log(mp))
            tl.store(kept_from + row, threshold)
            # The kept mass, and the Gumbel-max draw over the kept tokens other than the draft.
            mass = tl.zeros([BLOCK], tl.float32)
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            best_col = tl.zeros([BLOCK], tl.int64)
            for start in range(0, length, BLOCK):
                i = start + offs
                x = _scaled(src, i, length, temp)
                cols = tl.where(listed, tl.load(listed_cols + row.to(tl.int64) * BLOCK + i,
                                                mask=listed & (i < length), other=0), i)
                keep = (i < length) & (x >= threshold)
                mass += tl.where(keep, tl.exp(x - m), 0.0)
                u = tl.rand(seed, row * vocab + cols)
                score = tl.where(keep & (cols != d), x - tl.log(-tl.log(u)), float("-inf"))
                better = score > best
                best = tl.where(better, score, best)
                best_col = tl.where(better, cols.to(tl.int64), best_col)
            top_score = tl.max(best, 0)
            # the lowest column among equal best scores: a deterministic pick
            pick = tl.min(tl.where(best == top_score, best_col, vocab), 0)
            has_draft = d >= 0
            x_d = tl.div_rn(tl.load(base + tl.maximum(d, 0)), temp)
            p_d = tl.where(has_draft & (x_d >= threshold), tl.exp(x_d - m) / tl.sum(mass, 0), 0.0)
            u_d = tl.rand(seed + 1, row)
            tl.store(accepted + row, (has_draft & (u_d < p_d)).to(tl.int8))
            # Only the draft kept: rejecting it has probability 0; the draw falls back to p (= d).
            tl.store(candidate + row, tl.where(top_score > float("-inf"), pick, tl.maximum(d, 0)))

    @triton.jit
    def _first_rejection_kernel(accepted, candidate, out, query_len, QUERY: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        seq = tl.program_id(0)
        j = tl.arange(0, QUERY)
        ok = tl.load(accepted + seq * query_len + j, mask=j < query_len, other=0)
        first = tl.min(tl.where(ok != 0, query_len, j), 0)  # the bonus row is never accepted
        tl.store(out + seq * 2, first.to(tl.int64))
        tl.store(out + seq * 2 + 1, tl.load(candidate + seq * query_len + first))

    return _row_kernel, _first_rejection_kernel


def accept_rows_triton(logits: torch.Tensor, draft: torch.Tensor, argmax: torch.Tensor, temperature: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, greedy: torch.Tensor,
                       seed: torch.Tensor, out: torch.Tensor | None = None,
                       listing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_in_graph's contract (see spec/verify.py), and each row's threshold: the scaled logits
    x = logits / temperature it drew from are those with x >= threshold (+inf on greedy rows).
    `seed` is a one-element int64 device tensor; `greedy` nonzero marks greedy sequences (bool or
    any integer dtype); the verdicts go into `out` ([B, 2] int64, contiguous) when given.
    listing=False: top-k rows search the whole row in every pass instead of listing their
    candidates first (the same results; to compare and time the two)."""
    num_rows, vocab = logits.shape
    num_seqs = temperature.shape[0]
    if num_rows % num_seqs or logits.stride(1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} (stride {logits.stride()}) are not {num_seqs} "
                         "sequences of equal rows with unit column stride")
    query_len = num_rows // num_seqs
    if greedy.dtype == torch.bool:
        greedy = greedy.view(torch.uint8)
    row_kernel, first_rejection = _kernels()
    accepted = torch.empty(num_rows, dtype=torch.int8, device=logits.device)
    candidate = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    kept_from = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    block = min(BLOCK, next_pow2(vocab))
    listed_logits = torch.empty(num_rows, block, dtype=logits.dtype, device=logits.device)
    listed_cols = torch.empty(num_rows, block, dtype=torch.int32, device=logits.device)
    if out is None:
        out = torch.empty(num_seqs, 2, dtype=torch.int64, device=logits.device)
    elif out.shape != (num_seqs, 2) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous [{num_seqs}, 2] int64 tensor")
    row_kernel[(num_rows,)](logits, logits.stride(0), draft, argmax, temperature, top_k, top_p, min_p,
                            greedy, seed, accepted, candidate, kept_from, listed_logits, listed_cols, vocab,
                            query_len, BLOCK=block, LISTING=listing, num_warps=8, **pdl_launch(logits.device))
    first_rejection[(num_seqs,)](accepted, candidate, out, query_len, QUERY=next_pow2(query_len),
                                 **pdl_launch(logits.device))
    return out, kept_from
