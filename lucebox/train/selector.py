"""The DFlash2 candidate selector's training loss (`lucebox train-drafter --arch dflash2`).

Chosen here (the published recipe was not readable; speculators #1006 describes the same shape):
a teacher-forced K-way cross-entropy per scored slot. The candidates are the top-K of the
drafter's own logits (what the selector sees at inference); when the true token is not among them
it replaces the last candidate in the loss only. Each candidate's score is its unary logit
(detached: the backbone keeps learning from its own slot-weighted cross-entropy alone) plus the
transition <A[pred] * P h, B[c]>, with pred the true token before the slot (the anchor for slot 1)
instead of the selector's own earlier choice. The per-slot terms carry the same weights
w_k = exp(-(k-1)/gamma) as the backbone's loss, and their sum is added to it times SELECTOR_WEIGHT.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SELECTOR_WEIGHT = 1.0


def selector_loss(selector, lm_head, hidden: torch.Tensor, anchor_ids: torch.Tensor, labels: torch.Tensor,
                  valid: torch.Tensor, weights: torch.Tensor, vocab_size: int, budget_bytes: int = 1 << 28
                  ) -> torch.Tensor:
    """Weighted sum of the selector's cross-entropy over the valid slots. hidden [S, N, B, D] (the
    drafter's final-normed states), anchor_ids [S, N], labels / valid [S, N, B-1] as block_targets
    gives them, weights [B-1]."""
    predecessors = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)[valid]
    rows, y = hidden[:, :, 1:][valid], labels[valid]
    w = weights.expand_as(valid)[valid]
    top_k = min(selector.top_k, vocab_size)
    total = rows.new_zeros((), dtype=torch.float32)
    chunk = max(1, budget_bytes // (4 * vocab_size))
    for start in range(0, rows.shape[0], chunk):
        h, target, pred = rows[start:start + chunk], y[start:start + chunk], predecessors[start:start + chunk]
        with torch.no_grad():
            logits = lm_head(h).float()
            unary, candidates = logits.topk(top_k, dim=-1)
            missing = ~(candidates == target[:, None]).any(-1)
            candidates[missing, -1] = target[missing]
            unary[missing, -1] = logits[missing, target[missing]]
            index = (candidates == target[:, None]).int().argmax(-1)
        scores = unary + selector.transition(pred, selector.hidden_projection(h), candidates)
        total = total + (F.cross_entropy(scores, index, reduction="none") * w[start:start + chunk]).sum()
    return SELECTOR_WEIGHT * total


@torch.no_grad()
def selector_drafts(selector, lm_head, hidden: torch.Tensor, anchor_ids: torch.Tensor, vocab_size: int,
                    budget_bytes: int = 1 << 28) -> torch.Tensor:
    """The greedy chain the selector drafts for every block [S, N, B-1] (what the engine proposes),
    so evaluation measures the selector's drafts rather than each slot's own argmax."""
    S, N, B, D = hidden.shape
    rows, anchors = hidden[:, :, 1:].reshape(S * N, B - 1, D), anchor_ids.reshape(-1)
    top_k = min(selector.top_k, vocab_size)
    chunk = max(1, budget_bytes // (4 * vocab_size))
    out = torch.empty(S * N, B - 1, dtype=torch.int64, device=hidden.device)
    for start in range(0, S * N, chunk):
        pred = anchors[start:start + chunk]
        for slot in range(B - 1):
            h = rows[start:start + chunk, slot]
            unary, candidates = lm_head(h).float().topk(top_k, dim=-1)
            scores = unary + selector.transition(pred, selector.hidden_projection(h), candidates)
            pred = candidates.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
            out[start:start + chunk, slot] = pred
    return out.view(S, N, B - 1)
