"""LLMEngine: requests in, one batched forward per step, incremental outputs out."""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import replace


from ..config import EngineArgs, check_keep_ratio
from ..errors import OverloadError, RequestError, UnsupportedError
from ..kernels.forward_batch import MAX_TREE_TOKENS
from ..model.cache_spec import RecurrentSpec, bytes_per_token, window_blocks
from ..model.loader import LoadedModel, check_device
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..sampling.sampler import Sampler, make_generator
from ..spec.factory import make_speculator
from ..text.stop import StopChecker
from ..text.tokenizer import IncrementalDetokenizer
from . import admission
from .build import args_and_model
from .cache_manager import CacheManager
from .commit import StepCommitter
from .graph_settings import GraphSettings
from .memory_plan import make_kv_pool, plan_kv_blocks, stash_rows
from .output_processor import OutputProcessor
from .overlap import Overlap
from .pflash.jobs import ScoringJob, ScoringQueue
from .pflash.prefill import SpeculativePrefill, for_engine
from .placement import is_split, layer_device
from .progress import PrefillProgress
from .runner import ModelRunner, model_kv_groups, release_installed_caches
from .scheduler import Scheduler
from .sequence import Sequence
from .step_plan import (
    CATCH_UP_LENS,
    PREFILL_GRAPH_LENS,
    RowKind,
    StepPlanner,
    recurrent_prefill_graph_max,
)

