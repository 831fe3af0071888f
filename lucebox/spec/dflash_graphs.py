"""CUDA graphs for the DFlash drafter: a draft pass and a context projection are one replay each.

Eagerly, a drafter pass is ~60 small launches plus their Python: milliseconds of host time on a
fast GPU, more than ten decode steps of a small target, which no acceptance rate can repay. As
graphs, the pass costs the GPU time of its kernels plus one launch.

Draft (one sequence; the engine drafts its sequences one after another): first the features
still queued for the sequence (up to B positions: what the last verify committed) are projected
into the drafter's cache, then the block [anchor token, MASK x (B-1)] at positions anchor..
attends to the context positions before the anchor, read from that paged cache: all of them, or the
resident ones of a KVView (a bounded pool, spec/draft_pool.py: a compact table of resident blocks;
storage positions 0..length-1, whose keys were rotated at their logical positions). A graph is
captured per context bucket L (context_bucket: at least MIN_CONTEXT, covering the view's length):
the (compact) block table is padded with the scratch block to L / block_size entries and context
columns at or past the length are masked out. Its input is one int64 buffer [anchor token, anchor
(the block's RoPE position), context length (storage), B projected positions, their B slots, block
table, each table entry's logical block (windows and causal masks measure logical distances)]; its
outputs the logits of the B - 1 draft slots and their argmax.

Projection alone (a longer queue, a finishing sequence): queued target features -> the drafter's
context K/V, in chunks of a bucketed size (PROJECT_CHUNKS). Padding rows write to the scratch block.

With capture=False the same static, padded bodies run eagerly: that is how CPU tests check the
padding and masking against the ragged eager drafter.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..util import StagedBuffer, smallest_at_least
from .draft_attention import KEY_SPLIT, PagedContext

log = logging.getLogger("lucebox")

HEAD = 3  # draft inputs before the projected positions: anchor token, anchor, context length
MIN_CONTEXT = 256  # smallest context bucket of a draft graph (positions)
PROJECT_CHUNKS = (16, 64, 256, 1024)  # projection graph sizes (positions)


def context_bucket(anchor: int) -> int:
    """Context positions a draft graph spans for a block anchored at `anchor` (>= anchor): a power of two
    up to one key slice, then whole slices (past it a power of two would read up to twice the keys)."""
    bucket = max(MIN_CONTEXT, 1 << max(0, anchor - 1).bit_length())
    return bucket if bucket <= KEY_SPLIT else -(-anchor // KEY_SPLIT) * KEY_SPLIT


class DrafterGraphs:
    def __init__(self, drafter, target_model, caches, block_size: int, scratch_block: int, max_model_len: int,
                 mask_token_id: int, capture: bool = True):
        self.drafter, self.target, self.caches = drafter, target_model, caches
        self.block_size, self.scratch_block, self.capture = block_size, scratch_block, capture
        device = target_model.device
        self.block = drafter.config.block_size
        self.max_context = context_bucket(max_model_len)
        # RoPE tables are read in place by captured graphs: sized once, before any capture.
        self.position_bound = self.max_context + self.block
        drafter.rope.reserve(self.position_bound, device)
        self.draft_in = StagedBuffer(HEAD + 2 * self.block + 2 * (self.max_context // block_size), torch.int64, device)
        self.project_in = StagedBuffer((2, PROJECT_CHUNKS[-1]), torch.int64, device)  # positions, slots
        taps = len(drafter.config.target_layer_ids) * drafter.config.model.hidden_size
        self.features = torch.zeros(PROJECT_CHUNKS[-1], taps, dtype=target_model.dtype, device=device)
        self.mask_ids = torch.full((self.block - 1,), mask_token_id, dtype=torch.int64, device=device)
        self.offsets = torch.arange(self.block, device=device)
        self.context_positions = torch.arange(self.max_context, device=device)
        self.block_visible = torch.ones(self.block, self.block, dtype=torch.bool, device=device)
        self.logits: torch.Tensor | None = None  # [B - 1, vocab], written by every draft
        self.tokens: torch.Tensor | None = None  # [B - 1] their argmax (DFlash2: the selector's greedy chain)
        self.hidden: torch.Tensor | None = None  # [B - 1, hidden] their final-normed states (DFlash2's selector)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph | None] = {}
        self.pool = None
        self.replays = 0

    # ------------------------------------------------------------------ host side
    def draft(self, block_table: list[int], anchor: int, anchor_token: int, start: int,
              features: torch.Tensor | None, view=None) -> torch.Tensor:
        """Logits [B - 1, vocab] of the draft slots after `anchor` (valid until the next draft), after
        projecting the queued features of positions start..anchor-1 (None: nothing queued). view: the
        resident context (a KVView; None: every position before the anchor)."""
        rows = 0 if features is None else features.shape[0]
        if rows > self.block:  # all but the last B positions through the projection graphs
            self.project(block_table, start, features[:rows - self.block])
            start, features, rows = start + rows - self.block, features[rows - self.block:], self.block
        if view is None:
            length, table, logical = anchor, block_table, None
        else:
            length = view.storage(anchor - 1) + 1 if anchor else 0
            table, logical = view.table(block_table), view.blocks(len(block_table))
        context = context_bucket(length)
        width, b = context // self.block_size, self.block
        staging = self.draft_in.staging()
        staging[0], staging[1], staging[2] = anchor_token, anchor, length
        self._stage_slots(staging[HEAD:HEAD + b], staging[HEAD + b:HEAD + 2 * b], block_table, start, rows)
        tables = staging[HEAD + 2 * b:HEAD + 2 * b + 2 * width].reshape(2, width)
        table = table[:width]
        tables[0, :len(table)] = table
        tables[0, len(table):] = self.scratch_block
        if logical is None:  # storage = logical
            tables[1] = np.arange(width)
        else:
            tables[1, :len(table)] = logical[:width]
            tables[1, len(table):] = 0  # masked columns
        self.draft_in.upload(HEAD + 2 * b + 2 * width)
        if rows:
            self.features[:rows].copy_(features)
        self._replay(("draft", context))
        return self.logits

    def _stage_slots(self, positions: np.ndarray, slots: np.ndarray, block_table: list[int], start: int,
                     rows: int) -> None:
        """Positions and cache slots of `rows` positions from `start`, then padding (the scratch block)."""
        pos = np.arange(start, start + rows)
        positions[:rows] = pos
        slots[:rows] = np.asarray(block_table, dtype=np.int64)[pos // self.block_size] * self.block_size \
            + pos % self.block_size
        positions[rows:] = 0
        slots[rows:] = self.scratch_block * self.block_size + np.arange(len(slots) - rows) % self.block_size

    def project(self, block_table: list[int], start: int, features: torch.Tensor) -> None:
        """Write the drafter's context K/V of positions start.. (features [n, taps * hidden])."""
        done, n = 0, features.shape[0]
        while done < n:
            chunk = smallest_at_least(n - done, PROJECT_CHUNKS) or PROJECT_CHUNKS[-1]
            rows = min(chunk, n - done)
            staging = self.project_in.staging()
            self._stage_slots(staging[0, :chunk], staging[1, :chunk], block_table, start + done, rows)
            self.project_in.upload()
            self.features[:rows].copy_(features[done:done + rows])
            self._replay(("project", chunk))
            done += rows

    @torch.inference_mode()
    def capture_all(self, up_to_context: int = 4096) -> None:
        """Capture the projections and the drafts of contexts up to `up_to_context` now (the engine
        does at start); longer contexts are captured when first drafted at."""
        if not self.capture:
            return
        # Captures run their bodies once: token 0 at position 0, every write to the scratch block.
        staging, b = self.draft_in.staging(), self.block
        staging[:HEAD] = 0
        self._stage_slots(staging[HEAD:HEAD + b], staging[HEAD + b:HEAD + 2 * b], [], 0, 0)
        staging[HEAD + 2 * b:] = self.scratch_block
        self.draft_in.upload()
        staging = self.project_in.staging()
        self._stage_slots(staging[0], staging[1], [], 0, 0)
        self.project_in.upload()
        for chunk in PROJECT_CHUNKS:
            self._prepare(("project", chunk))
        context = MIN_CONTEXT
        while context <= min(up_to_context, self.max_context):
            self._prepare(("draft", context))
            context *= 2

    def _replay(self, key: tuple[str, int]) -> None:
        if key not in self.graphs:
            self._prepare(key)
        graph = self.graphs[key]
        if graph is None:
            self._body(key)
        else:
            graph.replay()
        self.replays += 1

    def _prepare(self, key: tuple[str, int]) -> None:
        graph = None
        if self.capture:
            started = time.perf_counter()
            device = self.target.device
            stream = torch.cuda.Stream(device)  # warm-up outside the graph: allocations, kernel choices
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._body(key)
            torch.cuda.current_stream(device).wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._body(key)
            log.info("captured a drafter CUDA graph (%s, %d positions) in %.0f ms", *key,
                     1e3 * (time.perf_counter() - started))
        self.graphs[key] = graph

    # ------------------------------------------------------------------ captured bodies
    @torch.inference_mode()
    def _body(self, key: tuple[str, int]) -> None:
        kind, size = key
        if kind == "draft":
            self._draft_body(size)
        else:
            self._project_body(size)

    def _draft_body(self, context: int) -> None:
        inputs, bs, b = self.draft_in.device, self.block_size, self.block
        self._write_context(self.features[:b], inputs[HEAD:HEAD + b], inputs[HEAD + b:HEAD + 2 * b])
        anchor, length = inputs[1], inputs[2]
        tables = inputs[HEAD + 2 * b:HEAD + 2 * b + 2 * (context // bs)].view(2, context // bs)
        ctx_pos = self.context_positions[:context]
        entry, offset = ctx_pos // bs, ctx_pos % bs
        slots = tables[0][entry] * bs + offset
        logical = tables[1][entry] * bs + offset  # the keys' positions (rotated there when written)
        dtype = self.target.dtype
        kv = [PagedContext(k, v, slots, dtype) for k, v in self.caches]  # read by the layers as they need it
        x = self.drafter.block_input(self.target, torch.cat([inputs[:1], self.mask_ids]))
        mask = torch.cat([(ctx_pos < length).expand(self.block, context), self.block_visible], dim=1)
        hidden = self.drafter.blocks(x, anchor + self.offsets, kv, logical, mask, self.position_bound)
        logits = self.drafter.logits(self.target.head_logits(hidden[1:]))
        if self.logits is None:  # first use is a warm-up, never inside a capture
            self.logits = torch.empty_like(logits)
            self.tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            self.hidden = torch.empty_like(hidden[1:])
        self.logits.copy_(logits)
        self.hidden.copy_(hidden[1:])
        selector = getattr(self.drafter, "candidate_selector", None)  # DFlash2: the selector's greedy chain
        if selector is None:
            torch.argmax(logits, dim=-1, out=self.tokens)  # greedy drafts whose logits nothing processes
        else:
            self.tokens.copy_(selector.walk(hidden[1:], inputs[0], logits).tokens)

    def _project_body(self, chunk: int) -> None:
        self._write_context(self.features[:chunk], self.project_in.device[0, :chunk], self.project_in.device[1, :chunk])

    def _write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        for (k_cache, v_cache), (k, v) in zip(self.caches, self.drafter.context_kv(features, positions,
                                                                                   self.position_bound)):
            k_cache.write(k, slots)
            v_cache.write(v, slots)
