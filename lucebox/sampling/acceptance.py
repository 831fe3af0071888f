"""Accepting drafts for every verifying sequence of a step at once: the longest greedy-matching
prefix, or lossless rejection sampling; one host transfer for the whole batch.

Sequence s brings k_s drafts; its target logits rows 0..k_s score positions after [t, d1..dk];
row i is the target's distribution p_i for the token after d_i (row 0: after t). Both p and the
draft's q are processed identically (logit_bias, min_tokens, penalties with the row's own history,
temperature, top-k/p, min-p) by the one Sampler, so acceptance compares the distributions actually
sampled from. The rows of all sequences go through the Sampler together.

Sampling (Leviathan et al. / Chen et al.): accept d_i with probability min(1, p(d_i) / q(d_i));
on the first rejection draw from norm(max(0, p - q)); if all k are accepted draw the bonus from p_k.
Deterministic drafts are one-hot q: accept with probability p(d_i), residual = p without d_i.
The committed tokens are then distributed exactly as sampling from the target alone.
Every uniform is drawn up front (k per sequence, from its own generator when seeded), so the whole
decision is tensor arithmetic on the device; only [num_accepted, token] per sequence comes back.
Greedy is the same rule with one-hot p: accept while d_i is the argmax (u = 0 < p(d_i) = 1), then
the argmax at the first mismatch or the bonus row; no randomness is spent on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from ..kernels.dispatch import use_triton
from ..util import host_to_device
from .sampler import Sampler, SamplingState, apply_min_p, apply_top_k_top_p, exponential_race, fill_exponential
from .tree_acceptance import tree_choices, walk_tree

# The Triton sampler's vocabularies: above this the torch reference was faster with top-k / top-p
# (scripts/bench_sampler.py, H200, 2026-12-04, before the listed-candidate search, which is untimed).
TRITON_MAX_VOCAB = 1 << 13


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] processed q, or None: deterministic drafts
    # A draft tree (spec/tree.py): tokens in DFS order, each node's parent row (0: the pending token);
    # None: a chain. Trees are deterministic (probs None) and accepted by sampling/tree_acceptance.py.
    parents: list[int] | None = None

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass
class Verdict:
    tokens: list[int]  # committed: accepted drafts then the bonus / correction token
    num_accepted: int
    # A tree's accepted verify rows [0, r1, ..., ra] (the pending token's row first); None: a chain's 0..a.
    rows: list[int] | None = None


def row_states(seq, drafts: list[int]) -> list[SamplingState]:
    """One sampling state per verify row: row i has seen the output plus the first i drafts."""
    out = list(seq.output_token_ids)
    return [SamplingState(seq.params, seq.prompt_token_ids, out + drafts[:i], seq.generator)
            for i in range(len(drafts) + 1)]


def accept_batch(sampler: Sampler, logits: torch.Tensor, seqs: Seq, drafts: Seq[Draft]) -> list[Verdict]:
    """logits: [sum(k_s + 1), vocab], the k_s + 1 rows of each sequence in order (k_s may be 0:
    then the one row is sampled like a plain decode). Draft trees among them are walked
    (tree_acceptance.py), chains accepted below."""
    if not any(d.is_tree for d in drafts):
        return _accept_chains(sampler, logits, seqs, drafts)
    rows = {True: [], False: []}  # logits rows of the trees' and of the chains' sequences
    row = 0
    for d in drafts:
        rows[d.is_tree].extend(range(row, row + len(d.tokens) + 1))
        row += len(d.tokens) + 1
    if logits.dim() != 2 or logits.shape[0] != row:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {row} verify rows")
    verdicts: list[Verdict | None] = [None] * len(drafts)
    for tree in (True, False):
        which = [i for i, d in enumerate(drafts) if d.is_tree == tree]
        if not which:
            continue
        part = logits[host_to_device(rows[tree], logits.device, torch.long)]
        sub_seqs, sub_drafts = [seqs[i] for i in which], [drafts[i] for i in which]
        if tree:
            found = tree_verdicts(tree_choices(sampler, part, sub_seqs, sub_drafts), sub_drafts)
        else:
            found = _accept_chains(sampler, part, sub_seqs, sub_drafts)
        for i, verdict in zip(which, found):
            verdicts[i] = verdict
    return verdicts


def tree_verdicts(choices: Seq[int], drafts: Seq[Draft]) -> list[Verdict]:
    """Each tree's verdict from the target's choice at each of its rows (drafts' rows in order)."""
    verdicts, row = [], 0
    for d in drafts:
        rows, tokens = walk_tree(choices[row:row + len(d.tokens) + 1], d.tokens, d.parents)
        verdicts.append(Verdict(tokens, len(rows) - 1, rows))
        row += len(d.tokens) + 1
    return verdicts


def _accept_chains(sampler: Sampler, logits: torch.Tensor, seqs: Seq, drafts: Seq[Draft]) -> list[Verdict]:
    lengths = [len(d.tokens) for d in drafts]
    num_rows = sum(lengths) + len(lengths)
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {num_rows} verify rows")
    states = [st for seq, d in zip(seqs, drafts) for st in row_states(seq, d.tokens)]
    meta = _Rows.build(seqs, drafts, logits.device)
    if all(seq.params.is_greedy for seq in seqs):
        choice = sampler.process_logits(logits, states).argmax(-1)
        num_accepted = meta.first_rejection(choice == meta.draft)
        token = choice[meta.start + num_accepted]
    else:
        probs = sampler.processed_probs(logits, states)
        p_draft = probs.gather(1, meta.draft.clamp_min(0).unsqueeze(1)).squeeze(1)
        q = [d.probs for d in drafts if d.probs is not None]
        q = torch.cat(q).to(probs.dtype) if q else None  # [rows with a sampled draft, vocab]
        u = _uniforms(seqs, lengths, meta, logits.device)
        num_accepted = meta.first_rejection(u * _q_at_drafts(q, meta, p_draft) < p_draft)
        token = exponential_race(_residual(probs, q, meta.start + num_accepted, meta), list(seqs))
    host = torch.stack([num_accepted, token], 1).tolist()  # the step's one device -> host transfer
    return verdicts_of(drafts, host)


def verdicts_of(drafts: Seq[Draft], accepted_and_token: Seq[Seq[int]]) -> list[Verdict]:
    """Each sequence's verdict from its [drafts accepted, next token]."""
    return [Verdict(d.tokens[:a] + [t], a) for d, (a, t) in zip(drafts, accepted_and_token)]


def accept_argmax(argmax: list[int], drafts: Seq[Draft]) -> list[Verdict]:
    """The greedy rule on host lists, for steps whose logits nothing processes: `argmax` holds the
    target's argmax of every verify row (the k_s + 1 rows of each sequence, in order)."""
    verdicts, row = [], 0
    for d in drafts:
        k = len(d.tokens)
        choice = argmax[row:row + k + 1]
        if d.is_tree:
            verdicts += tree_verdicts(choice, [d])
            row += k + 1
            continue
        n = 0
        while n < k and choice[n] == d.tokens[n]:
            n += 1
        verdicts.append(Verdict(d.tokens[:n] + [choice[n]], n))
        row += k + 1
    return verdicts


def accept_in_graph(logits: torch.Tensor, draft: torch.Tensor, argmax: torch.Tensor, temperature: torch.Tensor,
                    top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    greedy: torch.Tensor, seed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`accept_batch` for deterministic drafts (n-gram lookups, argmax drafts) in the uniform layout
    of a CUDA-graph bucket, with no host work or sync (capturable): B sequences of Q rows each,
    row j of sequence b scoring the token after its j-th draft; `draft` [B*Q] holds the draft each
    row checks (the next input token) or -1 past a sequence's drafts (its bonus row and padding).
    A decode is Q = 1: no drafts, the token sampled from p. Per-sequence parameters are [B]
    tensors in `sampling.graph_rows.graph_row`'s form (filters that are off keep every token); greedy
    sequences (`greedy` nonzero, any integer or bool dtype: a graph passes its int64 input as is,
    saving a conversion node) accept while the draft is the row's argmax (`argmax` [B*Q]) and end
    on the argmax.

    Returns [B, 2] int64: (drafts accepted, the token after them) per sequence, written into `out`
    when given (a graph's static output: no copy node). On a GPU (vocabulary up to
    TRITON_MAX_VOCAB) this is three Triton launches (kernels/triton_sampling.py), whose noise is
    counter-based from `seed` (a one-element int64 device tensor the caller changes every step);
    the torch reference below draws from the global generator instead, which a CUDA graph replays
    with fresh offsets."""
    if use_triton(logits) and logits.shape[1] <= TRITON_MAX_VOCAB:
        from ..kernels.triton_sampling import accept_rows_triton
        return accept_rows_triton(logits, draft, argmax, temperature, top_k, top_p, min_p, greedy, seed, out)[0]
    greedy = greedy.bool()
    num_seqs = temperature.shape[0]
    query_len = logits.shape[0] // num_seqs

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values.unsqueeze(1).expand(num_seqs, query_len).reshape(-1)

    logits = logits / per_row(temperature).unsqueeze(1)
    logits = apply_top_k_top_p(logits, per_row(top_k), per_row(top_p))
    apply_min_p(logits, per_row(min_p))
    if query_len == 1:  # a decode: no drafts to judge, the token drawn straight from the logits
        token = torch.where(greedy, argmax, _gumbel_argmax(logits))
        return _into(out, torch.stack([torch.zeros_like(token), token], 1))
    probs = logits.softmax(-1)
    has_draft, at_draft = draft >= 0, draft.clamp_min(0).unsqueeze(1)
    p_draft = probs.gather(1, at_draft).squeeze(1)
    # A deterministic draft is one-hot q: accepted with probability min(1, p(d) / 1) = p(d).
    accepted = has_draft & torch.where(per_row(greedy), draft == argmax, torch.rand_like(p_draft) < p_draft)
    num_accepted = accepted.view(num_seqs, query_len).long().cumprod(1).sum(1)
    chosen = torch.arange(num_seqs, device=logits.device) * query_len + num_accepted
    # The residual max(0, p - onehot(d)) at a rejected draft (p without d), p itself at the bonus row.
    p = probs[chosen]
    drop = has_draft[chosen].unsqueeze(1)
    residual = p.scatter(1, at_draft[chosen], torch.where(drop, 0.0, p.gather(1, at_draft[chosen])))
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    token = torch.where(greedy, argmax[chosen], _gumbel_argmax(residual.log()))
    return _into(out, torch.stack([num_accepted, token], 1))


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)


def _gumbel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The exponential race on logits (or log-weights): argmax(p / E) = argmax(x - log E), no
    softmax needed; -inf never wins."""
    noise = torch.empty_like(logits)
    fill_exponential(noise)
    return (logits - noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_()).argmax(-1)


@dataclass
class _Rows:
    """Per-row / per-sequence indices of a verify batch, sent to the device in one copy."""

    seq: torch.Tensor  # [R] which sequence a row belongs to
    pos: torch.Tensor  # [R] index of the row within its sequence
    draft: torch.Tensor  # [R] the draft token the row scores; -1 on bonus rows
    q_index: torch.Tensor  # [R] the row's q among the concatenated draft probs; -1: deterministic / bonus
    greedy: torch.Tensor  # [R] bool: the row's sequence decodes greedily
    start: torch.Tensor  # [S] first row of each sequence

    @classmethod
    def build(cls, seqs, drafts: Seq[Draft], device) -> _Rows:
        cols: list[list[int]] = [[], [], [], [], []]
        starts, row, q_row = [], 0, 0
        for s, (seq, d) in enumerate(zip(seqs, drafts)):
            k = len(d.tokens)
            starts.append(row)
            cols[0] += [s] * (k + 1)
            cols[1] += range(k + 1)
            cols[2] += list(d.tokens) + [-1]
            if d.probs is not None:
                cols[3] += list(range(q_row, q_row + k)) + [-1]
                q_row += k
            else:
                cols[3] += [-1] * (k + 1)
            cols[4] += [int(seq.params.is_greedy)] * (k + 1)
            row += k + 1
        flat = host_to_device([v for c in cols for v in c] + starts, device, torch.int64)
        seq_, pos, draft, q_index, greedy, start = flat.split([row] * 5 + [len(starts)])
        return cls(seq_, pos, draft, q_index, greedy.bool(), start)

    def first_rejection(self, accepted: torch.Tensor) -> torch.Tensor:
        """[S] the number of leading accepted rows of each sequence (bonus rows never count):
        the smallest row position that is not accepted, a segment-wise min over the flat rows."""
        accepted = accepted & (self.draft >= 0)
        big = torch.iinfo(torch.int64).max
        fail_at = torch.where(accepted, big, self.pos)
        out = torch.full((self.start.shape[0],), big, dtype=torch.int64, device=fail_at.device)
        return out.scatter_reduce_(0, self.seq, fail_at, "amin")


def _uniforms(seqs, lengths: list[int], meta: _Rows, device) -> torch.Tensor:
    """[R] u ~ U[0, 1) for the draft rows of sampled sequences; 0 for greedy rows, where 0 < p(d)
    is exactly "d is the argmax". A seeded sequence draws its k from its own generator."""
    sampled = [not seq.params.is_greedy and k > 0 for seq, k in zip(seqs, lengths)]
    if any(s and seq.generator is None for s, seq in zip(sampled, seqs)):
        u = torch.rand(meta.draft.shape[0], device=device).masked_fill_(meta.greedy, 0.0)
    else:
        u = torch.zeros(meta.draft.shape[0], device=device)
    row = 0
    for seq, k, s in zip(seqs, lengths, sampled):
        if s and seq.generator is not None:
            u[row:row + k] = torch.rand(k, generator=seq.generator, device=device)
        row += k + 1
    return u


def _q_at_drafts(q: torch.Tensor | None, meta: _Rows, p_draft: torch.Tensor) -> torch.Tensor:
    """[R] q(d) of each row's draft token: from the draft's probs, or 1 for deterministic drafts."""
    ones = torch.ones_like(p_draft)
    if q is None:
        return ones
    return torch.where(meta.q_index >= 0, q[meta.q_index.clamp_min(0), meta.draft.clamp_min(0)], ones)


def _residual(probs: torch.Tensor, q: torch.Tensor | None, chosen: torch.Tensor, meta: _Rows) -> torch.Tensor:
    """[S, vocab] what each sequence samples its last token from (unnormalised): max(0, p - q) at
    a rejected row, p at the bonus row (no draft there: q = 0)."""
    p = probs[chosen]
    residual = p.clone()
    q_index = meta.q_index[chosen]
    if q is not None:
        residual -= q[q_index.clamp_min(0)] * (q_index >= 0).unsqueeze(1)
    # Deterministic drafts are one-hot q: subtracting 1 at the draft token zeroes it after the clamp.
    one_hot = ((meta.draft[chosen] >= 0) & (q_index < 0)).to(p.dtype).unsqueeze(1)
    residual.scatter_add_(1, meta.draft[chosen].clamp_min(0).unsqueeze(1), -one_hot).clamp_min_(0)
    # p == q: rejection had probability 0, but keep the draw well defined.
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
