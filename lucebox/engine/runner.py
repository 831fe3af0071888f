"""ModelRunner: owns the model and its paged KV pool; runs one ragged batch per call.

KV cache groups (model/cache_spec.kv_groups, engine/cache_manager.py): the engine hands its
groups and each group's pool size; layers of group g get caches of that group's blocks (plus its
scratch block) and read group g's tables (`Attention.kv_group`). Without groups every paged layer
is in one group of num_blocks (bare forwards, draft models)."""
from __future__ import annotations

import logging

import torch

from ..kernels.attention import uses_triton
from ..kernels.forward_batch import ForwardBatch
from ..kernels.kv_compact import compact_rows, compaction_slots
from ..model.cache_spec import KVGroup, PagedKVSpec, RecurrentSpec, kv_groups, release_window
from ..model.transformer import Transformer
from ..util import host_to_device
from .cuda_graphs import CudaGraphRunner
from .graph_settings import GraphSettings
from .placement import layer_device
from .step_plan import RowKind, StepPlan, StepResult

log = logging.getLogger("lucebox")


def release_installed_caches(model) -> None:
    """Forget the caches a runner installed in the model's layers (K/V, recurrent state; ModelRunner._install).
    A new engine calls this before sizing its KV from the free memory (memory_plan.cuda_kv_budget collects
    what this lets go): an engine dropped earlier on the same loaded model would otherwise keep its pool
    alive through the layers. A live engine on the model loses nothing: its runner reinstalls its own
    caches at its next step."""
    for module in model.modules():
        for name in ("k_cache", "v_cache", "state"):
            if hasattr(module, name) and not isinstance(getattr(module, name), torch.Tensor):
                setattr(module, name, None)


def model_kv_groups(model, specs) -> list[KVGroup]:
    """kv_groups(specs) of a model's layers (then any proposer's caches) when every attention module
    of the model reads its group's tables (`kv_group`, as transformer.Attention does); else one group
    of every paged layer, released only when all are windowed (a model whose attention has not been
    taught KV cache groups keeps its sliding-window layers' whole context)."""
    groups = kv_groups(specs)
    if len(groups) > 1 and not all(hasattr(model.layers[i].self_attn, "kv_group")
                                   for g in groups for i in g.layers if i < len(model.layers)):
        log.info("sliding-window layers keep their whole context: %s reads one block table",
                 type(model).__name__)
        return [KVGroup(tuple(sorted(i for g in groups for i in g.layers)), release_window(specs))]
    return groups


