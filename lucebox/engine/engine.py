"""LLMEngine: requests in, one batched forward per step, incremental outputs out."""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import replace

import torch

from ..config import EngineArgs, check_keep_ratio
from ..errors import ContextLengthError, OverloadError, RequestError, UnsupportedError
from ..kernels.forward_batch import MAX_TREE_TOKENS
from ..model.cache_spec import (RecurrentSpec, bytes_per_sequence, bytes_per_token, plan_pools, pools_bytes_wanted,
                                window_blocks)
from ..model.feature_ring import RingRows
from ..model.loader import LoadedModel
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..sampling.sampler import Sampler, make_generator
from ..spec.factory import make_speculator
from ..text.stop import StopChecker
from ..text.tokenizer import IncrementalDetokenizer
from ..util import host_to_device
from .build import args_and_model
from .cache_manager import CacheManager
from .cuda_graphs import GraphSettings
from .kv_pool import KVPool, device_tokens_per_sequence
from .output_processor import OutputProcessor
from .overlap import Overlap
from .pflash.prefill import SpeculativePrefill, for_engine
from .placement import check_device, is_split, layer_device, split_kv_budget
from .progress import PrefillProgress
from .runner import ModelRunner, model_kv_groups
from .scheduler import Scheduler
from .sequence import Sequence
from .state_snapshots import snapshot_bytes
from .step_plan import CATCH_UP_LENS, RowKind, StepPlan, StepPlanner, StepResult

