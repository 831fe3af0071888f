"""Tail-attention token scores: the scorer prefills the prompt in chunks through its paged KV cache
(memory linear in S: no S x S matrix), then each layer's last `lookahead` rotated queries attend over
every cached key. Per prompt token: softmax probability, max over heads (GQA-expanded) and layers,
mean over the lookahead queries, average-pooled over a window (edges: the mean of the window's part
inside the prompt).

With an attention window (the default, SCORER_WINDOW) the prompt's positions before the tail attend
only to the last `window` keys in the scorer's pass, as a sliding-window layer does: the pass costs
S x window rather than S^2 / 2 (at 128K the dense pass was 94% of a scored prefill). The tail's
queries still attend to every key, in the pass and in the scores; the keys are what the windowed
pass computed."""
from __future__ import annotations

import math
from collections.abc import Generator

import torch
import torch.nn.functional as F

from ...kernels.norm import rms_norm_reference
from ...kernels.rope import apply_rope
from ...model.transformer import Attention
from ..runner import ModelRunner
from ..step_plan import StepPlan
from .jobs import drain

LOOKAHEAD = 8
POOL_WINDOW = 13
SCORER_CHUNK = 4096  # scorer prefill tokens per forward
KEY_CHUNK = 16384  # keys per tail-attention product: [heads, lookahead, KEY_CHUNK] at a time
SCORER_WINDOW = 4096  # keys a position before the tail attends to in the scorer's pass (None: all)


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
                 pool_window: int = POOL_WINDOW, chunk: int = SCORER_CHUNK, window: int | None = SCORER_WINDOW):
        attns = [getattr(layer, "self_attn", None) for layer in model.layers]
        if not all(type(a) is Attention and a.sliding_window is None for a in attns):
            raise ValueError(f"a prefill scorer must be a plain full-attention transformer (e.g. Qwen3-0.6B); "
                             f"{type(model).__name__} has other layers")
        if lookahead < 1 or chunk < 1 or (window is not None and window < 1):
            raise ValueError(f"lookahead ({lookahead}), chunk ({chunk}) and window ({window}) must be positive")
        self.model, self.lookahead, self.pool_window, self.chunk = model, lookahead, pool_window, chunk
        self.window = window
        self.block_size = block_size
        self.num_blocks = -(-max_tokens // block_size)
        self.max_tokens = self.num_blocks * block_size
        self.runner = ModelRunner(model, self.num_blocks, block_size)
        self._free_blocks = list(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 [S] scores of the scorer-tokenised prompt, at once."""
        return drain(self.steps(token_ids))

    def steps(self, token_ids: list[int]) -> Generator[tuple[int, int] | None, None, torch.Tensor]:
        """score() resumable: each next() runs one scorer prefill chunk (yielding (tokens prefilled, S)),
        then the tail scores over every layer (yielding None); returns the [S] scores. Holds its KV blocks
        from the first next() until it ends or is closed (an aborted request)."""
        s = len(token_ids)
        if not 0 < s <= self.max_tokens:
            raise ValueError(f"the scorer holds 1..{self.max_tokens} tokens, the prompt has {s}")
        table = self._take_blocks(-(-s // self.block_size))
        try:
            tail = min(self.lookahead, s)
            # the last forward holds the whole tail: its queries are taken there
            bounds = sorted({*range(0, s - tail, self.chunk), s - tail})
            queries: list[torch.Tensor] = []
            for start, end in zip(bounds, bounds[1:] + [s]):
                with torch.inference_mode():
                    self._prefill_chunk(token_ids[start:end], start, table, queries if end == s else None)
                yield end, s
            with torch.inference_mode():
                scores = self._tail_scores(queries, table, s)
            yield None
            return scores
        finally:
            self._free_blocks = sorted(self._free_blocks + table)

    def _take_blocks(self, n: int) -> list[int]:
        if n > len(self._free_blocks):  # one prompt at a time holds the pool (ScoringQueue: FIFO)
            raise RuntimeError(f"internal error: the scorer's KV pool has {len(self._free_blocks)} free blocks, "
                               f"a prompt needs {n}: is another prompt being scored?")
        table, self._free_blocks = self._free_blocks[:n], self._free_blocks[n:]
        return table

    def _prefill_chunk(self, token_ids: list[int], start: int, table: list[int],
                       queries: list[torch.Tensor] | None) -> None:
        """One scorer forward over token_ids at `start`; `queries`: the last one, whose tail queries it takes."""
        if queries is not None:
            self._capture_queries(len(token_ids) - min(self.lookahead, start + len(token_ids)), queries)
        windowed = queries is None and self.window is not None  # the tail's own forward attends to every key
        if windowed:
            for attn in self._attns():
                attn.sliding_window = self.window
        try:
            self.runner.run(StepPlan.forward([token_ids], [start], [table], logits_rows=[]))
        finally:
            if queries is not None:
                self._release_queries()
            if windowed:  # the model may be the target's own: its layers stay full-attention
                for attn in self._attns():
                    attn.sliding_window = None

    def _tail_scores(self, queries: list[torch.Tensor], table: list[int], s: int) -> torch.Tensor:
        """Each layer's tail-query probabilities over the cached keys: max over layers, mean over the tail, pooled."""
        pos = torch.arange(s, device=self.model.device)
        slots = torch.tensor(table, device=pos.device)[pos // self.block_size] * self.block_size + pos % self.block_size
        best = torch.zeros(min(self.lookahead, s), s, dtype=torch.float32, device=pos.device)
        for attn, (k_cache, _), q in zip(self._attns(), self.runner.caches, queries):
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

    def _capture_queries(self, first_row: int, captured: list[torch.Tensor]) -> None:
        """Wrap each layer's attend to append its rotated queries of rows first_row.. (the tail) to `captured`."""
        for attn in self._attns():
            def attend(q, k, v, cos, sin, batch, attn=attn, original=attn.attend):
                rows = q[first_row:].reshape(-1, attn.num_heads, attn.head_dim)
                if attn.qk_norm:
                    rows = rms_norm_reference(rows, attn.q_norm.weight, attn.q_norm.eps)
                captured.append(apply_rope(rows, cos[first_row:], sin[first_row:]))
                return original(q, k, v, cos, sin, batch)
            attn.attend = attend

    def _release_queries(self) -> None:
        for attn in self._attns():
            attn.__dict__.pop("attend", None)
