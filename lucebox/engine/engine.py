"""LLMEngine: requests in, one batched forward per step, incremental outputs out."""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import replace

import torch

from ..config import EngineArgs
from ..errors import ContextLengthError, OverloadError, RequestError
from ..model.cache_spec import bytes_per_sequence, bytes_per_token
from ..model.loader import LoadedModel
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling import SamplingParams
from ..sampling.acceptance import Verdict, accept_argmax, accept_batch, verdicts_of
from ..sampling.sampler import Sampler, SamplerOutput, make_generator, raw_logprobs
from ..spec.factory import make_speculator
from ..text.stop import StopChecker
from ..text.tokenizer import IncrementalDetokenizer
from ..util import host_to_device
from .cache_manager import CacheManager
from .cuda_graphs import DeferredStep, GraphSettings
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger("lucebox")
CPU_KV_CAP = 2 << 30
# Catch-up graph lengths of the taps a dormant drafter missed while the target decoded plainly
# (speculator.py), beside the verify lengths; longer runs go in chunks of the last.
CATCH_UP_LENS = (32, 64, 128, 256)
# The steps of a run the speculator promised plain (Speculator.plain_run) are reported to it as the
# mean time of this many (or of fewer, when the run ends first).
RUN_TIMED_STEPS = 8


