"""DFlash block drafting: one drafter pass fills [anchor, MASK x (B-1)] from the target's features.

The target's tapped layer outputs are captured for every committed position (prefill and
accepted verify rows) and projected at once into the drafter's per-layer context K/V, which
lives in a paged pool indexed by the target's own block tables: positions map to the same slots,
so prefix-cache hits and rollback need nothing extra. Block K/V are never stored (the block is
re-drafted next step), which is the reference's "crop after drafting".
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..model.assign import assign
from ..model.cache_spec import PagedKVSpec
from ..model.feature_ring import FeatureRing, RingRows
from ..model.kv_cache import PagedKVCache
from ..model.loader import resolve_path
from ..sampling.acceptance import Draft
from ..sampling.sampler import Sampler, SamplingState
from ..util import host_to_device, move, on_meta
from ..weights.safetensors import iter_safetensors
from .dflash2_model import DFlash2Config, build_drafter, read_config
from .dflash_graphs import DrafterGraphs
from .dflash_model import DFlashConfig, DFlashDrafter
from .draft_attention import PagedContext
from .draft_pool import DraftPool, QueryTap, resident_context
from .proposer import Proposer
from .tree import build_tree

log = logging.getLogger("lucebox")

# Queued features (per sequence) that trigger a projection into the drafter's context K/V: a
# projection is a few dozen eager launches (~2.4 ms on the H200 machine's host), so it is amortised
# over ~500 positions of the bundled pair and ~50 of an 8B target, at 2 MB held per sequence.
PROJECT_BYTES = 2 << 20
# The device ring graph steps write captured features into (model/feature_ring.py): 64 MB holds
# ~17K positions of the bundled pair's taps, ~1.6K of an 8B target's five.
RING_BYTES = 64 << 20


def load_drafter(path: str | Path, dtype: torch.dtype, device) -> tuple[DFlashDrafter, Path]:
    if str(path).endswith(".gguf"):
        from .dflash_gguf import load_drafter_gguf
        return load_drafter_gguf(path, dtype, device)
    path = resolve_path(str(path))
    cfg = read_config(path)  # DFlash or DFlash2, by the config's architectures
    with on_meta():
        drafter = build_drafter(cfg)
    drafter = drafter.to(dtype=dtype).to_empty(device=device)
    assign(drafter, iter_safetensors(path), str(path), dtype)
    return drafter.eval(), path


def check_fits_target(cfg: DFlashConfig, target, where: str) -> None:
    t = target.config
    if cfg.model.hidden_size != t.hidden_size:
        raise CheckpointError(f"{where}: the drafter's hidden size {cfg.model.hidden_size} does not match the "
                              f"target's {t.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise CheckpointError(f"{where}: tap layer(s) {bad} outside the target's {t.num_layers} layers")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        raise CheckpointError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target's embedding "
                              f"({t.vocab_size} rows)")
    if cfg.model.vocab_size != t.vocab_size:
        raise CheckpointError(f"{where}: the drafter was trained for a vocabulary of {cfg.model.vocab_size} "
                              f"tokens, the target has {t.vocab_size}")
    if cfg.block_size < 2:
        raise CheckpointError(f"{where}: block_size {cfg.block_size} leaves no room for drafts")


class DFlashProposer(Proposer):
    method = "dflash"

    def __init__(self, drafter: DFlashDrafter, target):
        self.drafter, self.target = drafter, target
        # --draft-device: the drafter, its context K/V and its passes on their own device (eager there);
        # taps cross once a projection, the block's embeddings and final hidden states once a draft
        self.device = drafter.fc.weight.device
        self.own_device = self.device != target.model.device
        cfg = drafter.config
        self.capture_layers = tuple(cfg.target_layer_ids)
        self.block_size, self.mask_token_id = cfg.block_size, cfg.mask_token_id
        self.sampler = Sampler(set(target.tokenizer.eos_token_ids) | set(target.config.eos_token_ids))
        self.caches: list[tuple[PagedKVCache, PagedKVCache]] = []
        # per sequence: (start, features or their RingRows), and the queue's unique token
        self.pending: dict[int, list[tuple[int, torch.Tensor | RingRows]]] = {}
        self.queue_token: dict[int, int] = {}
        self.block_tokens = 0
        self.graphs: DrafterGraphs | None = None
        self.feature_ring: FeatureRing | None = None
        self.ring_queue: deque = deque()  # (first row, rows, seq, queue token) in reservation order
        self._tokens = itertools.count()
        self.tree_budget: int | None = None  # draft DDTrees of this many nodes (spec/tree.py); None: chains
        # --draft-kv-pool-tokens (spec/draft_pool.py): each pass reads at most this many context positions
        self.pool_tokens = 0
        self.pool: DraftPool | None = None
        self.query_tap: QueryTap | None = None

    @classmethod
    def load(cls, path: str, target, device=None) -> "DFlashProposer":
        model = target.model
        if not str(path).endswith(".gguf"):  # check the config before reading any weights
            local = resolve_path(str(path))
            check_fits_target(read_config(local), target, str(local))
        drafter, where = load_drafter(path, model.dtype, device or model.device)
        check_fits_target(drafter.config, target, str(where))
        if isinstance(drafter.config, DFlash2Config):
            from .dflash2 import DFlash2Proposer
            return DFlash2Proposer(drafter, target)
        return cls(drafter, target)

    def enable_pool(self, pool_tokens: int) -> None:
        """Bound every draft pass's context to pool_tokens positions (0: off); the engine calls it
        before capturing graphs (the query hooks must be inside them)."""
        self.pool_tokens = pool_tokens
        if pool_tokens and self.query_tap is None:
            self.query_tap = QueryTap(self.drafter)
            if self.graphs is not None:  # captured without the hooks: captured again when next used
                self.graphs.graphs.clear()
        self.pool = self._make_pool() if self.caches else None

    def _make_pool(self) -> DraftPool | None:
        if not self.pool_tokens:
            return None
        return DraftPool(self.drafter, self.caches, self.pool_tokens, self.block_tokens, self.query_tap)

    def cache_specs(self) -> list[PagedKVSpec]:
        """The drafter's context K/V per layer, in the model dtype. Unbounded even for its sliding
        layers: features are projected into it after the fact, at positions behind the target's."""
        m = self.drafter.config.model
        return [PagedKVSpec.of(m.num_kv_heads, m.head_dim, self.target.model.dtype)] * m.num_layers

    def allocate(self, num_blocks: int, block_size: int, block_manager=None, graphs=None, runner=None) -> None:
        model = self.target.model
        # One block more than the scheduler hands out: graph padding writes its K/V there.
        self.caches = [spec.build(num_blocks + 1, block_size, model.dtype, self.device) for spec in self.cache_specs()]
        self.block_tokens = block_size
        self.pool = self._make_pool()
        if graphs is not None and not self.own_device and (model.device.type == "cuda" or not graphs.capture):
            self.graphs = DrafterGraphs(self.drafter, model, self.caches, block_size, num_blocks,
                                        graphs.max_model_len, self.mask_token_id, graphs.capture)
            width = len(self.capture_layers) * self.target.config.hidden_size
            step_tokens = graphs.max_batch * max(graphs.query_lens)
            # a prefill bucket's taps take at most half the ring (FeatureRing.reserve)
            rows = max(RING_BYTES // (width * model.dtype.itemsize), 4 * step_tokens,
                       2 * max(graphs.prefill_lens, default=0))
            self.feature_ring = FeatureRing(rows, width, model.dtype, model.device)

    def feature_rows(self, n: int) -> int | None:
        """Reserve ring rows for a step's n tokens; rows still queued there are projected first."""
        first = self.feature_ring.reserve(n) if self.feature_ring is not None else None
        if first is None:
            return None
        end, queue = first + n, self.ring_queue
        while queue:
            row, count, seq, token = queue[0]
            if self.queue_token.get(id(seq)) != token:
                queue.popleft()  # projected (or dropped) since
            elif row < end and first < row + count:
                self._project(seq)
            else:
                break
        return first

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture_all()

    def _slots(self, seq, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return host_to_device(table[pos // self.block_tokens] * self.block_tokens + pos % self.block_tokens,
                              self.device)

    def observe(self, seq, start: int, features: torch.Tensor) -> None:
        """Queue the features of newly committed positions; they are projected into the context
        K/V in one batch when a draft needs them, when PROJECT_BYTES have queued up, or when the
        sequence ends. Projecting each decoded token on its own would cost every plain step a
        drafter pass, which adaptive speculation could not switch off (at 64 positions a batch the
        passes still cost the bundled pair's plain steps ~40 us a token, 4-7%, on the H200). Full
        blocks shared through the prefix cache while their projection is pending lack drafter K/V
        for a while: only the acceptance of drafts made from them in that window suffers."""
        queue = self.pending.get(id(seq))
        if queue is None:
            queue = self.pending[id(seq)] = []
            self.queue_token[id(seq)] = next(self._tokens)
        if isinstance(features, RingRows):
            queue.append((start, features))
            self.ring_queue.append((features.first, features.count, seq, self.queue_token[id(seq)]))
            row_bytes = self.feature_ring.row_bytes
        else:
            features = move(features, self.device)  # the drafter's device (a no-op on the target's)
            covers_storage = features.untyped_storage().nbytes() == features.numel() * features.element_size()
            queue.append((start, features if covers_storage else features.clone()))  # not a view pinning a batch
            row_bytes = features.shape[1] * features.element_size()
        if (start + features.shape[0] - queue[0][0]) * row_bytes >= PROJECT_BYTES:
            self._project(seq)

    def _take_pending(self, seq) -> tuple[int, torch.Tensor | None]:
        """The sequence's queued features, concatenated (ring rows: a view when consecutive; read
        before the ring's cursor comes round), and the position of their first row."""
        queue = self.pending.pop(id(seq), [])
        self.queue_token.pop(id(seq), None)
        if not queue:
            return 0, None
        parts: list[torch.Tensor] = []
        rows: list[RingRows] = []
        for _, f in queue:  # runs of ring rows gathered at once
            if isinstance(f, RingRows):
                rows.append(f)
                continue
            if rows:
                parts.append(self.feature_ring.gather(rows))
                rows = []
            parts.append(f)
        if rows:
            parts.append(self.feature_ring.gather(rows))
        return queue[0][0], torch.cat(parts) if len(parts) > 1 else parts[0]

    @torch.inference_mode()
    def _project(self, seq) -> None:
        start, features = self._take_pending(seq)
        if features is None:
            return
        if self.graphs is not None:
            self.graphs.project(seq.block_table, start, features)
            return
        n = features.shape[0]
        positions = torch.arange(start, start + n, device=features.device)
        slots = self._slots(seq, start, start + n)
        for (k_cache, v_cache), (k, v) in zip(self.caches, self.drafter.context_kv(features, positions, start + n)):
            k_cache.write(k, slots)
            v_cache.write(v, slots)

    def release(self, seq, finished: bool = True) -> None:
        # A finished sequence's blocks may serve later prompts from the prefix cache, and the drafter
        # K/V in them must be there too; a preempted one recomputes (and re-observes) everything.
        if finished:
            self._project(seq)
        self.pending.pop(id(seq), None)
        self.queue_token.pop(id(seq), None)
        if self.pool is not None:
            self.pool.release(seq)

    @torch.inference_mode()
    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        return [self._draft_one(seq, min(k, self.block_size - 1)) for seq, k in zip(seqs, num_tokens)]

    def _draft_logits(self, seq, k: int) -> torch.Tensor:
        """[k, vocab]: draft slot i predicts the token at anchor + i."""
        return self._draft_pass(seq, k)[0]

    def _draft_pass(self, seq, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits [k, vocab] and final-normed hidden states [k, hidden] of draft slots 1..k."""
        anchor = seq.num_tokens - 1  # the last committed token: its K/V and features are not known yet
        view = self._context_view(seq, anchor)
        if self.graphs is not None:  # the queued features are projected inside the draft graph
            logits = self.graphs.draft(seq.block_table, anchor, seq.last_token, *self._take_pending(seq), view=view)
            self._observe_pass(seq, anchor)
            return logits[:k], self.graphs.hidden[:k]
        self._project(seq)
        device, target = self.device, self.target.model
        if view is None:
            slots, context_positions = self._slots(seq, 0, anchor), torch.arange(anchor, device=device)
        else:
            slots, context_positions = (host_to_device(t, device) for t in
                                        resident_context(view, seq.block_table, anchor, self.block_tokens))
        dtype = self.target.model.dtype
        context = [PagedContext(kc, vc, slots, dtype) for kc, vc in self.caches]
        ids = host_to_device([seq.last_token] + [self.mask_token_id] * (self.block_size - 1), target.device)
        x = move(self.drafter.block_input(target, ids), device)
        positions = torch.arange(anchor, anchor + self.block_size, device=device)
        hidden = self.drafter.blocks(x, positions, context, context_positions,
                                     position_bound=anchor + self.block_size)
        self._observe_pass(seq, anchor)
        drafted = hidden[1:1 + k]
        return self.drafter.logits(target.head_logits(move(drafted, target.device))), drafted

    def _context_view(self, seq, anchor: int):
        """What a pass at `anchor` reads of the drafter's context: the target's resident view when its
        KV is bounded (seq.kv_view; blocks outside it are not resident at all), else this drafter's own
        pool's, else all of it (None)."""
        view = getattr(seq, "kv_view", None)
        if view is not None:
            return None if view.is_identity else view
        if self.pool is None:
            return None
        if self.pool.due(seq, anchor):
            self._project(seq)  # chunk keys are pooled from the cache: every position before the anchor in it
            return self.pool.reselect(seq, anchor)
        return self.pool.view(seq, anchor)

    def _observe_pass(self, seq, anchor: int) -> None:
        if self.pool is not None and getattr(seq, "kv_view", None) is None:
            self.pool.observe_pass(seq, anchor)

    def _draft_one(self, seq, k: int) -> Draft:
        """The argmax of the drafter's processed logits in every slot, at every temperature: a
        deterministic draft (one-hot q) keeps verification lossless and lets sampled sequences be
        verified inside the target's graph; sampling the drafts from q measured the same acceptance
        (bundled pair, T = 1)."""
        logits = self._draft_logits(seq, k)
        if self.tree_budget is not None:  # from the drafter's own distributions, at temperature 1
            tree = build_tree(logits.float().log_softmax(-1), self.tree_budget)
            return Draft(tree.tokens, parents=tree.parents)
        out = list(seq.output_token_ids)
        if self.graphs is not None and seq.params.keeps_argmax(len(out)):
            return Draft(self.graphs.tokens[:k].tolist())  # the argmax the graph took
        # Unless processing reads the drafts before a slot, every slot is processed alike: all k rows at
        # once. Otherwise slot by slot, each with its own history, as the target's rows are verified.
        if not seq.params.reads_history(len(out)):
            states = [SamplingState(seq.params, seq.prompt_token_ids, out, seq.generator)] * k
            return Draft(self.sampler.process_logits(logits, states).argmax(-1).tolist())
        tokens: list[int] = []
        for i in range(k):
            state = SamplingState(seq.params, seq.prompt_token_ids, out + tokens, seq.generator)
            tokens.append(int(self.sampler.process_logits(logits[i:i + 1], [state]).argmax()))
        return Draft(tokens)