log = logging.getLogger("lucebox")
CPU_KV_CAP = 2 << 30


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
        pools = self._plan_kv_blocks(specs, groups)
        num_blocks = pools[0]
        graphs = self._graph_settings()
        self.runner = self._make_runner(self.model, num_blocks, args.block_size, args.cache_type_k, args.cache_type_v,
                                  args.cache_rotate_k, graphs=graphs, state_slots=0, groups=groups,
                                  group_blocks=pools[1:])
        # Recurrent layers (hybrids): one state slot per running sequence, prefix reuse through state snapshots.
        cache = CacheManager(specs, pools, args.block_size, args.enable_prefix_caching, args.max_num_seqs,
                             self._recurrent_snapshots(specs), groups, self._prefix_snapshots())
        if cache.recurrent:
            devices = [layer_device(self.model, i) for i in self.runner.recurrent_layers]
            self.runner.install_recurrent(cache.build_recurrent(self.model.device, devices), cache.slot)
            if self.model.device.type == "cuda":
                self._warm_up_prefill()
        self.scheduler = Scheduler(cache, args.max_num_seqs, args.max_num_batched_tokens)
        if self.speculator is not None:
            proposer = self.speculator.proposer
            runner = None
            if proposer.runs_model is not None:
                # The target's graph buckets fit a draft model: a catch-up feed is at most 1 + k tokens,
                # then 1 a step. Drafts are sampled on the host (verification needs their q): no sampling graphs.
                own = proposer.runs_model.device != self.model.device  # --draft-device: eager there
                runner = ModelRunner(proposer.runs_model, num_blocks, args.block_size,
                                     graphs=replace(graphs, sample=False) if graphs is not None and not own else None)
            proposer.allocate(num_blocks, args.block_size, self.scheduler.blocks, graphs, runner)
            if proposer.feature_ring is not None:
                self.runner.set_feature_ring(proposer.feature_ring)
            proposer.capture_graphs()
        self.kv_pool = self._make_kv_pool(specs, groups) if args.kv_pool_tokens else None
        cache.kv_pool = self.kv_pool
        # Every bucket now: one first used mid-stream would stall its step by the capture. With taps,
        # also without them: a dormant drafter's decode steps take those.
        taps = self.speculator.capture_layers if self.speculator is not None else ()
        self.runner.capture_graphs(taps)
        if taps and not self.speculator.every_step:
            self.runner.capture_graphs((), trees=False)  # tree verifies always capture the taps
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        self.requests: dict[str, tuple[str | None, list[Sequence]]] = {}
        self.progress = PrefillProgress(args.max_num_batched_tokens)
        self.planner = StepPlanner(self.speculator, self.runner, cfg.vocab_size, args.async_decode, self.kv_pool)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       Sampler(self.eos_token_ids), self._release)
        # Steps by kind, for benchmarks: "verify" (some sequence verified drafts), "plain" (decodes only,
        # launched in turn), "overlapped" (decodes only, launched ahead), "prefill" (a prompt chunk in
        # it), and "unused ahead" (launched ahead, then not what the scheduler asked for).
        self.step_counts: collections.Counter = collections.Counter()
        self.overlap = Overlap(self.runner, self.scheduler, self.speculator, self.max_model_len, self.step_counts)
        self._arrivals = itertools.count()
        log.info("KV pool: %d blocks of %d tokens = %d tokens%s", num_blocks, args.block_size,
                 num_blocks * args.block_size, " (full-attention layers)" if len(groups) > 1 else "")
        for group, blocks in zip(groups[1:], pools[1:]):
            size = bytes_per_token([specs[i] for i in group.layers]) * args.block_size * blocks
            log.info("KV pool of %d sliding-window layers (window %d): %d blocks (%.1f MiB), the windows of %d "
                     "decoding sequences at once, whatever their length", len(group.layers), group.window, blocks,
                     size / 2**20, blocks // window_blocks(group.window, args.block_size, 1))

    def _make_kv_pool(self, specs, groups) -> KVPool:
        """KVFlash's pool over the primary KV cache group: the target's full-attention layers' caches and a
        proposer's on the same block table, host-backed."""
        args, runner = self.args, self.runner
        if self.speculator is not None and self.speculator.proposer.runs_model is not None:
            raise UnsupportedError("kv_pool_tokens (KVFlash) with a draft model (method draft_model) is not supported "
                                   "yet; use dflash or ngram speculation")
        target = [pair for layer, pair in zip(runner.paged_layers, runner.caches) if runner.layer_group[layer] == 0]
        proposer = list(getattr(self.speculator.proposer, "caches", ())) if self.speculator is not None else []
        caches = [c for pair in target + proposer for c in pair]
        windows = tuple(g.window for g in groups[1:])
        return KVPool(self.scheduler.cache, caches, [k for k, _ in target], args.kv_pool_tokens,
                      args.kv_reselect_interval, args.kv_pool_host_memory, self.max_model_len, windows,
                      args.max_num_seqs)

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
        return GraphSettings(self.max_model_len, min(self.args.cuda_graph_max_batch, self.args.max_num_seqs),
                             query_lens, catch_up_lens=catch_up, tree_lens=tree_lens)

    def _warm_up_prefill(self) -> None:
        """fla-core's prefill kernels autotune and compile on first use (minutes on a cold Triton cache):
        pay that at start, not in the first request."""
        start = time.perf_counter()
        log.info("compiling the Gated DeltaNet prefill kernels (a cold Triton cache takes minutes once)")
        self.model.warm_up()
        log.info("prefill kernels ready in %.1f s", time.perf_counter() - start)

    def _recurrent_snapshots(self, specs) -> int:
        """Recurrent stash rows per sequence: one per position of the longest verify row (the pending token
        and max_k drafts, or a draft tree's nodes), from which a commit advances the state over the
        accepted positions."""
        if not any(isinstance(s, RecurrentSpec) for s in specs):
            return 0
        if self.speculator is None:
            return 1  # a decode step launched ahead stashes its token until it is used (engine/overlap.py)
        if any(isinstance(s, RecurrentSpec) for s in self.speculator.proposer.cache_specs()):
            raise UnsupportedError("a draft model with recurrent (Gated DeltaNet) layers is not supported yet")
        return self.speculator.policy.row_tokens(self.speculator.policy.max_k)  # a chain's 1 + k, a tree's row

    def _prefix_snapshots(self) -> int:
        """Entries of the recurrent-state snapshot pool (engine/state_snapshots.py): none without prefix caching."""
        return self.args.recurrent_prefix_snapshots if self.args.enable_prefix_caching else 0

    def _plan_kv_blocks(self, specs, groups) -> list[int]:
        """Blocks of each KV cache group's pool (model/cache_spec.plan_pools); the primary's first."""
        args = self.args
        draft_device = getattr(self.speculator.proposer, "device", None) if self.speculator is not None else None
        seq_tokens = self.max_model_len
        if args.kv_pool_tokens:  # a pooled sequence holds its pool; only unpooled ones need a whole context
            seq_tokens = min(seq_tokens, device_tokens_per_sequence(args.kv_pool_tokens, args.max_num_batched_tokens,
                                                                    args.kv_reselect_interval))
        blocks_per_seq = -(-seq_tokens // args.block_size)
        # fixed-size state (recurrent layers) and its per-draft snapshots, for every sequence at once
        fixed = bytes_per_sequence(specs, self._recurrent_snapshots(specs)) * args.max_num_seqs
        fixed += snapshot_bytes(specs, self._prefix_snapshots())  # hybrids' prefix-reuse states

        def device_budget(device: torch.device) -> int:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # memory the caching allocator holds but no tensor uses counts as free
                free, total = torch.cuda.mem_get_info(device)
                return int(total * args.gpu_memory_utilization) - (total - free)
            wanted = pools_bytes_wanted(specs, groups, args.block_size, args.max_num_seqs,
                                        args.max_num_batched_tokens, seq_tokens)
            return min(CPU_KV_CAP, wanted + fixed)
        if args.kv_cache_memory:
            budget = args.kv_cache_memory
        elif is_split(self.model) or draft_device not in (None, self.model.device):
            layers = len(self.model.layers)  # each device's caches: its layers', the drafter's on its own
            devices = [layer_device(self.model, i) if i < layers else draft_device for i in range(len(specs))]
            budget = split_kv_budget(specs, devices, device_budget)
        else:
            budget = device_budget(self.model.device)
        budget -= fixed
        pools = plan_pools(specs, groups, budget, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                           self.max_model_len)
        num_blocks = pools[0]
        if num_blocks < blocks_per_seq:
            needed = (f"one pooled sequence ({seq_tokens} tokens: --kv-pool-tokens and a step's tokens)"
                      if args.kv_pool_tokens else f"one sequence of max_model_len={self.max_model_len}")
            raise RequestError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num_blocks * args.block_size} tokens, "
                f"less than {needed}; lower --max-model-len (or --kv-pool-tokens) or raise --kv-cache-memory / "
                f"--gpu-memory-utilization")
        return pools

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        waiting = len(self.scheduler.waiting)
        if waiting + params.n > self.args.max_queue:  # sequences, not requests: n=1000 is 1000 of them
            raise OverloadError(f"the server is busy: {waiting} sequences are waiting and this request adds "
                                f"{params.n} (--max-queue {self.args.max_queue}); retry later")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens; the context window (max_model_len) is {self.max_model_len}, "
                f"which leaves no room for output", len(ids), None, self.max_model_len)
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"window (max_model_len {self.max_model_len}); lower max_tokens to at most "
                f"{self.max_model_len - len(ids)}", len(ids), params.max_tokens, self.max_model_len)
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        params.verify_token_ids(vocab)
        params = params.with_defaults(self.loaded.generation_defaults)
        pooled = self._pooled(prompt.get("kv_pool") if isinstance(prompt, dict) else None)
        params = self._check_kv_room(len(ids), params, pooled)
        compression = self._compress(ids, prompt.get("prefill_keep_ratio") if isinstance(prompt, dict) else None)
        stored = compression.kept_ids if compression is not None else ids
        seqs = []
        for index in range(params.n):
            seq = Sequence(request_id, index, list(stored), params, arrival=next(self._arrivals),
                           compression=compression, kv_pool=pooled)
            seq.metrics.arrival_time = time.monotonic()
            seq.metrics.prompt_tokens_kept = len(stored) if compression is not None else None
            seq.generator = make_generator(params.seed, self.model.device, index)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                                     context_ids=ids[-4:])
            seq.stop_checker = StopChecker.from_params(params)
            seq.logprobs = [] if params.logprobs is not None else None
            seqs.append(seq)
        self.requests[request_id] = (text, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def _pooled(self, requested) -> bool:
        """Whether a request's target KV is pooled (KVFlash, lossy): its kv_pool field, else --kv-pool-target."""
        if requested is not None and not isinstance(requested, bool):
            raise RequestError(f"kv_pool must be true or false, got {requested!r}")
        if requested and self.kv_pool is None:
            raise UnsupportedError("kv_pool (KVFlash) needs the engine started with --kv-pool-tokens N")
        return self.args.kv_pool_target if requested is None else requested

    def _check_kv_room(self, prompt_len: int, params: SamplingParams, pooled: bool) -> SamplingParams:
        """A pooled request must fit the pool's host memory, an unpooled one the device's KV (with a pool,
        either may hold less than max_model_len: output then stops where it runs out)."""
        if self.kv_pool is None:
            return params
        wanted = prompt_len + (params.max_tokens if params.max_tokens is not None else 0)
        if pooled:
            room, where = self.kv_pool.host_capacity_tokens, "the KV pool's host memory (--kv-pool-host-memory) holds"
        else:
            room, where = self.kv_capacity_tokens, "the device holds, for a request without kv_pool (lossy),"
        if wanted > room or prompt_len >= room:
            raise ContextLengthError(f"the prompt ({prompt_len} tokens) plus max_tokens exceeds the {room} tokens of "
                                     f"KV {where}", prompt_len, params.max_tokens, room)
        return params if params.max_tokens is not None or room >= self.max_model_len else replace(
            params, max_tokens=room - prompt_len)

    def _compress(self, ids: list[int], keep_ratio):
        """PFlash (lossy): the kept part of a long prompt (a PromptCompression), or None to prefill it exactly."""
        check_keep_ratio(keep_ratio, "prefill_keep_ratio")
        ratio = keep_ratio if keep_ratio is not None else self.args.prefill_keep_ratio
        if ratio is None or len(ids) < self.args.prefill_min_tokens:
            return None
        if self.args.tensor_parallel_size > 1:  # the ranks' packed plans carry no position maps
            raise UnsupportedError("prefill_keep_ratio (speculative prefill) is not supported under tensor "
                                   "parallelism yet")
        return self.speculative_prefill().compress(ids, ratio)

    def speculative_prefill(self, scorer: LoadedModel | None = None, same_vocab: bool = False) -> SpeculativePrefill:
        """The PFlash scorer: built at start with --prefill-keep-ratio or --prefill-scorer (its memory
        planned before the KV pool's), else on first use (engine/pflash/prefill.for_engine); `scorer`
        and `same_vocab` (benches) apply when it is built."""
        if self._prefill is None:
            self._prefill = for_engine(self, scorer, same_vocab)
        return self._prefill

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
                self._release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """plan -> run -> commit: the speculator drafts (unless in a promised plain run), the scheduler
        picks the batch, the planner makes its StepPlan, the runner (or the step launched ahead for
        it) brings back its StepResult, and each row's tokens are committed and processed."""
        step_started = time.perf_counter()
        spec, overlap = self.speculator, self.overlap
        if spec is not None and not overlap.continues_run():
            spec.propose(self._recompute_taps(spec.choose(self.scheduler.running)))
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self._release(seq, finished=False)
        if not batch.seqs:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress (KV pool too small for any waiting sequence)")
            return []
        plan = self.planner.plan(batch, overlap.in_run)
        result, overlapped = overlap.run(plan)
        verifying = plan.of(RowKind.VERIFY)
        self.step_counts["prefill" if plan.prefilling else "verify" if verifying else "overlapped" if overlapped
                         else "plain"] += 1
        self._commit_step(plan, result)
        touched = dict.fromkeys(row.seq.request_id for row in plan.of(RowKind.DECODE) + verifying)
        outputs = self.outputs.collect(self.requests, touched)
        if spec is not None:  # the step's full cost, outputs too
            seconds = time.perf_counter() - step_started
            if overlap.in_run:
                overlap.time_run_step(batch.total_tokens, seconds)
            else:
                spec.record_step(batch.total_tokens, seconds, overlapped)
        return outputs

    def _commit_step(self, plan: StepPlan, result: StepResult) -> None:
        """Commit every row's positions, then process what it brought back: decodes' logits rows
        come first, then each verify's k + 1."""
        features, out = result.features, self.outputs
        for row in plan.of(RowKind.CHUNK):
            self._commit(row.seq, len(row.tokens), features, row.offset)
            self.progress.chunk_done(row.seq)
        decodes, verifies = plan.of(RowKind.DECODE), plan.of(RowKind.VERIFY)
        if decodes:
            tokens, logprobs = out.decode_tokens(decodes, result)
            for row, token, lp in zip(decodes, tokens, logprobs):
                seq = row.seq
                self._commit(seq, seq.num_tokens - seq.num_computed, features, row.offset)
                self.progress.prompt_done(seq)
                out.append(seq, token, lp)
        if verifies:
            for row in verifies:
                row.seq.draft = None
            verdicts, logprobs = out.verdicts(verifies, result, len(decodes))
            self._compact_trees(verifies, verdicts)
            with self.scheduler.cache.commits_batched():  # recurrent state: every verify's in one launch a layer
                for row, verdict, lps in zip(verifies, verdicts, logprobs):
                    seq = row.seq
                    # A tree's draft length is its depth: the chain it stands in for.
                    drafted = max(row.depths) if row.depths is not None else len(row.draft.tokens)
                    # a tree's top-1 chain is rows 1..depth (best-first takes it first at each depth; DFS order)
                    chain = (next((j for j, r in enumerate(verdict.rows) if r != j), len(verdict.rows)) - 1
                             if verdict.rows is not None else None)
                    self.speculator.record(seq, drafted, verdict.num_accepted, chain)
                    taps, at = features, row.offset
                    if verdict.rows is not None and isinstance(features, RingRows):  # a graph step's ring rows
                        self._compact_ring_rows(features, row.offset, verdict.rows)
                    elif verdict.rows is not None and features is not None:  # the accepted nodes' taps, in order
                        taps, at = features[host_to_device([row.offset + r for r in verdict.rows], features.device,
                                                           torch.long)], 0
                    self._commit(seq, 1 + verdict.num_accepted, taps, at)  # the pending token + accepted
                    self.scheduler.cache.rollback(seq, seq.num_computed + 1, verdict.num_accepted,  # rejected drafts
                                                  verdict.rows)  # a tree's accepted rows: the state follows them
                    out.append_tokens(seq, verdict.tokens, lps)
        if self.kv_pool is not None:  # host copies of the step's full blocks, then resident sets re-chosen
            self.kv_pool.finish_step(result.queries, {id(row.seq): row.index for row in plan.rows})

    def _compact_trees(self, verifies, verdicts) -> None:
        """Tree verifies stored node i at start + i: the accepted path's K/V move onto start + 0, 1, ...
        (as if verified as a chain); what lies past them is rolled back like rejected chain drafts."""
        moved = [(row, v.rows) for row, v in zip(verifies, verdicts)
                 if v.rows is not None and v.rows != list(range(len(v.rows)))]
        if moved:
            self.runner.compact_tree_rows([row.block_table for row, _ in moved], [row.start for row, _ in moved],
                                          [rows for _, rows in moved], [row.window_tables for row, _ in moved])

    def _compact_ring_rows(self, features: RingRows, offset: int, accepted: list[int]) -> None:
        """A tree verify through a graph wrote its taps to feature-ring rows: the accepted nodes' rows
        move onto the row's first ones, in order (one gather before the writes, as kv_compact does)."""
        if accepted == list(range(len(accepted))):
            return
        ring = self.speculator.proposer.feature_ring.rows
        first = features.first + offset
        src = host_to_device([first + r for r in accepted], ring.device, torch.long)
        dst = host_to_device(list(range(first, first + len(accepted))), ring.device, torch.long)
        ring.index_copy_(0, dst, ring.index_select(0, src))

    def _commit(self, seq: Sequence, n: int, features, offset: int) -> None:
        """The next n positions of seq (their K/V written this step) are now committed."""
        spec = self.speculator
        if features is not None:
            spec.observe(seq, seq.num_computed, features[offset:offset + n])
        elif spec is not None and spec.capture_layers and (spec.every_step or not self.overlap.in_run):
            spec.missed(seq, seq.num_computed)  # a dormant drafter's step (a run's: told already; every_step: raises)
        seq.num_computed += n
        self.scheduler.cache.commit(seq)
        if self.kv_pool is not None:
            self.kv_pool.committed(seq, n)

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