log = logging.getLogger("lucebox")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, args: EngineArgs):
        self.loaded, self.args = loaded, args
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        cfg = loaded.config
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's %d positions", self.max_model_len,
                        cfg.max_position_embeddings)
        draft_device = check_device(args.draft_device, "--draft-device") if args.draft_device else None
        self.speculator = make_speculator(args.speculative_config, self._draft_target(loaded), self.max_model_len,
                                          draft_device, args.draft_kv_pool_tokens)
        # PFlash's scorer and its KV pool before the target's pool is sized from what memory is left
        self._prefill: SpeculativePrefill | None = None
        if args.prefill_keep_ratio is not None or args.prefill_scorer is not None:
            self._prefill = for_engine(self)
        self.model.fuse_projections()  # q/k/v and gate/up as one GEMV each (idempotent)
        self.model.split_quant_rows()  # the GPU decode kernels' Q8_0 / Q6_K layout (idempotent)
        # The state every layer and the proposer keep per sequence: the planner and cache manager read it.
        specs = self.model.cache_specs(args.cache_type_k, args.cache_type_v, args.cache_rotate_k)
        if self.speculator is not None and any(isinstance(s, RecurrentSpec) for s in specs):
            # Recurrent state cannot be recomputed over cached positions: taps captured in every step.
            self.speculator.capture_every_step()
        specs += self.speculator.proposer.cache_specs() if self.speculator is not None else []
        groups = model_kv_groups(self.model, specs)  # layers sharing a block table: full, each sliding window
        self._check_trees(specs)
        if self.speculator is not None and (len(groups) > 1 or args.kv_pool_tokens):
            # Window blocks behind the context, and pooled blocks, are released: taps cannot be recomputed there.
            self.speculator.capture_every_step()
        release_installed_caches(self.model)  # an earlier engine's KV on this loaded model goes first
        pools = plan_kv_blocks(self, specs, groups)
        num_blocks = pools[0]
        graphs = self._graph_settings()
        self.runner = self._make_runner(self.model, num_blocks, args.block_size, args.cache_type_k, args.cache_type_v,
                                  args.cache_rotate_k, graphs=graphs, state_slots=0, groups=groups,
                                  group_blocks=pools[1:])
        # Recurrent layers (hybrids): one state slot per running sequence, prefix reuse through state snapshots.
        cache = CacheManager(specs, pools, args.block_size, args.enable_prefix_caching, args.max_num_seqs,
                             stash_rows(self.speculator, specs), groups, self._prefix_snapshots())
        if cache.recurrent:
            devices = [layer_device(self.model, i) for i in self.runner.recurrent_layers]
            self.runner.install_recurrent(cache.build_recurrent(self.model.device, devices), cache.slot)
            self._recurrent_installed(cache)
            if self.model.device.type == "cuda":
                self.model.warm_up()  # fla-core's prefill kernels compile now, not in the first request
        self.scheduler = Scheduler(cache, args.max_num_seqs, args.max_num_batched_tokens)
        if self.speculator is not None:
            proposer = self.speculator.proposer
            runner = None
            if proposer.runs_model is not None:
                # The target's graph buckets fit a draft model: a catch-up feed is at most 1 + k tokens,
                # then 1 a step. Drafts are sampled on the host (verification needs their q): no sampling graphs.
                own = proposer.runs_model.device != self.model.device  # --draft-device: eager there
                slots = proposer.state_slots(args.max_num_seqs)
                draft_graphs = None if graphs is None or own else replace(graphs, sample=False, prefill_lens=tuple(
                    q for q in graphs.prefill_lens if not slots or q <= recurrent_prefill_graph_max()))
                runner = ModelRunner(proposer.runs_model, num_blocks, args.block_size, graphs=draft_graphs,
                                     **({"state_slots": slots} if slots else {}))
            proposer.allocate(num_blocks, args.block_size, self.scheduler.blocks, graphs, runner)
            if proposer.feature_ring is not None:
                self.runner.set_feature_ring(proposer.feature_ring)
            proposer.capture_graphs()
        self.kv_pool = make_kv_pool(self, specs, groups) if args.kv_pool_tokens else None
        cache.kv_pool = self.kv_pool
        # Every bucket now: one first used mid-stream would stall its step by the capture. With taps,
        # also without them: a dormant drafter's decode steps take those.
        taps = self.speculator.capture_layers if self.speculator is not None else ()
        self.runner.capture_graphs(taps)
        if taps and not self.speculator.every_step:
            self.runner.capture_graphs((), trees=False, prefill=False)  # trees and prompts always capture the taps
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        self.requests: dict[str, tuple[str | None, list[Sequence]]] = {}
        self.scoring = ScoringQueue()  # PFlash: requests whose prompts are being scored
        self.progress = PrefillProgress(args.max_num_batched_tokens)
        self.planner = StepPlanner(self.speculator, self.runner, cfg.vocab_size, args.async_decode, self.kv_pool)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       Sampler(self.eos_token_ids), self._release)
        # Steps by kind, for benchmarks: "verify" (some sequence verified drafts), "plain" (decodes only,
        # launched in turn), "overlapped" (decodes only, launched ahead), "prefill" (a prompt chunk in
        # it), and "unused ahead" (launched ahead, then not what the scheduler asked for).
        self.step_counts: collections.Counter = collections.Counter()
        self.overlap = Overlap(self.runner, self.scheduler, self.speculator, self.max_model_len, self.step_counts)
        self.committer = StepCommitter(self.scheduler, self.runner, self.speculator, self.outputs, self.progress,
                                       self.overlap, self.kv_pool)
        self._arrivals = itertools.count()
        log.info("KV pool: %d blocks of %d tokens = %d tokens%s", num_blocks, args.block_size,
                 num_blocks * args.block_size, " (full-attention layers)" if len(groups) > 1 else "")
        for group, blocks in zip(groups[1:], pools[1:]):
            size = bytes_per_token([specs[i] for i in group.layers]) * args.block_size * blocks
            log.info("KV pool of %d sliding-window layers (window %d): %d blocks (%.1f MiB), the windows of %d "
                     "decoding sequences at once, whatever their length", len(group.layers), group.window, blocks,
                     size / 2**20, blocks // window_blocks(group.window, args.block_size, 1))

    def _check_trees(self, specs) -> None:
        """Draft trees need every layer to follow a node's ancestors alone: attention layers (tree mask), whose
        sliding windows (if any) span a whole tree row (kernels/forward_batch.check_tree_window), and Gated
        DeltaNet layers (kernels/gated_delta_tree.py)."""
        if self.speculator is None or self.speculator.tree_budget is None:
            return
        short = sorted({w for s in specs if (w := getattr(s, "window", None)) is not None and w < MAX_TREE_TOKENS})
        if short:
            raise UnsupportedError(f"speculative_config['tree_budget'] (draft trees) needs sliding-window layers' "
                                   f"windows of at least {MAX_TREE_TOKENS} positions (a tree verify row), this "
                                   f"model has window(s) {short}; drop tree_budget to speculate with chains")

    @classmethod
    def from_args(cls, args: EngineArgs, loaded: LoadedModel | None = None) -> LLMEngine:
        """The one way to build an engine (CLI, LLM, server, benches): the bundled default pair when
        args.model is None, the model loaded unless `loaded` is given (engines may share one)."""
        if args.tensor_parallel_size > 1:  # one process a rank, this one rank 0 (engine/tensor_parallel.py)
            from .tensor_parallel import launch
            return launch(args, loaded)
        args, loaded = args_and_model(args, loaded)
        return cls(loaded, args)

    def shutdown(self) -> None:
        """Stop what this engine started besides itself (tensor parallelism: the other ranks); idempotent."""

    def _recurrent_installed(self, cache) -> None:
        """The runner keeps the cache manager's recurrent states now (tensor parallelism: the other ranks
        build theirs, before any graph is captured over them)."""

    def _draft_target(self, loaded: LoadedModel) -> LoadedModel:
        """The target as the speculator sees it (tensor parallelism: with its vocabulary unsharded)."""
        return loaded

    def _make_runner(self, *args, **kwargs) -> ModelRunner:
        """The target's ModelRunner (tensor parallelism: one that broadcasts each step to the other ranks)."""
        return ModelRunner(*args, **kwargs)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.runner.block_size

    def _graph_settings(self) -> GraphSettings | None:
        """CUDA-graph buckets: decodes (1 token), and verifies of every draft length the policy picks."""
        enabled = self.args.cuda_graphs
        if is_split(self.model):
            log.info("CUDA graphs off: the model is split across devices (--device-map); every step runs eagerly")
            return None
        if not (self.model.device.type == "cuda" if enabled is None else enabled):
            return None
        query_lens = (1,)
        if self.speculator is not None:
            query_lens += tuple(k + 1 for k in self.speculator.policy.candidates)
        spec = self.speculator
        catch_up = CATCH_UP_LENS if spec is not None and spec.capture_layers and not spec.every_step else ()
        tree_lens = tuple(spec.tree_row_lens()) if spec is not None else ()
        recurrent = any(isinstance(s, RecurrentSpec) for s in self.model.cache_specs())
        # A bucket's padding sequence spans its whole length: no longer than a sequence or a step may be
        longest = min(recurrent_prefill_graph_max() if recurrent else PREFILL_GRAPH_LENS[-1], self.max_model_len,
                      self.args.max_num_batched_tokens)
        prefill_lens = tuple(q for q in PREFILL_GRAPH_LENS if q <= longest) if self.args.prefill_graphs else ()
        return GraphSettings(self.max_model_len, min(self.args.cuda_graph_max_batch, self.args.max_num_seqs),
                             query_lens, catch_up_lens=catch_up, tree_lens=tree_lens, prefill_lens=prefill_lens,
                             queries=self.args.kv_pool_tokens > 0)

    def _prefix_snapshots(self) -> int:
        """Entries of the recurrent-state snapshot pool (engine/state_snapshots.py): none without prefix caching."""
        return self.args.recurrent_prefix_snapshots if self.args.enable_prefix_caching else 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        text, ids = admission.tokenize(self.tokenizer, prompt)
        waiting = len(self.scheduler.waiting) + self.scoring.num_sequences
        if waiting + params.n > self.args.max_queue:  # sequences, not requests: n=1000 is 1000 of them
            raise OverloadError(f"the server is busy: {waiting} sequences are waiting and this request adds "
                                f"{params.n} (--max-queue {self.args.max_queue}); retry later")
        admission.check_prompt(ids, params, self.max_model_len, self.model.config.vocab_size)
        params = params.with_defaults(self.loaded.generation_defaults)
        pooled = admission.pooled(self, prompt.get("kv_pool") if isinstance(prompt, dict) else None)
        params = admission.fit_kv_room(self, len(ids), params, pooled)
        scoring = self._compress(ids, prompt.get("prefill_keep_ratio") if isinstance(prompt, dict) else None)
        seqs = []
        for index in range(params.n):
            seq = Sequence(request_id, index, list(ids), params, arrival=next(self._arrivals), kv_pool=pooled)
            seq.metrics.arrival_time = time.monotonic()
            seq.generator = make_generator(params.seed, self.model.device, index)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                                     context_ids=ids[-4:])
            seq.stop_checker = StopChecker.from_params(params)
            seq.logprobs = [] if params.logprobs is not None else None
            seqs.append(seq)
        self.requests[request_id] = (text, seqs)
        if scoring is not None:  # its sequences wait for the scorer (step: _advance_scoring), then the scheduler
            self.scoring.add(request_id, scoring, len(seqs))
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _compress(self, ids: list[int], keep_ratio) -> ScoringJob | None:
        """PFlash (lossy): the job scoring a long prompt for its kept part, or None to prefill it exactly."""
        check_keep_ratio(keep_ratio, "prefill_keep_ratio")
        ratio = keep_ratio if keep_ratio is not None else self.args.prefill_keep_ratio
        if ratio is None or len(ids) < self.args.prefill_min_tokens:
            return None
        if self.args.tensor_parallel_size > 1:  # the ranks' packed plans carry no position maps
            raise UnsupportedError("prefill_keep_ratio (speculative prefill) is not supported under tensor "
                                   "parallelism yet")
        return self.speculative_prefill().job(ids, ratio)

    def _advance_scoring(self) -> list[RequestOutput]:
        """PFlash: one unit of the oldest prompt being scored (engine/pflash/jobs.py). Once scored, its
        sequences join the waiting queue (arriving now); if scoring failed, its request alone ends with
        the error (RequestOutput.error), the others untouched."""
        advanced = self.scoring.advance()
        if advanced is None:
            return []
        request_id, job = advanced
        if job.progress is not None:
            self.progress.scoring_done(request_id, *job.progress, job.chunk)
        if not job.done:
            return []
        seqs = self.requests[request_id][1]
        if job.error is None:
            for seq in seqs:
                if job.result is not None:
                    seq.prompt_token_ids, seq.compression = job.result.kept_ids, job.result
                    seq.metrics.prompt_tokens_kept = len(seq.prompt_token_ids)
                seq.arrival = next(self._arrivals)
                self.scheduler.add(seq)
            return []
        error = job.request_error
        log.warning("request %s failed: %s", request_id, error)
        for seq in seqs:
            seq.finish_reason, seq.metrics.finished_time = "error", time.monotonic()
            self._release(seq)
        output = self.outputs.request_output(self.requests, request_id)
        output.error = error
        return [output]

    def speculative_prefill(self, scorer: LoadedModel | None = None, same_vocab: bool = False) -> SpeculativePrefill:
        """The PFlash scorer: built at start with --prefill-keep-ratio or --prefill-scorer (its memory
        planned before the KV pool's), else on first use (engine/pflash/prefill.for_engine); `scorer`
        and `same_vocab` (benches) apply when it is built."""
        if self._prefill is None:
            self._prefill = for_engine(self, scorer, same_vocab)
        return self._prefill

    def abort(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        self.scoring.cancel(request_id)  # mid-scoring: the scorer's KV blocks go back
        for seq in entry[1]:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """plan -> run -> commit: the speculator drafts (unless in a promised plain run), the scheduler
        picks the batch, the planner makes its StepPlan, the runner (or the step launched ahead for
        it) brings back its StepResult, and each row's tokens are committed and processed."""
        failed = self._advance_scoring()  # PFlash: at most one scorer chunk a step, between the others' steps
        step_started = time.perf_counter()  # the speculator's step cost: the batch's alone
        spec, overlap = self.speculator, self.overlap
        if self.kv_pool is not None:  # resident sets whose page-ins landed take over before anything reads them
            self.kv_pool.land()
        if spec is not None and not overlap.continues_run():
            spec.propose(self._recompute_taps(spec.choose(self.scheduler.running)))
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self._release(seq, finished=False)
        if not batch.seqs:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress (KV pool too small for any waiting sequence)")
            return failed
        plan = self.planner.plan(batch, overlap.in_run)
        result, overlapped = overlap.run(plan)
        verifying = plan.of(RowKind.VERIFY)
        self.step_counts["prefill" if plan.prefilling else "verify" if verifying else "overlapped" if overlapped
                         else "plain"] += 1
        self.committer.commit_step(plan, result)
        touched = dict.fromkeys(row.seq.request_id for row in plan.of(RowKind.DECODE) + verifying)
        outputs = failed + self.outputs.collect(self.requests, touched)
        if spec is not None:  # the step's full cost, outputs too
            seconds = time.perf_counter() - step_started
            if overlap.in_run:
                overlap.time_run_step(batch.total_tokens, seconds)
            else:
                spec.record_step(batch.total_tokens, seconds, overlapped)
        return outputs

    def _recompute_taps(self, late: list[tuple[Sequence, int]]):
        """(seq, start, features) chunks of the drafter's taps each late sequence missed from start,
        computed lazily as the speculator reads them (StepPlanner.catch_up)."""
        for seq, start in late:
            if self.speculator.every_step:
                raise RuntimeError("internal error: a catch-up over cached positions was planned on a target with "
                                   "recurrent layers (it would advance their state twice) or released window blocks")
            for begin, plan in self.planner.catch_up(seq, start):
                yield seq, begin, self.runner.run(plan).features

    def _release(self, seq: Sequence, finished: bool = True) -> None:
        """seq finished (its blocks freed now) or was preempted: the speculator drops its state."""
        if self.speculator is not None:
            self.speculator.release(seq, finished)
        self.progress.forget(seq.request_id)
        if finished:
            self.scheduler.finish(seq)
