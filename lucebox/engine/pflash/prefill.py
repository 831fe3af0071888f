"""SpeculativePrefill: the engine's entry to PFlash. job(prompt ids, keep ratio) scores the prompt with
the scorer (re-tokenised for it when its tokenizer is not the target's) and selects chunks, a unit of
work at a time (a ScoringJob, which the engine advances between its steps); its result is the
PromptCompression the target prefills, or None for a prompt kept exact. compress runs one at once."""
from __future__ import annotations

import gc
import logging
from collections.abc import Generator

import torch

from ...config import check_keep_ratio
from ...errors import RequestError, UnsupportedError
from ...model.loader import LoadedModel, load_model
from .jobs import ScoringJob
from .positions import PromptCompression
from .score import TailAttentionScorer
from .select import SelectionRules, decoded_with_ends_steps, kept_token_spans, map_spans, select_chunks

log = logging.getLogger("lucebox")
TEXT_SLICE = 16384  # target or scorer tokens detokenised per unit of a job (~30 ms of Python)


class SpeculativePrefill:
    def __init__(self, scorer_model, scorer_tokenizer, target_tokenizer, max_tokens: int, min_tokens: int,
                 default_ratio: float | None, rules: SelectionRules = SelectionRules(), **scorer_options):
        check_keep_ratio(default_ratio, "prefill_keep_ratio")
        self.scorer = TailAttentionScorer(scorer_model, max_tokens, **scorer_options)
        self.scorer_tokenizer, self.target_tokenizer = scorer_tokenizer, target_tokenizer
        self.min_tokens, self.default_ratio, self.rules = min_tokens, default_ratio, rules
        self.last_seconds = 0.0  # the last finished job's scoring time, its units' sum (benchmarks)

    @property
    def same_tokenizer(self) -> bool:
        """The scorer reads the target's token ids as they are (None: the same vocabulary, e.g. random shapes)."""
        return self.scorer_tokenizer is None or self.scorer_tokenizer is self.target_tokenizer

    def job(self, ids: list[int], keep_ratio: float | None = None) -> ScoringJob | None:
        """A resumable compression of a prompt (engine/pflash/jobs.py; keep_ratio: the request's, else the
        engine's default); None when it stays exact (no ratio, or shorter than min_tokens)."""
        ratio = keep_ratio if keep_ratio is not None else self.default_ratio
        check_keep_ratio(ratio, "prefill_keep_ratio")
        if ratio is None or len(ids) < self.min_tokens:
            return None
        return ScoringJob(self, self._steps(ids, ratio), len(ids), ratio)

    def compress(self, ids: list[int], keep_ratio: float | None = None) -> PromptCompression | None:
        """The kept tokens of a prompt, at once (benchmarks; the engine runs `job` a unit a step); None when
        it stays exact."""
        job = self.job(ids, keep_ratio)
        return job.run() if job is not None else None

    def _steps(self, ids: list[int], ratio: float) -> Generator[tuple[int, int] | None, None, PromptCompression | None]:
        """The work of a compression, a unit per next(): re-tokenising for the scorer (TEXT_SLICE tokens a unit),
        each scorer chunk (yielding (scorer tokens prefilled, of)), the tail scores, then the selection."""
        if self.same_tokenizer:
            scorer_ids = ids
        else:
            text, target_ends = yield from decoded_with_ends_steps(self.target_tokenizer, ids, TEXT_SLICE)
            scorer_ids = self.scorer_tokenizer.encode(text, add_special_tokens=False)
            if len(scorer_ids) > self.scorer.max_tokens:  # another tokenizer may need more tokens
                log.warning("speculative prefill skipped: the scorer's tokenisation (%d tokens) exceeds its %d",
                            len(scorer_ids), self.scorer.max_tokens)
                return None
            yield None
        self._check_scorer_ids(scorer_ids)
        scores = yield from self.scorer.steps(scorer_ids)
        chunks = select_chunks(scores, scorer_ids, ratio, self.rules)
        spans = kept_token_spans(chunks, self.rules.chunk, len(scorer_ids))
        if self.same_tokenizer:
            kept = [i for a, b in spans for i in range(a, b)]
        else:
            _, scorer_ends = yield from decoded_with_ends_steps(self.scorer_tokenizer, scorer_ids, TEXT_SLICE)
            kept = map_spans(spans, scorer_ends, target_ends)
            if not kept or kept[-1] != len(ids) - 1:  # the prompt's last token always (it decodes next)
                kept.append(len(ids) - 1)
        return PromptCompression(list(ids), kept)

    def _check_scorer_ids(self, scorer_ids: list[int]) -> None:
        """Ids past the scorer's embedding (a tokenizer with more tokens than its model, or the target's ids read
        as they are) would fail its forward, on a GPU for every request: this prompt's error alone instead."""
        vocab = self.scorer.model.config.vocab_size
        bad = next((t for t in scorer_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"speculative prefill cannot score this prompt: the scorer's tokenisation holds token "
                               f"id {bad}, outside the scorer's vocabulary (0..{vocab - 1}); send it without "
                               f"prefill_keep_ratio, or name a scorer that reads the target's tokens "
                               f"(--prefill-scorer)")


def for_engine(engine, scorer: LoadedModel | None = None, same_vocab: bool = False) -> SpeculativePrefill:
    """An engine's SpeculativePrefill: `scorer`, else --prefill-scorer's model, else the target scoring its
    own prompts; a KV pool of the engine's max_model_len. same_vocab: score the target's token ids as
    they are (benchmarks of random shapes), not re-tokenised text."""
    args = engine.args
    if scorer is None:
        scorer = engine.loaded
        if args.prefill_scorer is not None:
            scorer = load_model(args.prefill_scorer, dtype=args.dtype, device=str(engine.model.device))
    try:
        return SpeculativePrefill(scorer.model, None if same_vocab else scorer.tokenizer, engine.tokenizer,
                                  engine.max_model_len, args.prefill_min_tokens, args.prefill_keep_ratio,
                                  block_size=args.block_size, window=args.prefill_scorer_window or None)
    except ValueError as e:
        raise UnsupportedError(f"speculative prefill: {e}; name another scorer with --prefill-scorer") from None
    except torch.OutOfMemoryError:
        # built on a first request after the KV pool took the card: what was allocated goes, nothing else moves
        gc.collect()
        torch.cuda.empty_cache()
        raise UnsupportedError("speculative prefill (prefill_keep_ratio): the scorer's KV does not fit beside "
                               "the engine's KV pool; start the engine with --prefill-keep-ratio or "
                               "--prefill-scorer so its memory is planned first, or lower "
                               "--gpu-memory-utilization") from None