class LLMEngine:
    def __init__(self, loaded: LoadedModel, args: EngineArgs):
        self.loaded, self.args = loaded, args
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        cfg = loaded.config
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's %d positions", self.max_model_len,
                        cfg.max_position_embeddings)
        self.speculator = make_speculator(args.speculative_config, loaded, self.max_model_len)
        self.model.fuse_projections()  # q/k/v and gate/up as one GEMV each (idempotent)
        self.model.split_quant_rows()  # the GPU decode kernels' Q8_0 / Q6_K layout (idempotent)
        # The state every layer and the proposer keep per sequence: the planner and cache manager read it.
        specs = self.model.cache_specs(args.cache_type_k, args.cache_type_v, args.cache_rotate_k)
        specs += self.speculator.proposer.cache_specs() if self.speculator is not None else []
        num_blocks = self._plan_kv_blocks(specs)
        graphs = self._graph_settings()
        self.runner = ModelRunner(self.model, num_blocks, args.block_size, args.cache_type_k, args.cache_type_v,
                                  args.cache_rotate_k, graphs=graphs)
        cache = CacheManager(specs, num_blocks, args.block_size, args.enable_prefix_caching, args.max_num_seqs)
        self.scheduler = Scheduler(cache, args.max_num_seqs, args.max_num_batched_tokens,
                                   on_release=self.speculator.release if self.speculator else None)
        if self.speculator is not None:
            proposer = self.speculator.proposer
            runner = None
            if proposer.runs_model is not None:
                # The target's graph buckets fit a draft model: a catch-up feed is at most 1 + k tokens,
                # then 1 a step. Drafts are sampled on the host (verification needs their q): no sampling graphs.
                runner = ModelRunner(proposer.runs_model, num_blocks, args.block_size,
                                     graphs=replace(graphs, sample=False) if graphs is not None else None)
            proposer.allocate(num_blocks, args.block_size, self.scheduler.blocks, graphs, runner)
            if proposer.feature_ring is not None:
                self.runner.set_feature_ring(proposer.feature_ring)
            proposer.capture_graphs()
            self.speculator.recompute_taps = self._recompute_taps
        # Every bucket now: one first used mid-stream would stall its step by the capture. With taps,
        # also without them: a dormant drafter's decode steps take those.
        taps = self.speculator.capture_layers if self.speculator is not None else ()
        self.runner.capture_graphs(taps)
        if taps:
            self.runner.capture_graphs(())
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.requests: dict[str, tuple[str | None, list[Sequence]]] = {}
        self._ahead: _AheadStep | None = None  # a decode step launched before its turn (async_decode)
        # Steps launched ahead that the speculator promised plain (Speculator.plain_run), not consulted
        # for them; whether this step is one; and the run's steps not yet reported: count, seconds, size.
        self._run_left, self._in_run = 0, False
        self._run_steps, self._run_seconds, self._run_tokens = 0, 0.0, 0
        # Steps by kind, for benchmarks: "verify" (some sequence verified drafts), "plain" (decodes only,
        # launched in turn), "overlapped" (decodes only, launched ahead), "prefill" (a prompt chunk in
        # it), and "unused ahead" (launched ahead, then not what the scheduler asked for).
        self.step_counts: collections.Counter = collections.Counter()
        self._arrivals = itertools.count()
        log.info("KV pool: %d blocks of %d tokens = %d tokens", num_blocks, args.block_size,
                 num_blocks * args.block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.runner.block_size

    def _graph_settings(self) -> GraphSettings | None:
        """CUDA-graph buckets: decodes (1 token), and verifies of every draft length the policy picks."""
        enabled = self.args.cuda_graphs
        if not (self.model.device.type == "cuda" if enabled is None else enabled):
            return None
        query_lens = (1,)
        if self.speculator is not None:
            query_lens += tuple(k + 1 for k in self.speculator.policy.candidates)
        catch_up = CATCH_UP_LENS if self.speculator is not None and self.speculator.capture_layers else ()
        return GraphSettings(self.max_model_len, min(self.args.cuda_graph_max_batch, self.args.max_num_seqs),
                             query_lens, catch_up_lens=catch_up)

    def _plan_kv_blocks(self, specs) -> int:
        args = self.args
        per_block = bytes_per_token(specs) * args.block_size  # the drafter's KV shares the target's tables
        blocks_per_seq = -(-self.max_model_len // args.block_size)
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()  # memory the caching allocator holds but no tensor uses counts as free
            free, total = torch.cuda.mem_get_info(self.model.device)
            used = total - free
            budget = args.kv_cache_memory or int(total * args.gpu_memory_utilization) - used
        else:
            budget = args.kv_cache_memory or min(CPU_KV_CAP, per_block * blocks_per_seq * args.max_num_seqs)
        budget -= bytes_per_sequence(specs) * args.max_num_seqs  # fixed-size state (recurrent layers)
        num_blocks = budget // per_block
        if num_blocks < blocks_per_seq:
            raise RequestError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num_blocks * args.block_size} tokens, "
                f"less than one sequence of max_model_len={self.max_model_len}; lower --max-model-len or "
                f"raise --kv-cache-memory / --gpu-memory-utilization")
        return int(num_blocks)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(self.scheduler.waiting) >= self.args.max_queue:
            raise OverloadError(f"the server is busy: {len(self.scheduler.waiting)} requests are waiting "
                                f"(--max-queue {self.args.max_queue}); retry later")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens; the context window (max_model_len) is {self.max_model_len}, "
                f"which leaves no room for output")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"window (max_model_len {self.max_model_len}); lower max_tokens to at most "
                f"{self.max_model_len - len(ids)}")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        params.verify_token_ids(vocab)
        params = params.with_defaults(self.loaded.generation_defaults)
        seqs = []
        for index in range(params.n):
            seq = Sequence(request_id, index, list(ids), params, arrival=next(self._arrivals))
            seq.metrics.arrival_time = time.monotonic()
            seq.generator = make_generator(params.seed, self.model.device, index)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                                     context_ids=ids[-4:])
            seq.stop_checker = StopChecker.from_params(params)
            seq.logprobs = [] if params.logprobs is not None else None
            seqs.append(seq)
        self.requests[request_id] = (text, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise RequestError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def abort(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        for seq in entry[1]:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        step_started = time.perf_counter()
        spec = self.speculator
        if spec is not None:
            self._in_run = self._continues_run()
            if not self._in_run:
                spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress (KV pool too small for any waiting sequence)")
            return []
        # Logits rows: plain decodes first, then every verifying sequence's k + 1 rows, contiguous.
        token_ids, plain_rows, verify_rows, plain, verifying, chunks = [], [], [], [], [], []
        offset, prefilling = 0, False  # prefilling: some prompt tokens are in this step
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            drafts = seq.draft.tokens if seq.draft is not None else []
            start, end, committed = seq.num_computed, seq.num_computed + n, seq.num_tokens
            tokens = seq.token_slice(start, min(end, committed))
            if end > committed:  # the drafts being verified follow the committed tokens
                tokens += drafts[max(0, start - committed):end - committed]
            token_ids.append(tokens)
            if seq.num_computed + n < seq.num_tokens:  # a prefill chunk short of the end: nothing to sample
                chunks.append((seq, n, offset))
            elif drafts:
                verifying.append((seq, offset))
                verify_rows.extend(range(offset + n - 1 - len(drafts), offset + n))
            else:
                plain.append((seq, offset))
                plain_rows.append(offset + n - 1)
            prefilling = prefilling or (not drafts and (n > 1 or seq.num_computed + n < seq.num_tokens))
            offset += n
        # The drafter's taps: always for prompts (a dormant drafter recomputes only decoded positions).
        capture = ()
        if spec is not None and (prefilling or (not self._in_run and spec.taps_needed())):
            capture = spec.capture_layers
        # All greedy with nothing processing the logits: argmax tokens come back, not logits.
        argmax = all(seq.params.argmax_only(len(seq.output_token_ids)) for seq, _ in plain + verifying)
        # Simply sampled rows with deterministic drafts (or none): sampled and accepted in the graph.
        sample = None
        if (not argmax and self.runner.graphs is not None and not chunks
                and all(seq.params.graph_samplable(len(seq.output_token_ids)) for seq in batch.seqs)
                and all(seq.draft.probs is None for seq, _ in verifying)):
            sample = [seq.params.graph_row(self.model.config.vocab_size) for seq in batch.seqs]
        rows = self.speculator.proposer.feature_rows(batch.total_tokens) if capture else None
        ahead, self._ahead = self._ahead, None
        overlap = self.args.async_decode and not chunks and not verifying and not capture
        overlapped = ahead is not None and overlap and ahead.covers(batch, argmax, sample)
        if ahead is not None and not overlapped:
            self.step_counts["unused ahead"] += 1
        self.step_counts["prefill" if prefilling else "verify" if verifying else "overlapped" if overlapped
                         else "plain"] += 1
        if overlapped:
            out = ahead.step  # launched by the previous step, fed its tokens on the device
        else:
            out = self.runner.run(token_ids, [s.num_computed for s in batch.seqs], [s.block_table for s in batch.seqs],
                                  logits_rows=plain_rows + verify_rows, capture_layers=capture, argmax=argmax,
                                  feature_rows=rows, sample=sample, defer=overlap)
        if isinstance(out, DeferredStep):
            self._ahead = self._launch_ahead(batch, out, sample)
            out = out.result()[0]
        logits, features = out if capture else (out, None)
        # [drafts accepted, next token] per sequence when the graph sampled and accepted
        in_graph = dict(zip(map(id, batch.seqs), logits)) if sample is not None and isinstance(logits, list) else None
        for seq, n, offset in chunks:
            self._commit(seq, n, features, offset)
        if plain:
            if in_graph is not None:
                tokens, logprobs = [in_graph[id(seq)][1] for seq, _ in plain], [None] * len(plain)
            elif isinstance(logits, list):  # argmax inside the graph
                tokens, logprobs = logits[:len(plain)], [None] * len(plain)
            else:
                sampled = self.sampler(logits[:len(plain)], [seq for seq, _ in plain])
                tokens, logprobs = sampled.sampled_token_ids.tolist(), sampled.logprob_dicts(self.tokenizer.id_to_token)
            for (seq, offset), token, lp in zip(plain, tokens, logprobs):
                self._commit(seq, seq.num_tokens - seq.num_computed, features, offset)
                self._append(seq, token, lp)
        if verifying:
            pairs = [in_graph[id(seq)] for seq, _ in verifying] if in_graph is not None else None
            self._verify(verifying, features, logits[len(plain):], pairs)
        touched = dict.fromkeys(seq.request_id for seq, _ in plain + verifying)
        outputs = [self._request_output(rid) for rid in touched if rid in self.requests and self._reports(rid)]
        if spec is not None:  # the step's full cost, outputs too
            seconds = time.perf_counter() - step_started
            if self._in_run:
                self._time_run_step(batch.total_tokens, seconds)
            else:
                spec.record_step(batch.total_tokens, seconds, overlapped)
        return outputs

    def _continues_run(self) -> bool:
        """Whether this step is the next of a run the speculator promised plain, launched ahead for an
        unchanged batch with nobody waiting. Anything else ends the run and reports its time."""
        ahead = self._ahead
        if self._run_left and ahead is not None and ahead.seqs == self.scheduler.running and not self.scheduler.waiting:
            self._run_left -= 1
            return True
        self._run_left = 0
        self._report_run()
        return False

    def _time_run_step(self, num_tokens: int, seconds: float) -> None:
        self._run_steps += 1
        self._run_seconds += seconds
        self._run_tokens = num_tokens
        if self._run_steps == RUN_TIMED_STEPS:
            self._report_run()

    def _report_run(self) -> None:
        if self._run_steps:
            self.speculator.record_plain_steps(self._run_tokens, self._run_seconds / self._run_steps)
            self._run_steps, self._run_seconds = 0, 0.0

    def _launch_ahead(self, batch, step: DeferredStep, sample: list | None) -> _AheadStep | None:
        """Launch the next decode step of the same sequences before this one's tokens are read, its
        input ids copied on the device from this step's (EngineArgs.async_decode): the host's
        launch, upload and bookkeeping then overlap the GPU's work instead of following it. Only
        when the next step is predictable: nobody waiting to join, every sequence with room for
        one more token, the same kind of step (argmax or sampled in the graph) after this one's
        token, and a speculator that promises (Speculator.plain_run: binding, a run of steps) or guesses
        (guesses_plain) that the step neither drafts nor captures taps. A sequence that this step's
        token finishes (or a draft after all, on a guess) makes the launched step go unused."""
        seqs = batch.seqs
        if self.scheduler.waiting or any(n != 1 for n in batch.num_new_tokens):
            return None
        blocks = self.scheduler.blocks
        if any(s.num_tokens + 1 >= self.max_model_len or not blocks.can_allocate(s.block_table, s.num_computed + 2)
               for s in seqs):
            return None
        argmax = all(s.params.argmax_only(len(s.output_token_ids) + 1) for s in seqs)
        if not argmax and (sample is None or not all(s.params.graph_samplable(len(s.output_token_ids) + 1)
                                                     for s in seqs)):
            return None
        next_sample = None if argmax else sample
        starts = [s.num_computed + 1 for s in seqs]
        tables = [s.block_table for s in seqs]
        if self.runner.graphs.bucket([[0]] * len(seqs), starts, tables) is None:
            return None
        if self.speculator is not None and not self._run_left:  # last: a promise binds
            self._run_left = self.speculator.plain_run(seqs)
            if not self._run_left and not self.speculator.guesses_plain(seqs):
                return None
        for s in seqs:
            blocks.allocate(s.block_table, s.num_computed + 2)
        launched = self.runner.run([[0]] * len(seqs), starts, tables, logits_rows=list(range(len(seqs))),
                                   argmax=argmax, sample=next_sample, ids_from=step.device_tokens, defer=True)
        if not isinstance(launched, DeferredStep):  # graphs without in-graph sampling: logits, already read
            return None
        return _AheadStep(seqs, starts, argmax, next_sample, launched)

    def _commit(self, seq: Sequence, n: int, features, offset: int) -> None:
        """The next n positions of seq (their K/V written this step) are now committed."""
        if features is not None:
            self.speculator.observe(seq, seq.num_computed, features[offset:offset + n])
        elif self.speculator is not None and self.speculator.capture_layers and not self._in_run:
            self.speculator.missed(seq, seq.num_computed)  # a dormant drafter's step (a run's: told already)
        seq.num_computed += n
        self.scheduler.cache.commit(seq)

    def _recompute_taps(self, seq: Sequence, start: int):
        """The drafter's taps of seq's positions start..num_computed-1, whose K/V the cache holds, in
        (start, features) chunks: target passes of up to CATCH_UP_LENS[-1] tokens that write no
        K/V, through the catch-up CUDA graphs when they fit."""
        taps, proposer = self.speculator.capture_layers, self.speculator.proposer
        for begin in range(start, seq.num_computed, CATCH_UP_LENS[-1]):
            end = min(begin + CATCH_UP_LENS[-1], seq.num_computed)
            _, features = self.runner.run([seq.token_slice(begin, end)], [begin], [seq.block_table], logits_rows=[],
                                          capture_layers=taps, feature_rows=proposer.feature_rows(end - begin),
                                          write_kv=False)
            yield begin, features

    def _verify(self, verifying: list[tuple[Sequence, int]], features, logits: torch.Tensor | list[int],
                in_graph: list[list[int]] | None = None) -> None:
        """Accept every verifying sequence's drafts at once (logits: their k + 1 rows each, in order,
        or those rows' argmax tokens; or the graph's [drafts accepted, token] per sequence); keep the
        K/V of accepted positions, forget the rest, append the new tokens."""
        seqs = [seq for seq, _ in verifying]
        drafts = [seq.draft for seq in seqs]
        for seq in seqs:
            seq.draft = None
        if in_graph is not None:
            verdicts = verdicts_of(drafts, in_graph)
            logprobs = [[None] * len(v.tokens) for v in verdicts]
        elif isinstance(logits, list):
            verdicts = accept_argmax(logits, drafts)
            logprobs = [[None] * len(v.tokens) for v in verdicts]
        else:
            verdicts = accept_batch(self.sampler, logits, seqs, drafts)
            starts = list(itertools.accumulate((len(d.tokens) + 1 for d in drafts[:-1]), initial=0))
            logprobs = self._logprobs(seqs, logits, starts, verdicts)
        for (seq, offset), draft, verdict, lps in zip(verifying, drafts, verdicts, logprobs):
            self.speculator.record(seq, len(draft.tokens), verdict.num_accepted)
            self._commit(seq, 1 + verdict.num_accepted, features, offset)  # the pending token + accepted drafts
            self.scheduler.cache.rollback(seq, seq.num_computed + 1, verdict.num_accepted)
            if seq.params.stop or seq.logprobs is not None:
                for token, lp in zip(verdict.tokens, lps):  # a stop string may end it at any token
                    self._append(seq, token, lp)
                    if seq.is_finished:
                        break
            else:
                self._append_run(seq, verdict.tokens)

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
            rows += range(starts[i], starts[i] + n)
            tokens += verdicts[i].tokens
            num += [seqs[i].params.logprobs] * n
        tensors = raw_logprobs(logits[rows], host_to_device(tokens, logits.device), num)
        dicts = iter(SamplerOutput(torch.tensor(tokens), tensors).logprob_dicts(self.tokenizer.id_to_token))
        for i in want:
            out[i] = [next(dicts) for _ in verdicts[i].tokens]
        return out

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in (seq.params.stop_token_ids or ()) or (token in self.eos_token_ids and not seq.params.ignore_eos)

    def _at_length(self, seq: Sequence) -> bool:
        max_tokens = seq.params.max_tokens
        return ((max_tokens is not None and len(seq.output_token_ids) >= max_tokens)
                or seq.num_tokens >= self.max_model_len)

    def _stop_reason(self, seq: Sequence, token: int) -> int | None:
        """The stop reason of a stop token: its id when the request named it, None for EOS."""
        return token if token in (seq.params.stop_token_ids or ()) else None

    def _append(self, seq: Sequence, token: int, logprobs: dict | None) -> None:
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

    def _append_run(self, seq: Sequence, tokens: list[int]) -> None:
        """`_append` of several tokens for a sequence without stop strings or logprobs: the same
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
        self.scheduler.finish(seq)

    def _reports(self, request_id: str) -> bool:
        """Whether this step reports the request: every step (cumulative) or once it finishes."""
        seqs = self.requests[request_id][1]
        return seqs[0].params.output_kind == "cumulative" or all(s.is_finished for s in seqs)

    def _request_output(self, request_id: str) -> RequestOutput:
        text, seqs = self.requests[request_id]
        outputs = [CompletionOutput(s.index, s.text, list(s.output_token_ids),
                                    s.cumulative_logprob if s.logprobs is not None else None,
                                    list(s.logprobs) if s.logprobs is not None else None,
                                    s.finish_reason, s.stop_reason) for s in seqs]
        finished = all(s.is_finished for s in seqs)
        if finished:
            del self.requests[request_id]
        return RequestOutput(request_id, text, seqs[0].prompt_token_ids, outputs, finished,
                             seqs[0].num_cached_tokens or 0, _merge_metrics([s.metrics for s in seqs]))


def _merge_metrics(per_seq: list[RequestMetrics]) -> RequestMetrics:
    """One request's metrics: timing of its first sample, speculative counters summed over its n samples."""
    first = per_seq[0]
    merged = RequestMetrics(first.arrival_time, first.first_token_time,
                            max((m.finished_time for m in per_seq if m.finished_time), default=None))
    for m in per_seq:
        merged.num_drafts += m.num_drafts
        merged.num_draft_tokens += m.num_draft_tokens
        merged.num_accepted_tokens += m.num_accepted_tokens
        for i, n in enumerate(m.accepted_per_position):
            if i == len(merged.accepted_per_position):
                merged.accepted_per_position.append(0)
            merged.accepted_per_position[i] += n
    return merged


class _AheadStep:
    """A decode step launched before its turn (LLMEngine._launch_ahead), and what it assumed."""

    def __init__(self, seqs: list[Sequence], starts: list[int], argmax: bool, sample: list | None,
                 step: DeferredStep):
        self.seqs, self.starts, self.argmax, self.sample, self.step = list(seqs), starts, argmax, sample, step

    def covers(self, batch, argmax: bool, sample: list | None) -> bool:
        """This step is exactly the one the scheduler now asks for."""
        return (len(batch.seqs) == len(self.seqs) and all(a is b for a, b in zip(batch.seqs, self.seqs))
                and all(n == 1 for n in batch.num_new_tokens)
                and [s.num_computed for s in batch.seqs] == self.starts
                and argmax == self.argmax and (argmax or sample == self.sample))
