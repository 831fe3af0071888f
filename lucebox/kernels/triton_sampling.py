"""Triton sampling and acceptance for a CUDA-graph step: sampling.acceptance.accept_in_graph in three launches
(the reference there is ~30 torch kernels, a full-vocabulary sort among them).

One program per logits row (the row kernel) computes everything its row can decide alone:
  - the row's kept set: temperature, then top-k, top-p over the top-k set, min-p, as the Sampler
    does, but without sorting: each filter is a threshold on the scaled logit x, found by bisection
    over the float's bits (32 counting passes for top-k, 32 mass passes for top-p; only rows with
    the filter on pay them), so "kept" is x >= threshold;
  - whether the row's draft d is accepted (u < p(d): a deterministic draft is one-hot q);
  - a candidate token: drawn from p without d (the residual after rejecting d), from p on a row
    without a draft, by Gumbel-max (argmax of x - log E over the kept tokens, E = -log U).
Greedy rows accept while d is the argmax and offer the argmax. A last launch, one program per
sequence, takes the first row not accepted: (drafts accepted, that row's candidate). Drawing a
candidate on every row, not only the chosen one, keeps the rows independent; each candidate uses
its own noise, so the committed token is still distributed as the residual of the row that
rejected (or p at the bonus row) -- sampling from the target alone.

One program reading a 152K vocabulary dozens of times is slow, so the passes avoid the
vocabulary where they can (`search`, default "chunks"):
  - chunks: a first launch, (row, CHUNK tokens) a program, finds what slices of a row can decide
    alone: each chunk's mass and max, a temperature-only row's Gumbel race per chunk, and for a
    filtered row the chunk's L-th largest x (L = k for top-k up to LIST, else LIST) and its
    tokens at or above it, listed. Every list then holds all of its chunk's tokens at or above
    the largest of those bounds; the row kernel merges the races, or searches those candidates
    (about L of them) and uses them when the kept set provably lies among them (k candidates at
    least, the top-p cut's mass among them, the final threshold at or above the bound: so for
    top-k up to LIST always, for top-p / min-p on a peaked row), else decides over the row;
  - list: a top-k row (k <= BLOCK) lists its candidates in one pass, the tokens at or above the
    k-th largest of its lanes' maxima (each of BLOCK lanes has seen every BLOCK-th token); the
    chunks fall back to this;
  - row: every pass over the whole row.
Ties at a bound that overflow a list fall back to the whole row. All three decide alike (the same
thresholds and draws; the kept mass summed in another order).

The noise is counter-based (Philox, tl.rand): a seed read from device memory, which the host
changes every step, and the token's (row, column) as the counter; the draft's uniform uses the
next seed. Top-p ties differ from the sort-based reference: tokens tied at the cut are all kept
(kept iff the mass strictly above the token is below top_p), where a sort keeps an arbitrary part.
"""
from __future__ import annotations

import functools

import torch

from .dispatch import next_pow2, pdl_launch

BLOCK = 1024  # values a program of the row kernel holds at once
CHUNK = 4096  # tokens a program of the chunk launch reads
LIST = 64  # candidates a chunk lists for a top-k row: chunked search for k <= LIST
SEARCHES = ("chunks", "list", "row")


