"""KVFlash on the drafter's side: each DFlash draft pass reads a bounded set of context positions.

Lossless: only the drafter's context is bounded; the target verifies against all of its own. The
drafter's context K/V stay where projection writes them (every block of the sequence keeps its
drafter slots, at their logical positions); a pass reads the resident chunks through a KVView
(model/kv_pool/view.py): the sink chunk, the recent tail and the best-scored 64-token chunks
between, at most `pool_tokens` positions. The saving is attention work (and the graph path's
context bucket), not memory.

Chunk score (Lucebox's `qk` policy, on the drafter): each complete chunk's drafter keys (post-RoPE,
at their logical positions) mean-pooled per layer and KV head, L2-normalised, computed once per
chunk; against the block queries of the sequence's last draft pass (rotated at their positions,
L2-normalised, averaged over the block's rows): cosine, max over query heads (each against its KV
head), mean over layers. A sequence with no pass recorded yet selects by recency. Selection is
redone every RESELECT_INTERVAL tokens and whenever the growing tail would overflow the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import DRAFT_POOL_CHUNK_TOKENS, DRAFT_POOL_MIN_TOKENS
from ..errors import RequestError
from ..kernels.rope import apply_rope
from ..model.kv_pool.choose import Protection, choose_chunks
from ..model.kv_pool.view import KVView
from ..util import host_to_device

CHUNK_TOKENS = DRAFT_POOL_CHUNK_TOKENS
# The drafter reads its own recent context most; a tail of the partial chunk and two before it.
PROTECTION = Protection(sink_chunks=1, tail_chunks=2)
assert PROTECTION.min_chunks * CHUNK_TOKENS == DRAFT_POOL_MIN_TOKENS  # config.py validates against it
RESELECT_INTERVAL = 64  # tokens between selections (a full pool's tail needs a new chunk as often)
POOLING_CHUNKS = 256  # chunks whose keys are gathered at once when a long context is first pooled


class QueryTap:
    """The drafter's block queries (after q_norm, before RoPE) of its latest pass, one static buffer
    per layer: forward hooks copy them there, inside captured draft graphs too (registered before
    any capture; the first call, a warm-up outside capture, sizes the buffers)."""

    def __init__(self, drafter):
        self.buffers: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.handles = [layer.self_attn.q_norm.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(drafter.layers)]

    def _hook(self, layer: int):
        def copy(module, args, out: torch.Tensor) -> None:
            buffer = self.buffers[layer]
            if buffer is None or buffer.shape != out.shape:
                buffer = self.buffers[layer] = torch.empty_like(out)
            buffer.copy_(out)
        return copy

    def snapshot(self) -> torch.Tensor:
        """[layers, block, heads, head_dim] of the latest pass."""
        return torch.stack(self.buffers)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class _SequencePool:
    view: KVView | None = None
    selected_at: int = 0  # the anchor the view was chosen at
    keys: torch.Tensor | None = None  # [complete chunks, layers, kv_heads, head_dim] normalised mean keys
    queries: torch.Tensor | None = None  # [layers, block, heads, head_dim] the last pass's, before RoPE
    query_anchor: int = 0


class DraftPool:
    def __init__(self, drafter, caches: list, pool_tokens: int, block_size: int, tap: QueryTap):
        if CHUNK_TOKENS % block_size:
            raise RequestError(f"draft_kv_pool_tokens needs a KV block size dividing its {CHUNK_TOKENS}-token chunk, "
                               f"got block_size {block_size}")
        if pool_tokens % CHUNK_TOKENS or pool_tokens < DRAFT_POOL_MIN_TOKENS:
            raise RequestError(f"draft_kv_pool_tokens {pool_tokens}: a multiple of {CHUNK_TOKENS}, at least "
                               f"{DRAFT_POOL_MIN_TOKENS}")
        self.drafter, self.caches, self.tap = drafter, caches, tap
        self.pool_tokens, self.block_size = pool_tokens, block_size
        self.chunk_blocks, self.budget = CHUNK_TOKENS // block_size, pool_tokens // CHUNK_TOKENS
        self.key_dtype = drafter.fc.weight.dtype  # pooled keys kept as the drafter computes
        self.sequences: dict[int, _SequencePool] = {}
        self.selections = 0

    def due(self, seq, anchor: int) -> bool:
        """Whether a pass at `anchor` needs a new selection (its context is longer than the pool)."""
        if anchor <= self.pool_tokens:
            return False
        state = self.sequences.get(id(seq))
        if state is None or state.view is None:
            return True
        view = state.view
        resident = (len(view.selected) - view.tail_from) * self.block_size + anchor
        return anchor - state.selected_at >= RESELECT_INTERVAL or resident > self.pool_tokens

    def view(self, seq, anchor: int) -> KVView | None:
        """The current selection (None: the whole context fits the pool)."""
        if anchor <= self.pool_tokens:
            return None
        return self.sequences[id(seq)].view

    def reselect(self, seq, anchor: int) -> KVView:
        """Choose the resident chunks of positions 0..anchor-1, whose drafter K/V must all be written."""
        state = self.sequences.setdefault(id(seq), _SequencePool())
        self._pool_keys(seq, state, anchor // CHUNK_TOKENS)
        num_chunks = -(-anchor // CHUNK_TOKENS)
        chosen, tail_from = choose_chunks(num_chunks, self.budget, PROTECTION, self._scores(state, num_chunks))
        b = self.chunk_blocks
        state.view = KVView(tuple(block for c in chosen for block in range(c * b, (c + 1) * b)), tail_from * b,
                            self.block_size)
        state.selected_at = anchor
        self.selections += 1
        return state.view

    def observe_pass(self, seq, anchor: int) -> None:
        """Keep the queries of the pass just run for the sequence's next selection (once it is near one)."""
        if anchor + RESELECT_INTERVAL <= self.pool_tokens:
            return
        state = self.sequences.setdefault(id(seq), _SequencePool())
        state.queries, state.query_anchor = self.tap.snapshot(), anchor

    def release(self, seq) -> None:
        self.sequences.pop(id(seq), None)

    # ------------------------------------------------------------------ scoring
    def _pool_keys(self, seq, state: _SequencePool, complete: int) -> None:
        """Append the normalised mean keys of chunks completed since the last selection."""
        done = 0 if state.keys is None else state.keys.shape[0]
        table = torch.tensor(seq.block_table, dtype=torch.long)
        parts = [] if state.keys is None else [state.keys]
        for first in range(done, complete, POOLING_CHUNKS):
            count = min(POOLING_CHUNKS, complete - first)
            pos = torch.arange(first * CHUNK_TOKENS, (first + count) * CHUNK_TOKENS)
            slots = host_to_device(table[pos // self.block_size] * self.block_size + pos % self.block_size,
                                   self.caches[0][0].values.device)
            means = [k.gather(slots, torch.float32).view(count, CHUNK_TOKENS, k.num_kv_heads, k.head_dim).mean(1)
                     for k, _ in self.caches]
            parts.append(F.normalize(torch.stack(means, 1), dim=-1).to(self.key_dtype))
        if complete > done:
            state.keys = torch.cat(parts)

    def _scores(self, state: _SequencePool, num_chunks: int) -> torch.Tensor | None:
        """[num_chunks] on the host (chunks without pooled keys: 0; only the tail's), or None: recency."""
        if state.queries is None or state.keys is None:
            return None
        layers, block, heads, dim = state.queries.shape
        positions = torch.arange(state.query_anchor, state.query_anchor + block, device=state.queries.device)
        cos, sin = self.drafter.rope.lookup(positions, torch.float32, state.query_anchor + block)
        queries = torch.stack([apply_rope(q.float(), cos, sin) for q in state.queries])
        queries = F.normalize(queries, dim=-1).mean(1)  # [layers, heads, dim]: the block's mean direction
        kv_heads = state.keys.shape[2]
        queries = queries.view(layers, kv_heads, heads // kv_heads, dim)
        cosines = torch.einsum("clkd,lkgd->clkg", state.keys.float(), queries)
        scores = torch.zeros(num_chunks)
        scores[:state.keys.shape[0]] = cosines.flatten(2).amax(-1).mean(-1).cpu()
        return scores


def resident_context(view: KVView, block_table: list[int], anchor: int, block_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache slots, logical positions) of a pass's context through `view`: the resident positions
    before the anchor in storage order (int64, on the host)."""
    length = view.storage(anchor - 1) + 1 if anchor else 0
    storage = torch.arange(length)
    table = torch.tensor(view.table(block_table), dtype=torch.long)
    blocks = torch.tensor(view.blocks(len(block_table)), dtype=torch.long)
    index, offset = storage // block_size, storage % block_size
    return table[index] * block_size + offset, blocks[index] * block_size + offset
