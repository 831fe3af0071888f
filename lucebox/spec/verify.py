"""Accepting drafts: the longest greedy-matching prefix, or lossless rejection sampling.

For each sequence the target's logits rows 0..k score positions after [t, d1..dk]; row i is the
target's distribution p_i for the token after d_i (row 0: after t). Both p and the draft's q are
processed identically (logit_bias, min_tokens, penalties with the row's own history, temperature,
top-k/p, min-p) by the one Sampler, so acceptance compares the distributions actually sampled from.

Sampling (Leviathan et al. / Chen et al.): accept d_i with probability min(1, p(d_i) / q(d_i));
on the first rejection draw from norm(max(0, p - q)); if all k are accepted draw the bonus from p_k.
Deterministic drafts are one-hot q: accept with probability p(d_i), residual = p without d_i.
The committed tokens are then distributed exactly as sampling from the target alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import Sampler, SamplingState
from .proposer import Draft


@dataclass
class Verdict:
    tokens: list[int]  # committed: accepted drafts then the bonus / correction token
    num_accepted: int


def row_states(seq, drafts: list[int]) -> list[SamplingState]:
    """One sampling state per verify row: row i has seen the output plus the first i drafts."""
    out = list(seq.output_token_ids)
    return [SamplingState(seq.params, seq.prompt_token_ids, out + drafts[:i], seq.generator)
            for i in range(len(drafts) + 1)]


def accept(sampler: Sampler, logits: torch.Tensor, seq, draft: Draft) -> Verdict:
    """logits: [k+1, vocab] target rows for one sequence."""
    drafts = draft.tokens
    states = row_states(seq, drafts)
    if seq.params.is_greedy:
        choice = sampler.process_logits(logits, states).argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == choice[a]:
            a += 1
        return Verdict(drafts[:a] + [choice[a]], a)
    p = sampler.processed_probs(logits, states)
    gen = seq.generator
    for i, token in enumerate(drafts):
        p_x = p[i, token]
        q_x = draft.probs[i, token] if draft.probs is not None else torch.ones((), device=p.device)
        u = torch.rand((), generator=gen, device=p.device) if gen is not None else torch.rand((), device=p.device)
        if (u * q_x < p_x).item():  # u < p/q without dividing by a zero q
            continue
        residual = p[i].clone()
        if draft.probs is not None:
            residual = (residual - draft.probs[i]).clamp_min_(0)
        else:
            residual[token] = 0
        if residual.sum() <= 0:  # p == q: rejection had probability 0, but keep it well defined
            residual = p[i]
        return Verdict(drafts[:i] + [_sample(residual, gen)], i)
    return Verdict(drafts + [_sample(p[len(drafts)], gen)], len(drafts))


def _sample(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    noise = torch.empty_like(weights).exponential_(generator=gen).clamp_min_(torch.finfo(weights.dtype).tiny)
    return int((weights / noise).argmax())
