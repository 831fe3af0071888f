"""The step plan: what one target forward computes and what comes back, and the planner that makes it.

A plan has one row per sequence: its new tokens, start position and block table, and what it needs
back -- nothing for a prefill chunk short of the prompt's end, one sampled token for a decode (the
last chunk of a prompt included), an accept verdict for a verify of drafts. The step-level choices
(which logits rows, argmax only, sampled and accepted in the graph, taps and their feature-ring
rows, writing K/V or not, deferred or fed from a previous step's device tokens) are fields, made
once by the planner; the runner (ModelRunner.run) and the graphs read them and answer with one
StepResult.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..kernels import routing
from ..model.feature_ring import RingRows
from ..sampling.acceptance import Draft
from ..sampling.graph_rows import GraphRow, argmax_only, graph_row, graph_samplable
from ..spec.tree import depths_of

# Catch-up graph lengths of the taps a dormant drafter missed while the target decoded plainly
# (spec/speculator.py), beside the verify lengths; longer runs go in chunks of the last.
CATCH_UP_LENS = (32, 64, 128, 256)
# Prefill graph lengths (EngineArgs.prefill_graphs): one sequence's new tokens, padded up to one of these
# (past 512 a step pads by at most half its tokens: prefill there is compute-bound).
PREFILL_GRAPH_LENS = (64, 128, 256, 512, 768, 1024, 1536, 2048)
# A graph steps recurrent (DeltaNet) layers token by token: hybrids' prefill buckets stop here (unless
# routing.bucket_chunks sends them through the chunked rule).
RECURRENT_PREFILL_GRAPH_MAX = 512


def recurrent_prefill_graph_max() -> int:
    """The longest prefill bucket of a model with recurrent layers."""
    return PREFILL_GRAPH_LENS[-1] if routing.bucket_chunks() else RECURRENT_PREFILL_GRAPH_MAX


class RowKind(enum.Enum):
    CHUNK = "chunk"  # a prefill chunk short of the prompt's end: nothing back
    DECODE = "decode"  # one token sampled after the row's last token
    VERIFY = "verify"  # the pending token and drafts: an accept verdict


@dataclass
class PlanRow:
    tokens: list[int]
    start: int  # position of tokens[0]
    block_table: list[int]
    kind: RowKind = RowKind.DECODE
    seq: object = None  # the engine's Sequence (None for a bare forward)
    offset: int = 0  # flat index of tokens[0] in the step
    index: int = 0  # the row's place in the plan
    draft: Draft | None = None  # a verify's drafts
    # Its tables in KV cache groups 1.. (a model mixing windows); default: the sequence's.
    window_tables: list[list[int]] | None = None
    # A tree verify (spec/tree.py): each token's parent row (-1 for the pending token) and depth. Token
    # i's K/V go to position start + i, its RoPE position is start + depths[i]; it sees its ancestors.
    parents: list[int] | None = None
    depths: list[int] | None = None
    # RoPE position minus storage position, alike for every token (decoding past a PFlash-compressed
    # prompt; a KVFlash view's tail): token i is rotated at start + i (tree rows: start + depths[i]) + rope_shift
    rope_shift: int = 0
    # RoPE positions of the tokens when they are no constant shift of storage (a compressed prompt's chunks)
    positions: list[int] | None = None

    def __post_init__(self):
        if self.window_tables is None:
            self.window_tables = self.seq.window_tables if self.seq is not None else []


@dataclass
class StepPlan:
    rows: list[PlanRow]
    # Flat token indices whose logits come back (decodes first, then each verify's k + 1 rows);
    # None: the last token of each row, or every token with all_logits.
    logits_rows: list[int] | None = None
    all_logits: bool = False
    argmax: bool = False  # the argmax token of each logits row comes back, not the logits
    # One graph row a sequence: a graph that samples and accepts in place returns verdicts.
    sample: list[GraphRow] | None = None
    capture_layers: tuple[int, ...] = ()  # the drafter's taps, captured for every new token
    feature_rows: int | None = None  # first feature-ring row reserved for the taps (graph steps)
    write_kv: bool = True  # False: recompute cached positions' taps (catch-up), K/V to scratch
    defer: bool = False  # overlapped decoding: return a DeferredStep at once
    ids_from: torch.Tensor | None = None  # a previous step's device tokens as this step's input ids
    prefilling: bool = False  # some prompt tokens are in this step
    state_slots: list[int] | None = None  # a bare forward's recurrent slots, one a row (engine: from seq)
    capture_queries: bool = False  # KVFlash: every paged layer's last-token queries come back (an eager step)
    _kinds: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def forward(cls, token_ids: list[list[int]], start_positions: list[int], block_tables: list[list[int]],
                window_tables: list[list[list[int]]] | None = None, **choices) -> StepPlan:
        """A bare ragged forward of these tokens (benchmarks, tests, a draft model's runner);
        window_tables[i]: row i's tables in KV cache groups 1.. (a model mixing windows)."""
        rows, offset = [], 0
        for i, (tokens, start, table) in enumerate(zip(token_ids, start_positions, block_tables)):
            windows = window_tables[i] if window_tables is not None else []
            rows.append(PlanRow(list(tokens), start, table, offset=offset, index=i, window_tables=windows))
            offset += len(tokens)
        return cls(rows, **choices)

    @property
    def token_ids(self) -> list[list[int]]:
        return [row.tokens for row in self.rows]

    @property
    def start_positions(self) -> list[int]:
        return [row.start for row in self.rows]

    @property
    def rope_shifts(self) -> list[int] | None:
        """Each row's rope_shift, or None when every row is rotated at its storage positions."""
        shifts = [row.rope_shift for row in self.rows]
        return shifts if any(shifts) else None

    @property
    def block_tables(self) -> list[list[int]]:
        return [row.block_table for row in self.rows]

    @property
    def group_tables(self) -> list[list[list[int]]]:
        """Per KV cache group 1..: every row's table in it."""
        groups = len(self.rows[0].window_tables) if self.rows else 0
        return [[row.window_tables[g] for row in self.rows] for g in range(groups)]

    @property
    def has_trees(self) -> bool:
        """Some row verifies a draft tree: the step takes a tree bucket (engine/cuda_graphs.py) or runs eagerly."""
        return any(row.parents is not None for row in self.rows)

    @property
    def has_position_maps(self) -> bool:
        """Some row has a map of RoPE positions (not a constant shift): the step runs eagerly (graphs fill
        start + i + rope_shift)."""
        return any(row.positions is not None for row in self.rows)

    @property
    def total_tokens(self) -> int:
        return sum(len(row.tokens) for row in self.rows)

    def of(self, kind: RowKind) -> list[PlanRow]:
        """The rows of one kind, in plan order (grouped once: the engine asks for each kind more than once)."""
        if self._kinds is None:
            self._kinds = {k: [] for k in RowKind}
            for row in self.rows:
                self._kinds[row.kind].append(row)
        return self._kinds[kind]


@dataclass
class StepResult:
    """What a step brings back; which fields are set follows from the plan: `tokens` with argmax,
    `verdicts` when the graph sampled and accepted (plan.sample on a sampling graph), `logits`
    otherwise; `features` with capture_layers (a tensor, or the RingRows a graph step wrote);
    `deferred` alone for a step launched with defer (its result() is the step's StepResult)."""
    logits: torch.Tensor | None = None  # float32 [logits rows, vocab]
    tokens: list[int] | None = None  # argmax of each logits row
    verdicts: list[list[int]] | None = None  # [drafts accepted, next token] per plan row
    features: torch.Tensor | RingRows | None = None
    deferred: object = None  # a graph_io.DeferredStep
    queries: dict | None = None  # capture_queries: id(k_cache) -> [rows, heads, head_dim] (ForwardBatch.query_capture)


def through_view(row: PlanRow, view) -> None:
    """A pooled sequence's row as attention reads it (model/kv_pool/view.py): the compact table of its
    resident blocks, its tokens at their storage positions there, rotated at their logical ones."""
    start = view.storage(row.start)
    if row.positions is None:  # rotated at storage + shift: graph buckets take it
        row.rope_shift += row.start - start
    row.block_table = view.table(row.block_table)
    row.window_tables = [view.table(t) for t in row.window_tables]
    row.start = start


@dataclass
class StepPlanner:
    """Turns the scheduler's batch into a StepPlan. speculator: the engine's (or None); runner: the
    target's ModelRunner (only its CUDA graphs sample in place)."""
    speculator: object
    runner: object
    vocab_size: int
    async_decode: bool
    kv_pool: object = None  # the engine's KVPool (KVFlash), or None

    def plan(self, batch, in_run: bool) -> StepPlan:
        """in_run: the step is one of a plain run the speculator promised (it captures no taps unless
        a prompt is in it)."""
        rows, plain_rows, verify_rows, offset, prefilling = [], [], [], 0, False
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            drafts = seq.draft.tokens if seq.draft is not None else []
            start, end, committed = seq.num_computed, seq.num_computed + n, seq.num_tokens
            tokens = seq.token_slice(start, min(end, committed))
            if end > committed:  # the drafts being verified follow the committed tokens
                tokens += drafts[max(0, start - committed):end - committed]
            row = PlanRow(tokens, start, seq.block_table, RowKind.DECODE, seq, offset, i)
            if end < committed:
                row.kind = RowKind.CHUNK
            elif drafts:
                row.kind, row.draft = RowKind.VERIFY, seq.draft
                if seq.draft.is_tree:
                    row.parents = [-1] + seq.draft.parents
                    row.depths = [0] + depths_of(seq.draft.parents)
                verify_rows.extend(range(offset + n - 1 - len(drafts), offset + n))
            else:
                plain_rows.append(offset + n - 1)
            if seq.compression is not None:  # past the kept prompt: a constant shift, which graphs take
                shift = seq.compression.shift_of(start)
                if shift is None:
                    row.positions = seq.compression.positions(start, len(tokens), row.depths)
                else:
                    row.rope_shift += shift
            if seq.kv_view is not None:
                through_view(row, seq.kv_view)
            prefilling = prefilling or (not drafts and (n > 1 or end < committed))
            rows.append(row)
            offset += n
        plan = StepPlan(rows, logits_rows=plain_rows + verify_rows, prefilling=prefilling)
        spec, chunks, verifies = self.speculator, plan.of(RowKind.CHUNK), plan.of(RowKind.VERIFY)
        # The drafter's taps: always for prompts (a dormant drafter recomputes only decoded positions).
        if spec is not None and (prefilling or (not in_run and spec.taps_needed())):
            plan.capture_layers = spec.capture_layers
        # All greedy with nothing processing the logits: argmax tokens come back, not logits.
        plan.argmax = all(argmax_only(r.seq.params, len(r.seq.output_token_ids)) for r in rows if r.kind is not
                          RowKind.CHUNK)
        # Simply sampled rows with deterministic drafts (or none): sampled and accepted in the graph.
        if (not plan.argmax and self.runner.graphs is not None and not chunks and not plan.has_position_maps
                and all(graph_samplable(r.seq.params, len(r.seq.output_token_ids)) for r in rows)
                and all(r.draft.probs is None and not r.draft.is_tree for r in verifies)):
            plan.sample = [graph_row(r.seq.params, self.vocab_size) for r in rows]
        if plan.capture_layers:
            plan.feature_rows = spec.proposer.feature_rows(batch.total_tokens)
        pool = self.kv_pool
        plan.capture_queries = pool is not None and any(pool.wants_queries(r.seq, len(r.tokens)) for r in rows)
        plan.defer = (self.async_decode and not chunks and not verifies and not plan.capture_layers
                      and not plan.has_position_maps and not plan.capture_queries)
        return plan

    def catch_up(self, seq, start: int):
        """(begin, plan) of target passes recomputing the drafter's taps of seq's positions
        start..num_computed-1, whose K/V the cache holds: up to CATCH_UP_LENS[-1] tokens each, no
        logits, no K/V written (through the catch-up CUDA graphs when they fit). Lazy: each pass's
        ring rows are reserved when it is planned, after the previous pass's features were observed."""
        spec = self.speculator
        for begin in range(start, seq.num_computed, CATCH_UP_LENS[-1]):
            end = min(begin + CATCH_UP_LENS[-1], seq.num_computed)
            plan = StepPlan.forward([seq.token_slice(begin, end)], [begin], [seq.block_table],
                                    [seq.window_tables], logits_rows=[], capture_layers=spec.capture_layers,
                                    feature_rows=spec.proposer.feature_rows(end - begin), write_kv=False)
            compression = getattr(seq, "compression", None)  # a duck-typed sequence may lack it
            if compression is not None:
                shift = compression.shift_of(begin)
                if shift is None:
                    plan.rows[0].positions = compression.positions(begin, end - begin)
                else:
                    plan.rows[0].rope_shift = shift
            yield begin, plan
