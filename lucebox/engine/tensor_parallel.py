"""Tensor parallelism (`--tensor-parallel-size N`): the engine on rank 0, a forward loop on the others.

Rank 0 (this process) runs the whole engine -- scheduler, speculator, sampling, server -- over its
shard of the model (model/tensor_parallel.py). Its runner (ShardedRunner) broadcasts each step's
plan as one packed int64 tensor (engine/tp_plan.py) before running it; every other rank
(`python -m lucebox.engine.tensor_parallel`, started by tp_ranks.Ranks) unpacks it and runs the
same forward over its own shard and KV cache (its KV heads only), taking part in the all-reduces
and the LM head's all-gather, and discards the result. Hybrids' recurrent state lives on every rank
(each its own DeltaNet heads): rank 0's cache manager changes its slots, the other ranks follow
(engine/tp_state.py). A DFlash drafter lives on rank 0 alone: its taps are the residual stream, the
same on every rank, and it embeds and projects through an unsharded copy of the embedding and LM
head (FullVocabView). CUDA graphs: every rank captures the same buckets in the same order, and each
step's plan names the graph rank 0 replays it through, so every rank pads it alike and the collectives
inside the graphs (NCCL's are capturable) match; opt-in (--cuda-graphs). Overlapped decoding is off (a
step's tokens come from its plan).
"""
from __future__ import annotations

import atexit
import logging
import pickle
import sys
import traceback
from dataclasses import replace
from typing import Protocol

import torch
import torch.distributed as dist

from ..config import EngineArgs
from ..errors import LuceboxError, RequestError
from ..model.config import ModelConfig
from ..model.loader import (
    LoadedModel,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_path,
)
from ..model.tensor_parallel import (
    FullVocab,
    FullVocabView,
    check_config,
    move_quantised_experts,
    shard_model,
)
from .build import resolve_args
from .engine import LLMEngine
from .memory_plan import cuda_kv_budget
from .runner import ModelRunner
from .tp_plan import (
    RankPlan,
    pack_compaction,
    pack_plan,
    unpack_compaction,
    unpack_plan,
)
from .tp_ranks import (
    CAPTURE,
    COMPACT,
    GRAPHS,
    INIT,
    RECURRENT,
    RUN,
    STATE,
    STOP,
    Ranks,
    TensorParallelError,
    form_group,
    join,
    read_payload,
)
from .tp_state import RankStates, StateLog, mirror_cache

log = logging.getLogger("lucebox")