class ModelRunner:
    """`run` is the one entry: steps that fit a CUDA-graph bucket replay a graph (engine/cuda_graphs.py),
    everything else (prefill chunks, ragged mixes, CPU) runs eagerly."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, cache_type_k: str = "auto",
                 cache_type_v: str = "auto", rotate_k: bool = False, graphs: GraphSettings | None = None,
                 state_slots: int = 8, groups: list[KVGroup] | None = None, group_blocks: list[int] = ()):
        """groups / group_blocks: the engine's KV cache groups (over the model's specs, then any
        proposer's) and the pool of each group after the primary, whose pool is num_blocks."""
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One block more than the scheduler hands out: graph padding writes its K/V there, and table
        # entries of blocks released behind a sliding window point at it (never read).
        self.scratch_block = num_blocks
        self.cache_specs = model.cache_specs(cache_type_k, cache_type_v, rotate_k)
        # Paged K/V of the attention layers; hybrids' DeltaNet layers keep recurrent slots instead.
        self.paged_layers = [i for i, s in enumerate(self.cache_specs) if isinstance(s, PagedKVSpec)]
        first = self.cache_specs[self.paged_layers[0]]
        self.cache_types = (first.cache_type_k, first.cache_type_v)
        self.layer_group = {i: 0 for i in self.paged_layers}  # layer -> its KV cache group
        for g, group in enumerate((groups or [])[1:], 1):
            self.layer_group.update((i, g) for i in group.layers if i in self.layer_group)
        self.group_scratch = tuple(group_blocks)  # scratch block of groups 1.. = their pool size
        pools = [num_blocks, *self.group_scratch]
        self.caches = [self.cache_specs[i].build(pools[self.layer_group[i]] + 1, block_size, model.dtype,
                                                 layer_device(model, i)) for i in self.paged_layers]
        self.recurrent_layers = [i for i, s in enumerate(self.cache_specs) if isinstance(s, RecurrentSpec)]
        # Bare forwards (tests, benches) get a small pool of their own; an engine installs its
        # CacheManager's (install_recurrent), whose slots follow the sequences.
        self.recurrent_states = [self.cache_specs[i].build(state_slots, 0, layer_device(model, i))
                                 for i in self.recurrent_layers]
        self.state_slot = None  # engine: Sequence -> its slot
        self._install()
        self.graphs = self._graph_runner(graphs)

    def install_recurrent(self, states: list, state_slot) -> None:
        """Use the cache manager's recurrent storage (one per DeltaNet layer) and slot lookup."""
        self.recurrent_states, self.state_slot = list(states), state_slot
        self._install()

    def reset_states(self, slots: list[int]) -> None:
        """Bare forwards: these slots start new sequences (zero recurrent state)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.model.device)
        for state in self.recurrent_states:
            state.reset(index.to(state.state.device))

    def _install(self) -> None:
        """Point the model's attention layers at this runner's KV caches (and DeltaNet layers at its
        recurrent states). Engines can share one loaded model (benchmarks compare configurations
        side by side): each run reinstalls its own caches, so one engine never reads or writes
        another's K/V."""
        for i, (k_cache, v_cache) in zip(self.paged_layers, self.caches):
            attn = self.model.layers[i].self_attn
            attn.k_cache, attn.v_cache, attn.kv_group = k_cache, v_cache, self.layer_group[i]
        for i, state in zip(self.recurrent_layers, self.recurrent_states):
            self.model.layers[i].linear_attn.state = state

    def state_rows(self, plan: StepPlan) -> tuple[list[int], list[int]]:
        """Per plan row: its recurrent slot, and how many of its tokens advance the state in place:
        0 for a verify (CacheManager.rollback advances over the accepted ones after the verdict)
        and for a step launched ahead (fed from the previous step's tokens, plan.ids_from: it may
        go unused; CacheManager.advance_stashed applies it once it is used)."""
        slots = plan.state_slots or [self.state_slot(row.seq) for row in plan.rows]
        stash_only = plan.ids_from is not None
        return slots, [0 if stash_only or row.kind is RowKind.VERIFY else len(row.tokens) for row in plan.rows]

    def _set_state_rows(self, batch: ForwardBatch, plan: StepPlan) -> None:
        batch.set_state_rows(*self.state_rows(plan))

    def _graph_runner(self, settings: GraphSettings | None) -> CudaGraphRunner | None:
        if settings is None:
            return None
        if settings.capture:
            if self.model.device.type != "cuda":
                return None
            attn = self.model.layers[self.paged_layers[0]].self_attn
            probe = torch.empty(1, attn.num_heads, attn.head_dim, dtype=self.model.dtype, device=self.model.device)
            if not uses_triton(probe, attn.k_cache, attn.v_cache):
                # The torch attention of a device-only batch spans max_model_len for every sequence.
                log.info("CUDA graphs off: attention runs the torch reference (LUCEBOX_TRITON=0 or no Triton)")
                return None
        graphs = CudaGraphRunner(self.model, self.block_size, self.scratch_block, settings, self.group_scratch)
        if self.recurrent_layers:  # DeltaNet rows read their slots from static inputs too
            graphs.state_rows = self.state_rows
            graphs.scratch_slot = lambda: self.recurrent_states[0].scratch
        return graphs

    def attach_graphs(self, settings: GraphSettings | None) -> None:
        """Use graph buckets of these settings from now on (capture=False on the CPU: tests run the
        padded static batches a graph would replay, eagerly)."""
        self.graphs = self._graph_runner(settings)

    def capture_graphs(self, capture_layers: tuple[int, ...] = (), trees: bool = True, prefill: bool = True) -> None:
        """Capture every CUDA-graph bucket now (a no-op without graphs); trees / prefill: those buckets too."""
        if self.graphs is not None:
            self._install()  # a graph keeps reading the caches installed when it was captured
            self.graphs.capture_all(tuple(capture_layers), trees, prefill)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        """Forward the plan's new tokens; what comes back follows the plan (StepResult): float32
        logits of its logits rows, or with plan.argmax the argmax token of each (one small
        device-to-host copy). With plan.sample (a decode or verify step of deterministic drafts), a
        graph that samples returns [drafts accepted, next token] per row (`accept_in_graph`); other
        steps return the logits for the caller to sample.

        With capture_layers, also the outputs of those layers for every new token, concatenated:
        [T, len(capture_layers) * hidden]; a graph step with a feature ring (`set_feature_ring`)
        writes them to the T ring rows from plan.feature_rows instead and returns their RingRows.

        write_kv=False recomputes positions whose K/V the cache already holds (a dormant drafter's
        missed taps) without touching it: the new K/V go to the scratch block, and attention, which
        reads the cache, sees the cached K/V. One sequence; through a catch-up graph when one fits.

        defer / ids_from: overlapped decode steps through the graphs (CudaGraphRunner.run); a step
        that fits no bucket runs eagerly and is returned as its result, never deferred."""
        if self.model.layers[self.paged_layers[0]].self_attn.k_cache is not self.caches[0][0]:
            self._install()
        self._group_tables(plan)
        if self.recurrent_layers and not plan.write_kv:
            raise RuntimeError("recomputing cached positions would advance recurrent state twice")
        # tree steps through tree buckets (CudaGraphRunner), never a chain's; rows with a map of RoPE positions
        # (a compressed prompt's chunks) run eagerly, rows shifted by a constant (PlanRow.rope_shift) in graphs
        key = self.graphs.key_for(plan) if self.graphs is not None and not plan.has_position_maps else None
        return self._launch(plan, key)

    def _launch(self, plan: StepPlan, key: tuple | None) -> StepResult:
        """The step through the graph of `key` (CudaGraphRunner.key_for's), or eagerly (None)."""
        if key is not None:
            return self.graphs.replay(plan, key)
        if plan.ids_from is not None:
            raise RuntimeError("a step fed from a previous step's device tokens must fit a CUDA-graph bucket")
        return self.run_eager(plan)

    def _group_tables(self, plan: StepPlan) -> list[list[list[int]]]:
        """The plan's tables of KV cache groups 1.., checked against this runner's groups."""
        tables = plan.group_tables
        if len(tables) != len(self.group_scratch):
            raise ValueError(f"this model keeps {1 + len(self.group_scratch)} KV cache groups; the plan's rows "
                             f"have tables for {1 + len(tables)}")
        return tables

    def forward(self, token_ids: list[list[int]], start_positions: list[int], block_tables: list[list[int]],
                **choices) -> torch.Tensor:
        """The logits of a bare ragged forward (benchmarks, tests, a draft model's steps): each
        sequence's last new token, or the plan's logits_rows / all_logits (StepPlan's fields)."""
        return self.run(StepPlan.forward(token_ids, start_positions, block_tables, **choices)).logits

    def compact_tree_rows(self, tables: list[list[int]], starts: list[int], accepted: list[list[int]],
                          window_tables: list[list[list[int]]] = ()) -> None:
        """After tree verifies: each sequence's accepted rows (accepted[b], from its tree row at starts[b])
        move onto contiguous positions in every attention layer's K/V; window_tables[b][g - 1]: sequence
        b's table in KV cache group g (models mixing windows), whose layers move through it."""
        groups = [tables] + [[seq[g] for seq in window_tables] for g in range(len(self.group_scratch))]
        for g, group in enumerate(groups):
            src, dst = compaction_slots(group, self.block_size, starts, accepted, self.model.device)
            if not src.numel():
                continue
            unique = {id(c): c for layer, pair in zip(self.paged_layers, self.caches)
                      if self.layer_group[layer] == g for c in pair}
            by_device: dict = {}  # a split model's caches lie on their layers' devices
            for cache in unique.values():
                by_device.setdefault(cache.values.device, []).append(cache)
            for device, caches in by_device.items():
                compact_rows(caches, src.to(device), dst.to(device))

    def set_feature_ring(self, ring) -> None:
        """Graph steps write captured features into this FeatureRing (before any capture)."""
        if self.graphs is not None:
            self.graphs.feature_ring = ring

    @torch.inference_mode()
    def run_eager(self, plan: StepPlan) -> StepResult:
        """`run` without graphs: the exact ragged batch, no padding."""
        capture_layers = plan.capture_layers
        trees = [row.parents for row in plan.rows] if plan.has_trees else None
        rope = [row.positions for row in plan.rows] if plan.has_position_maps else None
        batch = ForwardBatch.build(plan.token_ids, plan.start_positions, plan.block_tables, self.block_size,
                                   self.model.device, capture_layers, self._group_tables(plan), trees, rope,
                                   plan.rope_shifts)
        if plan.capture_queries:
            batch.query_capture = {}
        if self.recurrent_layers:
            self._set_state_rows(batch, plan)
        if not plan.write_kv:
            rows = batch.slot_mapping.shape[0]
            offsets = torch.arange(rows, device=batch.slot_mapping.device) % self.block_size
            batch.slot_mapping = self.scratch_block * self.block_size + offsets
            batch.group_slots = tuple(scratch * self.block_size + offsets for scratch in self.group_scratch)
        hidden = self.model(batch)
        if plan.logits_rows is not None:
            hidden = hidden[host_to_device(plan.logits_rows, hidden.device, torch.long)]
        elif not plan.all_logits:
            hidden = hidden[batch.query_start_loc[1:] - 1]
        logits = self.model.compute_logits(hidden)
        # taps of a split model's layers come from their devices: gathered where the logits are
        features = torch.cat([batch.captured[i].to(hidden.device) for i in capture_layers], dim=-1) \
            if capture_layers else None
        queries = batch.query_capture
        if plan.argmax:
            return StepResult(tokens=logits.argmax(-1).tolist(), features=features, queries=queries)
        return StepResult(logits=logits, features=features, queries=queries)
