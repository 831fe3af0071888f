"""CUDA graphs for decode and verify steps: one launch per step instead of hundreds.

At small batch a decode step is a few hundred tiny kernels, and Python plus launch overhead, not
the GPU, sets its time. A captured graph replays the whole target forward (LM head and the
captured DFlash taps included) as one launch.

A graph is captured per bucket (batch size B, query length Q): B from 1, 2, 4, ... up to
`max_batch`, Q from the step shapes the engine produces (1 for a decode, 1 + k for a verify with k
drafts). A step fits a bucket when it has at most B sequences each bringing at most Q tokens (no
prefill chunks); it is padded up to exactly B x Q tokens:
  - missing sequences and the tokens a short sequence lacks are padding; their K/V go to a scratch
    block the scheduler never hands out, and their positions are 0 (only RoPE reads them);
  - a row rotated a constant past its storage (PlanRow.rope_shift: decoding past a PFlash-compressed
    prompt, a KVFlash view's tail) has start + i + shift staged in the static positions (storage,
    slots and lengths stay start + i), so the same graph serves it; rows with a map of positions
    (a compressed prompt's chunks) run eagerly;
  - a sequence's context length counts its padding (seq_len = start + Q), so the kernels see a
    uniform layout; causality keeps padding invisible to real tokens, which all come first;
  - block tables are `width` = ceil((max_model_len + max Q) / block_size) wide, filled with the
    scratch block past each sequence's end, so every block a kernel may touch exists; a model
    mixing sliding-window and full attention has one static table (and slot mapping) per KV cache
    group, each padded with its own group's scratch block (`group_scratch`).
Inputs go through static device buffers (graph_io.StaticInputs: one host-to-device copy of a packed
int64 buffer plus one of the block tables); outputs are static buffers from which the real rows are
gathered, so a step has no host sync of its own. The engine captures every bucket when it starts (capture_all),
into one shared memory pool, after the KV pool exists; a bucket not captured yet is captured the
first time it is used.

Tree verify steps (a row holding a draft tree: PlanRow.parents) have buckets of their own, keyed by
(B, Q) with Q = 1 + a tree's node count (`tree_lens`: the node counts of the tree budgets in use).
Their graphs read a static tree-mask buffer (ForwardBatch.tree_mask) and depth-based positions;
every other row of the step (chain verifies, decodes) shares the bucket with mask -1, which is
plain causal attention, and padding rows are -1 too (they come after every real token). Chain
steps never replay a tree graph (the tree mask would cost them the kernel's mask path), and tree
steps never a chain graph. Tree buckets hold at most as many tokens as the largest chain bucket
(or one tree row): the static buffers, logits above all, keep their size; wider tree steps run
eagerly. Models with recurrent layers run tree steps eagerly (their state must follow each
node's parents, which the static state inputs do not describe).

Prefill buckets (GraphSettings.prefill_lens, EngineArgs.prefill_graphs): a step of one sequence
bringing more tokens than any step bucket (a short prompt, a prompt's last chunk, a turn on top of a
cached prefix) is padded to the smallest prefill length that holds it (within MAX_PADDING), so an
eager prefill's hundreds of launches become one replay. Attention takes the Triton kernel's
graph-safe mode; the LM head runs over the selected row only (the last token), into row 0 of the
logits; a drafter's taps go to the feature ring like a decode step's; recurrent (DeltaNet) layers
take the steps path token by token, their slot advanced over the real tokens only (padding comes
after them). Steps that want other rows, queries or taps without a ring (a drafter on its own
device) stay eager.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import Counter

import numpy as np
import torch

from ..kernels.forward_batch import ForwardBatch
from ..model.feature_ring import RingRows
from ..sampling.acceptance import accept_in_graph
from ..util import smallest_at_least
from .graph_io import DeferredStep, HostBuffers, StaticInputs
from .graph_settings import MAX_PADDING, GraphSettings, batch_buckets
from .step_plan import StepPlan, StepResult

log = logging.getLogger("lucebox")

class CudaGraphRunner:
    """Runs the steps that fit a bucket through captured graphs (or, with capture=False, through
    the same padded static batches eagerly); ModelRunner falls back to eager for the rest."""

    def __init__(self, model, block_size: int, scratch_block: int, settings: GraphSettings,
                 group_scratch: tuple[int, ...] = ()):
        """group_scratch: the scratch block of each KV cache group after the primary (mixed windows)."""
        self.model, self.block_size, self.scratch_block, self.settings = model, block_size, scratch_block, settings
        self.group_scratch = tuple(group_scratch)
        groups = 1 + len(self.group_scratch)
        self.query_lens = sorted(set(settings.query_lens))
        self.catch_up_lens = sorted(set(settings.catch_up_lens) | set(self.query_lens))
        self.tree_lens = sorted(set(settings.tree_lens))
        self.batch_sizes = batch_buckets(settings.max_batch)
        self.width = -(-(settings.max_model_len + max(self.query_lens + self.tree_lens)) // block_size)
        # a padding sequence's keys are its whole bucket: past its block table, they would be garbage pages
        self.prefill_lens = sorted(q for q in set(settings.prefill_lens)
                                   if self.query_lens[-1] < q <= self.width * block_size)
        step_tokens = max([self.batch_sizes[-1] * self.query_lens[-1], *self.tree_lens[-1:]])
        # (B, Q) tree buckets: no wider than a chain step (or one tree row), as the module docstring says
        self.tree_buckets = {(b, q) for b in self.batch_sizes for q in self.tree_lens if b == 1 or b * q <= step_tokens}
        self.max_tokens = max(step_tokens, self.catch_up_lens[-1])
        self.inputs = StaticInputs(step_tokens, self.batch_sizes[-1], self.width, model.device, groups)
        # Catch-ups and prefills longer than any step get their own buffers: decode steps keep uploading
        # the few hundred bytes their buffers span.
        longest = max([self.catch_up_lens[-1], *self.prefill_lens[-1:]])
        self.long_inputs = (StaticInputs(longest, 1, self.width, model.device, groups)
                            if longest > step_tokens else None)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        # per capture_layers: logits, features (or None) and argmax token of every padded row, and
        # the verdict of every sequence of a sampling graph
        self.outputs: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.replays: Counter = Counter()  # (B, Q) -> steps run through that bucket
        self.tree_replays: Counter = Counter()  # (B, Q) -> tree steps run through that tree bucket
        self.query_out: dict[int, torch.Tensor] = {}  # KVFlash: id(k_cache) -> [max batch, heads, head_dim]
        self.feature_ring = None  # a FeatureRing: captured features are written there (set before capture)
        self._host_buffers = HostBuffers(self.max_tokens, model.device)  # deferred steps' results
        # Models with recurrent layers: plan -> (slot, advance) per row, and the pool's scratch slot
        # (padding sequences read and write it); set by ModelRunner.
        self.state_rows = None
        self.scratch_slot = lambda: 0
        model.rope.reserve(self.width * block_size, model.device)

    def _inputs(self, query_len: int, tree: bool = False) -> "StaticInputs":
        """The long buffers for catch-ups and prefills longer than any step (tree buckets are steps)."""
        if self.long_inputs and not tree and query_len > self.query_lens[-1]:
            return self.long_inputs
        return self.inputs

    def bucket(self, token_ids: list[list[int]], start_positions: list[int],
               block_tables: list[list[int]], catch_up: bool = False, tree: bool = False,
               rope_shifts: list[int] | None = None) -> tuple[int, int] | None:
        """(B, Q) of the bucket this step fits, or None to run it eagerly; catch_up: one sequence
        recomputing taps, which also fits the catch-up lengths; tree: some row is a tree verify
        (a tree bucket); rope_shifts: each row's PlanRow.rope_shift (its rotated positions must stay
        inside the RoPE table reserved at capture)."""
        q_lens = [len(t) for t in token_ids]
        if not q_lens or min(q_lens) < 1 or (catch_up and len(q_lens) > 1) or (tree and self.state_rows is not None):
            return None
        lens = self.tree_lens if tree else self.catch_up_lens if catch_up else self.query_lens
        if lens is self.query_lens and max(q_lens) > lens[-1]:  # a prefill: one plain sequence
            if len(q_lens) > 1:
                return None
            lens = self.prefill_lens
        num_seqs = smallest_at_least(len(q_lens), self.batch_sizes)
        query_len = smallest_at_least(max(q_lens), lens)
        if num_seqs is None or query_len is None or num_seqs * query_len > MAX_PADDING * sum(q_lens):
            return None
        if tree and (num_seqs, query_len) not in self.tree_buckets:
            return None
        limit = self.width * self.block_size
        if any(s + query_len > limit for s in start_positions) or any(len(t) > self.width for t in block_tables):
            return None
        if rope_shifts is not None and any(s + shift < 0 or s + shift + query_len > limit
                                           for s, shift in zip(start_positions, rope_shifts)):
            return None
        return num_seqs, query_len

    def key_for(self, plan: StepPlan) -> tuple | None:
        """The graph this step replays, (B, Q, taps, sampled, tree, queries, prefill), or None to run it eagerly."""
        capture_layers = tuple(plan.capture_layers)
        tree = plan.has_trees
        shape = self.bucket(plan.token_ids, plan.start_positions, plan.block_tables, catch_up=not plan.write_kv,
                            tree=tree, rope_shifts=plan.rope_shifts)
        ring = self.feature_ring is not None and bool(capture_layers)
        if shape is None or (ring and plan.feature_rows is None) or (plan.capture_queries and not self.settings.queries):
            return None
        num_seqs, query_len = shape
        prefill = plan.write_kv and not tree and query_len > self.query_lens[-1]
        if prefill and ((capture_layers and not ring) or plan.capture_queries or plan.all_logits
                        or not _last_token_at_most(plan)):
            return None  # a prefill graph hands back one row's logits, taps through the ring only, no queries
        # else logits come back; tree and prefill steps never sample in the graph (the host samples them)
        sampled = plan.sample is not None and self.settings.sample and not tree and not prefill
        return num_seqs, query_len, capture_layers, sampled, tree, plan.capture_queries, prefill

    def run(self, plan: StepPlan) -> StepResult | None:
        """replay(plan, key_for(plan)); None when the step fits no bucket."""
        key = self.key_for(plan)
        return None if key is None else self.replay(plan, key)

    @torch.inference_mode()
    def replay(self, plan: StepPlan, key: tuple) -> StepResult:
        """ModelRunner.run's contract for a step through the graph of `key` (key_for's; a tensor-parallel rank
        other than 0 takes rank 0's, its plan bringing no sampling parameters, no taps ring of its own): with
        plan.sample (each row its pending token and deterministic drafts, every one a logits row) on
        a sampling graph, verdicts; with argmax, tokens; else logits; features, or their RingRows.
        write_kv=False: every K/V write goes to the scratch block.

        Overlapped decoding (EngineArgs.async_decode): plan.defer returns a DeferredStep at once for
        argmax and sampling steps (its `result()` waits for the step; its `device_tokens` feed the
        next step), and plan.ids_from (a decode step's: one token a sequence) takes the input tokens
        from such a step's device_tokens instead of the rows' tokens."""
        token_ids, block_tables = plan.token_ids, plan.block_tables
        start_positions, feature_rows, logits_rows = plan.start_positions, plan.feature_rows, plan.logits_rows
        rope_shifts = plan.rope_shifts
        num_seqs, query_len, capture_layers, sampled, tree, queries, prefill = key
        shape = (num_seqs, query_len)
        ring = self.feature_ring is not None and bool(capture_layers)
        if key not in self.graphs:
            self._prepare(*key)
        graph, query_start_loc = self.graphs[key]
        inputs = self._inputs(query_len, tree)
        state_rows = None
        if self.state_rows is not None:
            slots, advance = self.state_rows(plan)
            state_rows = (slots, advance if plan.write_kv else [0] * len(advance))  # catch-ups leave state alone
        real = inputs.fill(token_ids, start_positions, block_tables, num_seqs, query_len, self.block_size,
                           self.scratch_block, state_rows, self.scratch_slot(), plan.group_tables, self.group_scratch,
                           [row.parents for row in plan.rows] if tree else None, rope_shifts)
        if not plan.write_kv:  # attention still reads the cached K/V of these positions
            inputs.scratch_all_slots(num_seqs * query_len, self.block_size, [self.scratch_block, *self.group_scratch])
        if logits_rows is not None:
            select = [real[r] for r in logits_rows]
        elif plan.all_logits:
            select = real
        else:
            select = [i * query_len + len(t) - 1 for i, t in enumerate(token_ids)]
        # a prefill bucket's head reads one row: a chunk's (none wanted) reads a real one, never a stale index
        select_dev = inputs.set_rows("select", select if select or not prefill else [0])
        if ring:  # each real token's features go to its ring row, padding's to the trash row
            rows = inputs.host("ring", num_seqs * query_len)
            rows[:] = self.feature_ring.trash
            rows[real] = np.arange(feature_rows, feature_rows + len(real))
        real_dev = inputs.set_rows("real", real) if capture_layers and not ring else None
        if sampled:
            inputs.set_sampling(plan.sample or [], num_seqs)
            inputs.set_drafts(token_ids, num_seqs, query_len)
            inputs.new_seed()
        inputs.upload(num_seqs)
        if plan.ids_from is not None:
            if query_len != 1:
                raise ValueError("ids_from feeds decode steps only (one token a sequence)")
            inputs.view("ids", len(token_ids)).copy_(plan.ids_from, non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            self._forward(*key, query_start_loc)
        (self.tree_replays if tree else self.replays)[shape] += 1
        logits, features, tokens, verdicts = self.outputs[key[2]]
        captured = {k: buffer[:num_seqs] for k, buffer in self.query_out.items()} if queries else None
        if ring:
            features = RingRows(feature_rows, len(real))
        elif capture_layers:
            features = features.index_select(0, real_dev)
        if prefill:  # the graph computed the selected row's logits alone, into row 0 (none wanted: a chunk's)
            rows = len(select)
            if plan.argmax:
                return StepResult(tokens=tokens[:rows].tolist(), features=features)
            return StepResult(logits=logits[:rows].clone(), features=features)
        if plan.defer and (sampled or plan.argmax):
            return StepResult(deferred=DeferredStep(
                verdicts[:len(token_ids)] if sampled else tokens[:num_seqs * query_len],
                None if sampled else select, features, self._host_buffers))
        if sampled:  # the step's one device-to-host copy: two numbers a sequence
            return StepResult(verdicts=verdicts[:len(token_ids)].tolist(), features=features, queries=captured)
        if plan.argmax:  # the step's one device-to-host copy: every padded row's argmax, a few bytes
            padded = tokens[:num_seqs * query_len].tolist()
            return StepResult(tokens=[padded[r] for r in select], features=features, queries=captured)
        # index_select copies: the caller may keep the result past the next replay
        return StepResult(logits=logits.index_select(0, select_dev), features=features, queries=captured)

    @torch.inference_mode()  # as run(): outside it the model's ops take their autograd-safe references
    def capture_all(self, capture_layers: tuple[int, ...] = (), trees: bool = True, prefill: bool = True) -> None:
        """Capture every bucket now (the engine does at start): a bucket first used mid-stream
        would stall that step by its capture, tens to hundreds of milliseconds. trees / prefill=False:
        not the tree or prefill buckets (a dormant drafter's tap-less steps are neither: prompts
        always capture the taps)."""
        if not self.settings.capture:
            return
        started = time.perf_counter()
        keys = [(b, q, capture_layers, False, False, False, False) for b in self.batch_sizes for q in self.query_lens]
        if self.settings.sample:
            keys += [(b, q, capture_layers, True, False, False, False)
                     for b in self.batch_sizes for q in self.query_lens]
        if capture_layers:
            keys += [(1, q, capture_layers, False, False, False, False) for q in self.catch_up_lens]
        if trees and self.state_rows is None:
            keys += [(b, q, capture_layers, False, True, False, False) for b, q in sorted(self.tree_buckets)]
        if prefill and (not capture_layers or self.feature_ring is not None):
            keys += [(1, q, capture_layers, False, False, False, True) for q in self.prefill_lens]
        if self.settings.queries:  # the steps before a resident-set choice: decodes and verifies, sampled or not
            for sampled in (False, True) if self.settings.sample else (False,):
                keys += [(b, q, capture_layers, sampled, False, True, False)
                         for b in self.batch_sizes for q in self.query_lens]
        for key in keys:
            if key not in self.graphs:
                self._prepare(*key)
        log.info("captured %d CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - started)

    def _prepare(self, num_seqs: int, query_len: int, capture_layers: tuple[int, ...], sampled: bool,
                 tree: bool, queries: bool, prefill: bool) -> None:
        device = self.model.device
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int64, device=device) * query_len
        graph = None
        if self.settings.capture:
            started = time.perf_counter()
            # An all-padding batch: warm-up and capture write nothing but the scratch block.
            inputs = self._inputs(query_len, tree)
            inputs.fill([], [], [], num_seqs, query_len, self.block_size, self.scratch_block,
                        scratch_slot=self.scratch_slot(), group_scratch=self.group_scratch,
                        tree_parents=[] if tree else None)  # masks -1: every padding query sees itself
            inputs.set_sampling([], num_seqs)
            inputs.set_drafts([], num_seqs, query_len)
            inputs.upload(num_seqs)
            # Warm-up outside the graph: Triton compiles, cuBLAS picks algorithms, outputs get allocated.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._forward(num_seqs, query_len, capture_layers, sampled, tree, queries, prefill, query_start_loc)
            torch.cuda.current_stream(device).wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: a server thread touching CUDA meanwhile must not invalidate the capture
            with _collector_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._forward(num_seqs, query_len, capture_layers, sampled, tree, queries, prefill, query_start_loc)
            log.debug("captured a CUDA graph for %d sequences x %d tokens in %.0f ms", num_seqs, query_len,
                     1e3 * (time.perf_counter() - started))
        self.graphs[(num_seqs, query_len, capture_layers, sampled, tree, queries, prefill)] = (graph, query_start_loc)

    def _forward(self, num_seqs: int, query_len: int, capture_layers: tuple[int, ...], sampled: bool, tree: bool,
                 queries: bool, prefill: bool, query_start_loc: torch.Tensor) -> None:
        """The captured body: static inputs -> logits (and taps) of every padded row, into the static outputs;
        a prefill's: the logits of its selected row alone, into row 0."""
        inputs = self._inputs(query_len, tree)
        tokens, view = num_seqs * query_len, inputs.view
        batch = ForwardBatch.from_device(view("ids", tokens), view("positions", tokens), view("seq_lens", num_seqs),
                                         inputs.tables[:num_seqs], view("slots", tokens), self.block_size,
                                         query_len, query_start_loc, capture_layers,
                                         tuple(t[:num_seqs] for t in inputs.group_tables),
                                         tuple(inputs.group_slots(g, tokens) for g in range(1, inputs.groups)),
                                         tree_mask=view("tree_mask", tokens) if tree else None)
        batch.state_slots, batch.state_advance = view("state_slots", num_seqs), view("state_advance", num_seqs)
        batch.query_capture = {} if queries else None
        batch.prefill_bucket = prefill
        hidden = self.model(batch)
        heads = tokens  # rows through the LM head
        if prefill:  # the LM head over one row, not the bucket's padded hundreds
            hidden, heads = hidden.index_select(0, view("select", 1)), 1
        logits = self.model.compute_logits(hidden)
        for k, q in (batch.query_capture or {}).items():  # static buffers, made by the warm-up (never in a capture)
            if k not in self.query_out:
                self.query_out[k] = q.new_empty(self.inputs.tables.shape[0], *q.shape[1:])
            self.query_out[k][:num_seqs].copy_(q)
        features = torch.cat([batch.captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        if capture_layers not in self.outputs:  # first use is a warm-up, never inside a capture
            rows = self.max_tokens
            # One logits / tokens / verdicts buffer for graphs of every tap set: a step's results
            # are read before the next replay.
            shared = next(iter(self.outputs.values()), None)
            logits_out, tokens_out, verdicts_out = (shared[0], shared[2], shared[3]) if shared else (
                logits.new_empty(rows, logits.shape[1]), torch.empty(rows, dtype=torch.int64, device=logits.device),
                torch.empty(self.inputs.tables.shape[0], 2, dtype=torch.int64, device=logits.device))
            self.outputs[capture_layers] = (
                logits_out, features.new_empty(rows, features.shape[1]) if features is not None else None,
                tokens_out, verdicts_out)
        out_logits, out_features, out_tokens, out_verdicts = self.outputs[capture_layers]
        if not sampled:  # a sampling graph hands back verdicts only: its logits are never read
            out_logits[:heads].copy_(logits)
        # Greedy steps whose logits nothing processes take these tokens and never touch the logits.
        torch.argmax(logits, dim=-1, out=out_tokens[:heads])
        if sampled:  # each sequence's drafts checked and its next token drawn with its own parameters
            floats = inputs.sampling.device[:, :num_seqs]
            accept_in_graph(logits, view("draft", tokens), out_tokens[:tokens], floats[0], view("top_k", num_seqs),
                            floats[1], floats[2], view("greedy", num_seqs), view("seed", 1), out=out_verdicts[:num_seqs])
        if features is not None and self.feature_ring is not None:
            self.feature_ring.rows.index_copy_(0, view("ring", tokens), features)
        elif features is not None:
            out_features[:tokens].copy_(features)


def _last_token_at_most(plan: StepPlan) -> bool:
    """The step wants its last token's logits (a prompt's end) or none (a chunk short of it)."""
    last = len(plan.rows[0].tokens) - 1
    return plan.logits_rows is None or list(plan.logits_rows) in ([last], [])


@contextlib.contextmanager
def _collector_paused():
    """Python's cycle collector paused: run inside a capture, it may free an engine dropped earlier
    (engines hold reference cycles), and destroying that engine's CUDA graphs while a stream captures
    invalidates the capture ("operation failed due to a previous error during capture"; seen with
    `bench speed` building one engine after another). The garbage waits for the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