def launch(args: EngineArgs, loaded: LoadedModel | None = None, shards: Shards | None = None) -> TensorParallelEngine:
    """Rank 0: start the other ranks, load this rank's shard, build the engine (LLMEngine.from_args).
    shards: where every rank's shard comes from (default: the checkpoint args.model names)."""
    if loaded is not None:
        raise RequestError("tensor parallelism loads each rank's shard itself: give the model by name, "
                           "not a loaded model")
    shards = shards or CheckpointShards()
    args = shards.resolve(args)
    if args.async_decode:
        log.info("overlapped decoding is off under tensor parallelism (the ranks read each step's tokens from "
                 "its plan)")
    args = replace(args, async_decode=False)
    if args.cuda_graphs is None:  # NCCL inside captured graphs has not run on two GPUs here yet: asked for, not default
        log.info("CUDA graphs under tensor parallelism are opt-in (--cuda-graphs); steps run eagerly")
        args = replace(args, cuda_graphs=False)
    size = args.tensor_parallel_size
    shards.check(args)  # refused before any rank starts
    device = rank_device(args, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator of rank 0 on cuda:0
    ranks = Ranks.start(size, device.type, pickle.dumps((args, shards)))
    try:
        error, loaded, full, budget = None, None, None, None
        try:
            keep_vocab = args.speculative_config is not None and args.speculative_config.method == "dflash"
            loaded, full = shards.load(args, 0, keep_vocab)
        except LuceboxError as e:
            error = e
        statuses = _exchange_status(ranks.channel.group, size, str(error) if error else None, budget)
        if error is not None:
            raise error
        for rank, (message, _) in enumerate(statuses):
            if message is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {message}")
        engine = TensorParallelEngine(loaded, args, ranks, full, [b for _, b in statuses[1:] if b is not None])
    except LuceboxError:
        ranks.kill()
        raise
    except Exception as e:
        raise ranks.fail(e) from e
    atexit.register(ranks.stop)  # the ranks, not the engine: a shut-down engine's memory is not held to exit
    return engine


def rank_device(args: EngineArgs, rank: int) -> torch.device:
    """cuda:rank when the engine runs on CUDA (device cuda or auto), else the CPU."""
    size = args.tensor_parallel_size
    device = resolve_device(args.device)
    if device.type == "cpu":
        return device
    if args.device not in ("auto", "cuda"):
        raise RequestError(f"--tensor-parallel-size {size} puts rank r on cuda:r; give --device cuda (or auto), "
                           f"not {args.device}")
    if size > torch.cuda.device_count():
        raise RequestError(f"--tensor-parallel-size {size} needs {size} CUDA devices; this machine has "
                           f"{torch.cuda.device_count()}")
    return torch.device("cuda", rank)


class Shards(Protocol):
    """Where every rank's shard comes from; pickled to the other ranks with the engine arguments."""

    def resolve(self, args: EngineArgs) -> EngineArgs:
        """The arguments completed as the engine will run them (rank 0, before any rank starts)."""

    def check(self, args: EngineArgs) -> None:
        """Refuse a model that does not split over args.tensor_parallel_size ranks, before any starts."""

    def load(self, args: EngineArgs, rank: int, keep_full_vocab: bool = False) -> tuple[LoadedModel, FullVocab | None]:
        """This rank's shard on rank_device(args, rank); keep_full_vocab: its unsharded embedding and head too."""


class CheckpointShards:
    """Shards of the checkpoint args.model names: read on the CPU, sharded, then moved."""

    def resolve(self, args: EngineArgs) -> EngineArgs:
        return resolve_args(args)

    def check(self, args: EngineArgs) -> None:
        path = resolve_path(args.model)
        if path.is_dir():  # a GGUF's config is checked once loaded
            check_config(ModelConfig.from_hf_dir(path), args.tensor_parallel_size)

    def load(self, args: EngineArgs, rank: int, keep_full_vocab: bool = False) -> tuple[LoadedModel, FullVocab | None]:
        device = rank_device(args, rank)
        dtype = args.dtype
        if device.type == "cuda" and dtype in (None, "auto"):  # the checkpoint's dtype, as loading on the GPU keeps
            path = resolve_path(args.model)
            dtype = resolve_dtype("auto", ModelConfig.from_hf_dir(path).torch_dtype if path.is_dir() else None,
                                  device)
        loaded = load_model(args.model, dtype=dtype, device="cpu")
        full = shard_model(loaded.model, rank, args.tensor_parallel_size, keep_full_vocab)
        loaded.model.to(device)
        move_quantised_experts(loaded.model, device)
        if full is not None:
            full = FullVocab(full.embed_tokens.to(device),
                             full.lm_head.to(device) if full.lm_head is not None else None)
        return loaded, full


def _kv_budget(device: torch.device, utilization: float) -> int | None:
    """Bytes this rank may give its KV pool (the engine's formula), None on the CPU."""
    return cuda_kv_budget(device, utilization) if device.type == "cuda" else None


def _exchange_status(group, size: int, error: str | None, budget: int | None) -> list:
    statuses = [None] * size
    dist.all_gather_object(statuses, (error, budget), group=group)
    return statuses


class ShardedRunner(ModelRunner):
    """Rank 0's runner: every forward and KV compaction is broadcast to the other ranks first."""

    def __init__(self, ranks: Ranks, model, *args, **kwargs):
        self.ranks = ranks
        self.state_log: StateLog | None = None  # recurrent-state changes the other ranks still have to make
        self._send(INIT, pickle.dumps((args, kwargs)))
        super().__init__(model, *args, **kwargs)

    def mirror_recurrent(self, cache) -> None:
        """The other ranks build recurrent pools like the cache manager's and follow its changes to them."""
        self.state_log, build = mirror_cache(cache)
        self._send(RECURRENT, torch.tensor(build, dtype=torch.int64))

    def _send(self, op: int, payload) -> None:
        if self.ranks.failure is not None:
            raise TensorParallelError(self.ranks.failure)
        try:
            self.ranks.check_alive()
            self.ranks.busy = op != INIT
            changes = self.state_log.take() if self.state_log is not None else None
            if changes is not None:  # the slots' changes since the last message, before what follows them
                self.ranks.channel.send(STATE, changes)
            self.ranks.channel.send(op, payload)
        except Exception as e:
            raise self.ranks.fail(e) from e

    def _launch(self, plan, key):
        self._send(RUN, pack_plan(plan, self.state_rows(plan) if self.recurrent_layers else None, key))
        try:
            result = super()._launch(plan, key)
        except Exception as e:
            raise self.ranks.fail(e) from e
        self.ranks.busy = False  # not on an interrupt (KeyboardInterrupt): shutdown then kills the others
        return result

    def attach_graphs(self, settings) -> None:
        self._send(GRAPHS, pickle.dumps(settings))
        super().attach_graphs(settings)
        self.ranks.busy = False

    def capture_graphs(self, capture_layers=(), trees: bool = True, prefill: bool = True) -> None:
        """Every rank captures the same buckets in the same order: a capture's warm-up forward runs the
        collectives, which the other ranks' warm-ups match."""
        if self.graphs is None:
            return
        self._send(CAPTURE, torch.tensor([int(trees), int(prefill), *capture_layers], dtype=torch.int64))
        try:
            super().capture_graphs(capture_layers, trees, prefill)
        except Exception as e:
            raise self.ranks.fail(e) from e
        self.ranks.busy = False

    def compact_tree_rows(self, tables, starts, accepted, window_tables=()) -> None:
        self._send(COMPACT, pack_compaction(tables, starts, accepted, window_tables))
        try:
            super().compact_tree_rows(tables, starts, accepted, window_tables)
        except Exception as e:
            raise self.ranks.fail(e) from e
        self.ranks.busy = False


class TensorParallelEngine(LLMEngine):
    """LLMEngine on rank 0 of a tensor-parallel group; `shutdown` stops the other ranks."""

    def __init__(self, loaded: LoadedModel, args: EngineArgs, ranks: Ranks, full_vocab: FullVocab | None,
                 worker_budgets: list[int]):
        self.ranks, self._full_vocab, self._worker_budgets = ranks, full_vocab, worker_budgets
        super().__init__(loaded, args)
        attn = self.model.layers[self.runner.paged_layers[0]].self_attn
        log.info("tensor parallel over %d ranks (%s): rank 0 keeps %d of %d query heads and %d of %d KV heads a layer",
                 ranks.size, ranks.backend, attn.num_heads, loaded.config.num_heads, attn.num_kv_heads,
                 loaded.config.num_kv_heads)

    def _recurrent_installed(self, cache) -> None:
        self.runner.mirror_recurrent(cache)

    def _draft_target(self, loaded: LoadedModel) -> LoadedModel:
        if self._full_vocab is None:
            return loaded
        return replace(loaded, model=FullVocabView(loaded.model, self._full_vocab))

    def _make_runner(self, *args, **kwargs) -> ModelRunner:
        return ShardedRunner(self.ranks, *args, **kwargs)

    def _plan_kv_blocks(self, specs, groups) -> list[int]:
        """Every rank gets the same pool (its own heads): the smallest budget any rank has."""
        own = _kv_budget(self.model.device, self.args.gpu_memory_utilization)
        if own is not None and self.args.kv_cache_memory is None:
            self.args = replace(self.args, kv_cache_memory=max(1, min([own, *self._worker_budgets])))
        return super()._plan_kv_blocks(specs, groups)

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        self.ranks.stop()


class RankRunner(ModelRunner):
    """The runner of a rank other than 0: no sequences here, so recurrent slots and advances come in the plan,
    and so does the CUDA graph rank 0 replays the step through (each rank replays its own capture of it)."""

    def state_rows(self, plan: RankPlan) -> tuple[list[int], list[int]]:
        return plan.state_slots, plan.state_advance

    def follow(self, plan: RankPlan) -> None:
        if plan.graph_key is not None and self.graphs is None:
            raise RuntimeError("rank 0 replays a CUDA graph this rank has no buckets for")
        self._launch(plan, plan.graph_key)


def worker_main() -> int:
    """A rank other than 0: load and shard, then run the forwards rank 0 broadcasts until told to stop."""
    rank, size, env = join()
    args, shards = read_payload()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s")
    device = rank_device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = form_group(rank, size, env, device.type)
    error, budget, model = None, None, None
    try:
        loaded, _ = shards.load(args, rank)
        model = loaded.model
        model.fuse_projections()  # as LLMEngine does on rank 0
        model.split_quant_rows()
        budget = _kv_budget(device, args.gpu_memory_utilization)
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
    statuses = _exchange_status(channel.group, size, error, budget)
    if any(message is not None for message, _ in statuses):
        dist.destroy_process_group()
        return 1
    runner, states = None, None
    while True:
        op, payload = channel.receive()
        if op == STOP:
            break
        if op == INIT:
            run_args, run_kwargs = pickle.loads(payload)
            runner = RankRunner(model, *run_args, **run_kwargs)
        elif op == RECURRENT:
            states = RankStates(payload.tolist(), [runner.cache_specs[i] for i in runner.recurrent_layers],
                                device)
            runner.install_recurrent(states.states, None)
            if device.type == "cuda":
                model.warm_up()  # the prefill kernels at this rank's head counts
        elif op == STATE:
            states.apply(payload)
        elif op == RUN:
            runner.follow(unpack_plan(payload))
        elif op == GRAPHS:
            runner.attach_graphs(pickle.loads(payload))
        elif op == CAPTURE:
            trees, prefill, *taps = payload.tolist()
            runner.capture_graphs(tuple(taps), bool(trees), bool(prefill))
        elif op == COMPACT:
            runner.compact_tree_rows(*unpack_compaction(payload))
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
