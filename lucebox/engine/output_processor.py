"""Output processing: a step's result turned into tokens, then text, stops, logprobs and RequestOutputs.

The engine commits each row's K/V (engine.py); this module picks each decode's token and each
verify's verdict from the StepResult, appends tokens to their sequences, detokenises incrementally,
applies stop tokens and stop strings, records logprobs and metrics, and finishes sequences through
the `finish` the engine hands it (which also tells the speculator).
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import torch

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling.acceptance import Verdict, accept_argmax, accept_batch, verdicts_of
from ..sampling.sampler import Sampler, SamplerOutput, raw_logprobs
from ..util import host_to_device
from .sequence import Sequence
from .step_plan import PlanRow, StepResult


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, sampler: Sampler,
                 finish: Callable[[Sequence], None]):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
        self.sampler, self._release = sampler, finish

    # ------------------------------------------------------------------ tokens from a result
    def decode_tokens(self, rows: list[PlanRow], result: StepResult) -> tuple[list[int], list[dict | None]]:
        """The next token of each decode row (its logits rows come first) and its logprobs."""
        if result.verdicts is not None:  # sampled in the graph
            return [result.verdicts[row.index][1] for row in rows], [None] * len(rows)
        if result.tokens is not None:  # argmax inside the graph
            return result.tokens[:len(rows)], [None] * len(rows)
        sampled = self.sampler(result.logits[:len(rows)], [row.seq for row in rows])
        return sampled.sampled_token_ids.tolist(), sampled.logprob_dicts(self.tokenizer.id_to_token)

    def verdicts(self, rows: list[PlanRow], result: StepResult,
                 first: int) -> tuple[list[Verdict], list[list[dict | None]]]:
        """Accept every verify row's drafts at once (their k + 1 logits rows each, in order, from
        logits row `first`; or the graph's verdicts) and the logprobs of the tokens committed."""
        seqs, drafts = [row.seq for row in rows], [row.draft for row in rows]
        if result.verdicts is not None:
            verdicts = verdicts_of(drafts, [result.verdicts[row.index] for row in rows])
        elif result.tokens is not None:
            verdicts = accept_argmax(result.tokens[first:], drafts)
        else:
            logits = result.logits[first:]
            verdicts = accept_batch(self.sampler, logits, seqs, drafts)
            starts = list(itertools.accumulate((len(d.tokens) + 1 for d in drafts[:-1]), initial=0))
            return verdicts, self._logprobs(seqs, logits, starts, verdicts)
        return verdicts, [[None] * len(v.tokens) for v in verdicts]

    def _logprobs(self, seqs: list[Sequence], logits: torch.Tensor, starts: list[int],
                  verdicts: list[Verdict]) -> list[list[dict | None]]:
        """Per sequence, the logprobs of its committed tokens (rows starts[i]..), for all at once."""
        out: list[list[dict | None]] = [[None] * len(v.tokens) for v in verdicts]
        want = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not want:
            return out
        rows, tokens, num = [], [], []
        for i in want:
            n = len(verdicts[i].tokens)
            rows += [starts[i] + r for r in (verdicts[i].rows or range(n))]  # a tree's: its accepted rows
            tokens += verdicts[i].tokens
            num += [seqs[i].params.logprobs] * n
        tensors = raw_logprobs(logits[rows], host_to_device(tokens, logits.device), num)
        dicts = iter(SamplerOutput(torch.tensor(tokens), tensors).logprob_dicts(self.tokenizer.id_to_token))
        for i in want:
            out[i] = [next(dicts) for _ in verdicts[i].tokens]
        return out

    # ------------------------------------------------------------------ appending
    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[dict | None]) -> None:
        """A verify's committed tokens: one at a time where a stop string or logprobs may end or
        annotate any of them, else as one run."""
        if seq.params.stop or seq.logprobs is not None:
            for token, lp in zip(tokens, logprobs):
                self.append(seq, token, lp)
                if seq.is_finished:
                    break
        else:
            self.append_run(seq, tokens)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in (seq.params.stop_token_ids or ()) or (token in self.eos_token_ids and not seq.params.ignore_eos)

    def _at_length(self, seq: Sequence) -> bool:
        max_tokens = seq.params.max_tokens
        return ((max_tokens is not None and len(seq.output_token_ids) >= max_tokens)
                or seq.num_tokens >= self.max_model_len)

    @staticmethod
    def _stop_reason(seq: Sequence, token: int) -> int | None:
        """The stop reason of a stop token: its id when the request named it, None for EOS."""
        return token if token in (seq.params.stop_token_ids or ()) else None

    def append(self, seq: Sequence, token: int, logprobs: dict | None) -> None:
        seq.output_token_ids.append(token)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        if self._is_stop_token(seq, token):
            # The stop token itself is not part of the text (vLLM's behaviour).
            if self._emit(seq, seq.detokenizer.flush(), final=True):
                return
            return self._finish(seq, "stop", self._stop_reason(seq, token))
        if self._emit(seq, seq.detokenizer.push(token)):
            return
        if self._at_length(seq):
            if not self._emit(seq, seq.detokenizer.flush(), final=True):
                self._finish(seq, "length", None)

    def append_run(self, seq: Sequence, tokens: list[int]) -> None:
        """`append` of several tokens for a sequence without stop strings or logprobs: the same
        outputs, with one detokenizer call for the run instead of one per token (two tokenizer
        decodes each: the host cost of a long accepted block)."""
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        text_ids, reason, stop_token = [], None, None
        for token in tokens:
            seq.output_token_ids.append(token)
            if self._is_stop_token(seq, token):
                reason, stop_token = "stop", self._stop_reason(seq, token)  # not part of the text
                break
            text_ids.append(token)
            if self._at_length(seq):
                reason = "length"
                break
        if text_ids:
            self._emit(seq, seq.detokenizer.push(text_ids))
        if reason is not None:
            self._emit(seq, seq.detokenizer.flush(), final=True)
            self._finish(seq, reason, stop_token)

    def _emit(self, seq: Sequence, piece: str, final: bool = False) -> bool:
        """Pass new text through the stop-string check; True when a stop string ended the sequence."""
        emitted, stopped, matched = seq.stop_checker.feed(piece)
        seq.text += emitted
        if stopped:
            self._finish(seq, "stop", matched)
            return True
        if final:
            seq.text += seq.stop_checker.flush()
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finished_time = time.monotonic()
        self._release(seq)

    # ------------------------------------------------------------------ request outputs
    def collect(self, requests: dict, request_ids) -> list[RequestOutput]:
        """The outputs this step reports among these requests: every step (cumulative) or once
        finished; finished requests leave `requests`."""
        return [self.request_output(requests, rid) for rid in request_ids
                if rid in requests and _reports(requests[rid][1])]

    @staticmethod
    def request_output(requests: dict, request_id: str) -> RequestOutput:
        text, seqs = requests[request_id]
        outputs = [CompletionOutput(s.index, s.text, list(s.output_token_ids),
                                    s.cumulative_logprob if s.logprobs is not None else None,
                                    list(s.logprobs) if s.logprobs is not None else None,
                                    s.finish_reason, s.stop_reason) for s in seqs]
        finished = all(s.is_finished for s in seqs)
        if finished:
            del requests[request_id]
        return RequestOutput(request_id, text, seqs[0].request_prompt_ids, outputs, finished,
                             seqs[0].num_cached_tokens or 0, merge_metrics([s.metrics for s in seqs]))


def _reports(seqs: list[Sequence]) -> bool:
    return seqs[0].params.output_kind == "cumulative" or all(s.is_finished for s in seqs)


def merge_metrics(per_seq: list[RequestMetrics]) -> RequestMetrics:
    """One request's metrics: timing of its first sample, speculative counters summed over its n samples."""
    first = per_seq[0]
    merged = RequestMetrics(first.arrival_time, first.first_token_time,
                            max((m.finished_time for m in per_seq if m.finished_time), default=None),
                            prompt_tokens_kept=first.prompt_tokens_kept)
    for m in per_seq:
        merged.num_drafts += m.num_drafts
        merged.num_draft_tokens += m.num_draft_tokens
        merged.num_accepted_tokens += m.num_accepted_tokens
        for i, n in enumerate(m.accepted_per_position):
            if i == len(merged.accepted_per_position):
                merged.accepted_per_position.append(0)
            merged.accepted_per_position[i] += n
    return merged