@functools.cache
def _kernels():
    """Defined on first use: importing this module must not import Triton (see triton_norm)."""
    # the kernels look their helpers up among the module globals
    global triton, tl, _key, _value, _kth_largest, _scaled, _threshold, wait_for_previous_kernel
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
    def _kth_largest(v, k, lowest, highest):
        """The k-th largest value of the register tensor v (at least k of them >= lowest, the
        largest being highest), by bisection over the float's bits."""
        lo = _key(lowest).to(tl.int64)  # count(v >= lo) >= k
        hi = _key(highest).to(tl.int64) + 1  # count(v >= hi) = 0 < k
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            enough = tl.sum((v >= _value(mid)).to(tl.int32), 0) >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        return _value(lo)

    @triton.jit
    def _scaled(base, cols, vocab, temperature):
        # IEEE division (a plain / may compile to an approximate one): the same x as torch's logits / T
        return tl.div_rn(tl.load(base + cols, mask=cols < vocab, other=float("-inf")), temperature)

    @triton.jit
    def _threshold(src, length, temp, k, p, mp, m, lowest, row_mass, bound, vocab, BLOCK: tl.constexpr):
        """The kept set's threshold on x (temperature, top-k, top-p over the top-k set, min-p) found
        over the `length` logits at src, and whether it is the row's: src holds every token of the
        row at or above `bound` (the whole row: bound -inf), lowest is the row's smallest x,
        row_mass its mass relative to m (or < 0: the mass of what src keeps)."""
        offs = tl.arange(0, BLOCK)
        threshold = lowest
        exact = (k >= vocab) | (length >= k)  # the k-th largest is among them
        if k < vocab:  # the k-th largest x: the largest t with count(x >= t) >= k
            lo = _key(threshold).to(tl.int64)  # count = length >= k
            hi = _key(m).to(tl.int64) + 1  # count = 0 < k
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                t = _value(mid)
                count = tl.zeros([BLOCK], tl.int32)
                for start in range(0, length, BLOCK):
                    count += (_scaled(src, start + offs, length, temp) >= t).to(tl.int32)
                enough = tl.sum(count, 0) >= k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid)
            threshold = _value(lo)
        if p < 1.0:  # keep x iff the top-k mass strictly above x is below top_p of the top-k mass
            mass = tl.zeros([BLOCK], tl.float32)
            for start in range(0, length, BLOCK):
                x = _scaled(src, start + offs, length, temp)
                mass += tl.where(x >= threshold, tl.exp(x - m), 0.0)
            kept = tl.sum(mass, 0)
            target = p * tl.where((k < vocab) | (row_mass < 0), kept, row_mass)
            exact = exact & (kept >= target)  # the cut is among them
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
        return threshold, exact & (threshold >= bound)

    @triton.jit
    def _chunk_kernel(logits, stride, draft, temperature, top_k, top_p, min_p, greedy, seed_ptr, stats,
                      counts, chunk_logits, chunk_cols, vocab, query_len, n_chunks,
                      CHUNK: tl.constexpr, LIST: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row, c) over CHUNK tokens of a sampled row: their max, min and (without top-k)
        mass relative to their max; for a row of temperature alone, the chunk's Gumbel race (best
        score, its column); for a filtered row, the chunk's L-th largest x (L = k for top-k up to
        LIST, else LIST) and the tokens at or above it, listed: every chunk's list holds all of its
        tokens at or above the largest of those bounds, so the row's top k, or its top-p / min-p
        set when that lies above the bound, are in the lists. stats[row, c] = (max, min, L-th,
        mass, best score), counts[row, c] = (tokens listed, best column)."""
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        c = tl.program_id(1)
        seq = row // query_len
        if tl.load(greedy + seq) == 0:
            temp = tl.load(temperature + seq)
            k = tl.load(top_k + seq)
            cols = c * CHUNK + tl.arange(0, CHUNK)
            ok = cols < vocab
            raw = tl.load(logits + row.to(tl.int64) * stride + cols, mask=ok, other=float("-inf"))
            x = tl.div_rn(raw, temp)
            m_c = tl.max(x, 0)
            lo_c = tl.min(tl.where(ok, x, float("inf")), 0)
            mass = 0.0
            if k >= vocab:  # the row's mass is read only without top-k (races, top-p / min-p alone)
                mass = tl.sum(tl.where(ok, tl.exp(x - m_c), 0.0), 0)
            at = row.to(tl.int64) * n_chunks + c
            bound = lo_c
            best = float("-inf")
            best_col = vocab
            listed = 0
            if (k >= vocab) & (tl.load(top_p + seq) >= 1.0) & (tl.load(min_p + seq) <= 0.0):
                d = tl.load(draft + row)
                u = tl.rand(tl.load(seed_ptr), row * vocab + cols)
                score = tl.where(ok & (cols != d), x - tl.log(-tl.log(u)), float("-inf"))
                best = tl.max(score, 0)
                best_col = tl.min(tl.where(score == best, cols, vocab), 0)
            else:
                size = tl.minimum(k, LIST)
                if tl.sum(ok.to(tl.int32), 0) > size:
                    bound = _kth_largest(x, size, lo_c, m_c)
                keep = ok & (x >= bound)
                listed = tl.sum(keep.to(tl.int32), 0)
                slot = tl.cumsum(keep.to(tl.int32), 0) - 1
                tl.store(chunk_logits + at * LIST + slot, raw, mask=keep & (slot < LIST))
                tl.store(chunk_cols + at * LIST + slot, cols, mask=keep & (slot < LIST))
            tl.store(stats + at * 5, m_c)
            tl.store(stats + at * 5 + 1, lo_c)
            tl.store(stats + at * 5 + 2, bound)
            tl.store(stats + at * 5 + 3, mass)
            tl.store(stats + at * 5 + 4, best)
            tl.store(counts + at * 2, listed)
            tl.store(counts + at * 2 + 1, best_col)

    @triton.jit
    def _row_kernel(logits, stride, draft, argmax, temperature, top_k, top_p, min_p, greedy, seed_ptr,
                    accepted, candidate, kept_from, searched, listed_logits, listed_cols, stats, counts,
                    chunk_logits, chunk_cols, vocab, query_len, n_chunks, BLOCK: tl.constexpr,
                    LISTING: tl.constexpr = True,
                    CHUNKED: tl.constexpr = False, CHUNKS: tl.constexpr = 1, LIST: tl.constexpr = 1,
                    PDL: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        seq = row // query_len
        d = tl.load(draft + row)
        top = tl.load(argmax + row)
        if tl.load(greedy + seq) != 0:
            tl.store(accepted + row, ((d >= 0) & (d == top)).to(tl.int8))
            tl.store(candidate + row, top)
            tl.store(kept_from + row, float("inf"))  # nothing is drawn
            tl.store(searched + row, 0)
        else:
            temp = tl.load(temperature + seq)
            k = tl.load(top_k + seq)
            p = tl.load(top_p + seq)
            mp = tl.load(min_p + seq)
            seed = tl.load(seed_ptr)
            base = logits + row.to(tl.int64) * stride
            offs = tl.arange(0, BLOCK)
            listed_row = listed_logits + row.to(tl.int64) * BLOCK
            # The draw passes over `length` logits at `src`: the row, or a list of candidates that
            # holds the kept set (then it reads a few hundred values, not the vocabulary).
            no, yes = tl.zeros([], tl.int1), tl.full([], 1, tl.int1)  # typed flags for the branches below
            src, length, listed, raced, whole = base, vocab, no, no, yes
            m = tl.zeros([], tl.float32)
            threshold = tl.zeros([], tl.float32)
            mass_sum = tl.zeros([], tl.float32)
            top_score = tl.full([], float("-inf"), tl.float32)
            pick = tl.zeros([], tl.int64) + vocab
            if CHUNKED:  # the first launch's chunk results
                ci = tl.arange(0, CHUNKS)
                at = row.to(tl.int64) * n_chunks + ci
                cok = ci < n_chunks
                chunk_max = tl.load(stats + at * 5, mask=cok, other=float("-inf"))
                m = tl.max(chunk_max, 0)
                threshold = tl.min(tl.load(stats + at * 5 + 1, mask=cok, other=float("inf")), 0)
                chunk_mass = tl.load(stats + at * 5 + 3, mask=cok, other=0.0)
                row_mass = tl.sum(tl.where(cok, chunk_mass * tl.exp(chunk_max - m), 0.0), 0)
                if (k >= vocab) & (p >= 1.0) & (mp <= 0.0):  # temperature alone: the chunks' races
                    chunk_best = tl.load(stats + at * 5 + 4, mask=cok, other=float("-inf"))
                    top_score = tl.max(chunk_best, 0)
                    pick = tl.min(tl.where(cok & (chunk_best == top_score),
                                           tl.load(counts + at * 2 + 1, mask=cok, other=vocab), vocab), 0).to(tl.int64)
                    mass_sum = row_mass
                    raced, whole = yes, no
                elif tl.max(tl.load(counts + at * 2, mask=cok, other=0), 0) <= LIST:
                    # Every chunk listed all its tokens at or above the largest chunk bound.
                    bound = tl.max(tl.load(stats + at * 5 + 2, mask=cok, other=float("-inf")), 0)
                    n = 0
                    for start in range(0, n_chunks * LIST, BLOCK):
                        e = start + offs
                        inside = e < n_chunks * LIST
                        there = inside & (e % LIST < tl.load(counts + (row.to(tl.int64) * n_chunks + e // LIST) * 2,
                                                             mask=inside, other=0))
                        raw = tl.load(chunk_logits + row.to(tl.int64) * n_chunks * LIST + e, mask=there,
                                      other=float("-inf"))
                        keep = there & (tl.div_rn(raw, temp) >= bound)
                        slot = n + tl.cumsum(keep.to(tl.int32), 0) - 1
                        col = tl.load(chunk_cols + row.to(tl.int64) * n_chunks * LIST + e, mask=keep, other=0)
                        tl.store(listed_row + slot, raw, mask=keep & (slot < BLOCK))
                        tl.store(listed_cols + row.to(tl.int64) * BLOCK + slot, col, mask=keep & (slot < BLOCK))
                        n += tl.sum(keep.to(tl.int32), 0)
                    if n <= BLOCK:
                        t, exact = _threshold(listed_row, n, temp, k, p, mp, m, threshold, row_mass, bound,
                                              vocab, BLOCK)
                        if exact:  # else the kept set reaches below the lists: the row decides
                            src, length, listed, whole, threshold = listed_row, n, yes, no, t
            if whole:
                hi_acc = tl.full([BLOCK], float("-inf"), tl.float32)
                lo_acc = tl.full([BLOCK], float("inf"), tl.float32)
                for start in range(0, vocab, BLOCK):
                    cols = start + offs
                    x = _scaled(base, cols, vocab, temp)
                    hi_acc = tl.maximum(hi_acc, x)
                    lo_acc = tl.minimum(lo_acc, tl.where(cols < vocab, x, float("inf")))
                m = tl.max(hi_acc, 0)
                threshold = tl.min(lo_acc, 0)  # every token kept so far
                if LISTING:  # (nested: `and` would mix the constexpr with a runtime value)
                    if (k < vocab) & (k <= BLOCK):
                        # The k-th largest lane maximum bounds the k-th largest x from below.
                        bound = _kth_largest(hi_acc, k, threshold, m)
                        n = 0
                        for start in range(0, vocab, BLOCK):
                            cols = start + offs
                            raw = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
                            keep = (cols < vocab) & (tl.div_rn(raw, temp) >= bound)
                            slot = n + tl.cumsum(keep.to(tl.int32), 0) - 1
                            tl.store(listed_row + slot, raw, mask=keep & (slot < BLOCK))
                            tl.store(listed_cols + row.to(tl.int64) * BLOCK + slot, cols, mask=keep & (slot < BLOCK))
                            n += tl.sum(keep.to(tl.int32), 0)
                        if n <= BLOCK:  # else (ties at the bound) the passes read the whole row
                            src, length, listed = listed_row, n, yes
                threshold, _ = _threshold(src, length, temp, k, p, mp, m, threshold, -1.0, float("-inf"),
                                          vocab, BLOCK)
            tl.store(kept_from + row, threshold)
            # what decided: 1 the chunks' races, 2 the chunks' lists, 3 the row's list, 4 the row
            tl.store(searched + row, tl.where(raced, 1, tl.where(listed, tl.where(whole, 3, 2), 4)).to(tl.int8))
            if not raced:  # the kept mass, and the Gumbel-max draw over the kept tokens but the draft
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
                mass_sum = tl.sum(mass, 0)
                top_score = tl.max(best, 0)
                # the lowest column among equal best scores: a deterministic pick
                pick = tl.min(tl.where(best == top_score, best_col, vocab), 0)
            has_draft = d >= 0
            x_d = tl.div_rn(tl.load(base + tl.maximum(d, 0)), temp)
            p_d = tl.where(has_draft & (x_d >= threshold), tl.exp(x_d - m) / mass_sum, 0.0)
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

    return _chunk_kernel, _row_kernel, _first_rejection_kernel


def accept_rows_triton(logits: torch.Tensor, draft: torch.Tensor, argmax: torch.Tensor, temperature: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, greedy: torch.Tensor,
                       seed: torch.Tensor, out: torch.Tensor | None = None,
                       search: str = "chunks") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """accept_in_graph's contract (see sampling/acceptance.py), and each row's threshold: the scaled logits
    x = logits / temperature it drew from are those with x >= threshold (+inf on greedy rows).
    `seed` is a one-element int64 device tensor; `greedy` nonzero marks greedy sequences (bool or
    any integer dtype); the verdicts go into `out` ([B, 2] int64, contiguous) when given.
    search: "chunks" (a first launch over CHUNK-token slices of every row: top-k rows' candidates
    and temperature-only rows' draws found by many programs a row), "list" (one program a row,
    top-k rows listing their candidates in one pass) or "row" (every search over the whole row):
    the same decisions, to compare and time them. Also returns what decided each row (int8: 0
    greedy, 1 the chunks' Gumbel races, 2 the chunks' candidate lists, 3 the row's list, 4 the
    whole row)."""
    if search not in SEARCHES:
        raise ValueError(f"search {search!r}: one of {', '.join(SEARCHES)}")
    num_rows, vocab = logits.shape
    num_seqs = temperature.shape[0]
    if num_rows % num_seqs or logits.stride(1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} (stride {logits.stride()}) are not {num_seqs} "
                         "sequences of equal rows with unit column stride")
    query_len = num_rows // num_seqs
    if greedy.dtype == torch.bool:
        greedy = greedy.view(torch.uint8)
    chunk_kernel, row_kernel, first_rejection = _kernels()
    device = logits.device
    accepted = torch.empty(num_rows, dtype=torch.int8, device=device)
    candidate = torch.empty(num_rows, dtype=torch.int64, device=device)
    kept_from = torch.empty(num_rows, dtype=torch.float32, device=device)
    searched = torch.empty(num_rows, dtype=torch.int8, device=device)
    block = min(BLOCK, next_pow2(vocab))
    listed_logits = torch.empty(num_rows, block, dtype=logits.dtype, device=device)
    listed_cols = torch.empty(num_rows, block, dtype=torch.int32, device=device)
    if out is None:
        out = torch.empty(num_seqs, 2, dtype=torch.int64, device=device)
    elif out.shape != (num_seqs, 2) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous [{num_seqs}, 2] int64 tensor")
    chunk = min(CHUNK, next_pow2(vocab))
    n_chunks = -(-vocab // chunk) if search == "chunks" else 1
    stats = torch.empty(num_rows, n_chunks, 5, dtype=torch.float32, device=device)
    counts = torch.empty(num_rows, n_chunks, 2, dtype=torch.int32, device=device)
    chunk_logits = torch.empty(num_rows, n_chunks, LIST, dtype=logits.dtype, device=device)
    chunk_cols = torch.empty(num_rows, n_chunks, LIST, dtype=torch.int32, device=device)
    if search == "chunks":
        chunk_kernel[(num_rows, n_chunks)](
            logits, logits.stride(0), draft, temperature, top_k, top_p, min_p, greedy, seed, stats, counts,
            chunk_logits, chunk_cols, vocab, query_len, n_chunks, CHUNK=chunk, LIST=LIST,
            num_warps=8, **pdl_launch(device))
    row_kernel[(num_rows,)](logits, logits.stride(0), draft, argmax, temperature, top_k, top_p, min_p,
                            greedy, seed, accepted, candidate, kept_from, searched, listed_logits, listed_cols, stats,
                            counts, chunk_logits, chunk_cols, vocab, query_len, n_chunks, BLOCK=block,
                            LISTING=search != "row", CHUNKED=search == "chunks", CHUNKS=next_pow2(n_chunks),
                            LIST=LIST, num_warps=8, **pdl_launch(device))
    first_rejection[(num_seqs,)](accepted, candidate, out, query_len, QUERY=next_pow2(query_len),
                                 **pdl_launch(device))
    return out, kept_from, searched
