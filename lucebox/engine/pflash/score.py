"""Tail-attention token scores: the scorer prefills the prompt in chunks through its paged KV cache
(memory linear in S: no S x S matrix), then each layer's last `lookahead` rotated queries attend over
every cached key. Per prompt token: softmax probability, max over heads (GQA-expanded) and layers,
mean over the lookahead queries, average-pooled over a window (edges: the mean of the window's part
inside the prompt)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...kernels.norm import rms_norm_reference
from ...kernels.rope import apply_rope
from ...model.transformer import Attention
from ..runner import ModelRunner
from ..step_plan import StepPlan

LOOKAHEAD = 8
POOL_WINDOW = 13
SCORER_CHUNK = 4096  # scorer prefill tokens per forward
KEY_CHUNK = 16384  # keys per tail-attention product: [heads, lookahead, KEY_CHUNK] at a time


def pool_scores(scores: torch.Tensor, window: int = POOL_WINDOW) -> torch.Tensor:
    """Average pool of a [S] score vector over `window` tokens centred on each (odd window)."""
    if window <= 1:
        return scores
    if window % 2 == 0:
        raise ValueError(f"the pooling window must be odd, got {window}")
    return F.avg_pool1d(scores[None, None], window, stride=1, padding=window // 2, count_include_pad=False)[0, 0]


class TailAttentionScorer:
    """Scores prompts with one loaded scorer model (a plain-attention transformer: every layer a
    model/transformer.Attention without a sliding window). Owns a KV pool of `max_tokens`."""

    def __init__(self, model, max_tokens: int, block_size: int = 16, lookahead: int = LOOKAHEAD,
                 pool_window: int = POOL_WINDOW, chunk: int = SCORER_CHUNK):
        attns = [getattr(layer, "self_attn", None) for layer in model.layers]
        if not all(type(a) is Attention and a.sliding_window is None for a in attns):
            raise ValueError(f"a prefill scorer must be a plain full-attention transformer (e.g. Qwen3-0.6B); "
                             f"{type(model).__name__} has other layers")
        if lookahead < 1 or chunk < 1:
            raise ValueError(f"lookahead ({lookahead}) and chunk ({chunk}) must be positive")
        self.model, self.lookahead, self.pool_window, self.chunk = model, lookahead, pool_window, chunk
        self.block_size = block_size
        self.num_blocks = -(-max_tokens // block_size)
        self.max_tokens = self.num_blocks * block_size
        self.runner = ModelRunner(model, self.num_blocks, block_size)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 [S] scores of the scorer-tokenised prompt."""
        s = len(token_ids)
        if not 0 < s <= self.max_tokens:
            raise ValueError(f"the scorer holds 1..{self.max_tokens} tokens, the prompt has {s}")
        table = list(range(-(-s // self.block_size)))
        tail = min(self.lookahead, s)
        # the last forward holds the whole tail: its queries are taken there
        bounds = sorted({*range(0, s - tail, self.chunk), s - tail})
        for start, end in zip(bounds, bounds[1:] + [s]):
            last = end == s
            if last:
                self._capture_queries(end - start - tail)
            try:
                self.runner.run(StepPlan.forward([token_ids[start:end]], [start], [table], logits_rows=[]))
            finally:
                if last:
                    self._release_queries()
        pos = torch.arange(s, device=self.model.device)
        slots = torch.tensor(table, device=pos.device)[pos // self.block_size] * self.block_size + pos % self.block_size
        best = torch.zeros(tail, s, dtype=torch.float32, device=pos.device)
        for attn, (k_cache, _), q in zip(self._attns(), self.runner.caches, self._captured):
            # [S, Hkv, D], rotated; a split model's layers keep theirs on their own devices
            keys = k_cache.gather(slots.to(k_cache.values.device), torch.float32).to(best.device)
            best = torch.maximum(best, self._tail_probs(q.to(best.device), keys, attn.scale))
        return pool_scores(best.mean(0), self.pool_window)

    def _tail_probs(self, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """max over heads of softmax(q k^T * scale), causal within the tail: [L, S]. Two passes over
        key chunks (log-sum-exp, then probabilities), so no [heads, L, S] tensor beyond one chunk."""
        heads, kv_heads = q.shape[1], keys.shape[1]
        q = q.float().transpose(0, 1)  # [H, L, D]
        tail, s = q.shape[1], keys.shape[0]
        query_pos = torch.arange(s - tail, s, device=q.device)

        def logits(begin: int, end: int) -> torch.Tensor:
            k = keys[begin:end].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, C, D]
            z = q @ k.transpose(1, 2) * scale
            visible = torch.arange(begin, end, device=q.device)[None, :] <= query_pos[:, None]
            return z.masked_fill(~visible, -math.inf)

        spans = [(b, min(b + KEY_CHUNK, s)) for b in range(0, s, KEY_CHUNK)]
        lse = torch.logsumexp(torch.stack([torch.logsumexp(logits(b, e), -1) for b, e in spans]), 0)  # [H, L]
        return torch.cat([(logits(b, e) - lse[..., None]).exp().amax(0) for b, e in spans], dim=-1)

    def _attns(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def _capture_queries(self, first_row: int) -> None:
        """Wrap each layer's attend to keep its rotated queries of rows first_row.. (the tail)."""
        self._captured = []
        for attn in self._attns():
            def attend(q, k, v, cos, sin, batch, attn=attn, original=attn.attend):
                rows = q[first_row:].reshape(-1, attn.num_heads, attn.head_dim)
                if attn.qk_norm:
                    rows = rms_norm_reference(rows, attn.q_norm.weight, attn.q_norm.eps)
                self._captured.append(apply_rope(rows, cos[first_row:], sin[first_row:]))
                return original(q, k, v, cos, sin, batch)
            attn.attend = attend

    def _release_queries(self) -> None:
        for attn in self._attns():
            attn.__dict__.pop("attend", None)
