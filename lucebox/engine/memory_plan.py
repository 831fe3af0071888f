"""The engine's memory plan: blocks of each KV cache group's device pool, recurrent stash rows, and
KVFlash's pool (device blocks a pooled sequence holds, host backing)."""
from __future__ import annotations

import gc

import torch

from ..errors import RequestError, UnsupportedError
from ..model.cache_spec import (
    RecurrentSpec,
    bytes_per_sequence,
    plan_pools,
    pools_bytes_wanted,
)
from .kv_pool import KVPool, device_tokens_per_sequence
from .placement import is_split, layer_device, split_kv_budget
from .state_snapshots import snapshot_bytes

CPU_KV_CAP = 2 << 30  # bytes of KV on the CPU when --kv-cache-memory does not say


def cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes a KV pool on this GPU may take: `utilization` of the card less what is in use now."""
    gc.collect()  # an engine dropped in a reference cycle still holds its KV pool until collected
    torch.cuda.empty_cache()  # memory the caching allocator holds but no tensor uses counts as free
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization) - (total - free)


def stash_rows(speculator, specs) -> int:
    """Recurrent stash rows per sequence: one per position of the longest verify row (the pending token
    and max_k drafts, or a draft tree's nodes), from which a commit advances the state over the
    accepted positions."""
    if not any(isinstance(s, RecurrentSpec) for s in specs):
        return 0
    if speculator is None:
        return 1  # a decode step launched ahead stashes its token until it is used (engine/overlap.py)
    return speculator.policy.row_tokens(speculator.policy.max_k)  # a chain's 1 + k, a tree's row


def plan_kv_blocks(engine, specs, groups) -> list[int]:
    """Blocks of each KV cache group's pool (model/cache_spec.plan_pools); the primary's first."""
    args = engine.args
    draft_device = getattr(engine.speculator.proposer, "device", None) if engine.speculator is not None else None
    seq_tokens = engine.max_model_len
    if args.kv_pool_tokens:  # a pooled sequence holds its pool; only unpooled ones need a whole context
        seq_tokens = min(seq_tokens, device_tokens_per_sequence(args.kv_pool_tokens, args.max_num_batched_tokens,
                                                                args.kv_reselect_interval))
    blocks_per_seq = -(-seq_tokens // args.block_size)
    # fixed-size state (recurrent layers) and its per-draft snapshots, for every sequence at once
    fixed = bytes_per_sequence(specs, stash_rows(engine.speculator, specs)) * args.max_num_seqs
    fixed += snapshot_bytes(specs, engine._prefix_snapshots())  # hybrids' prefix-reuse states
    if engine.speculator is not None:  # a recurrent draft model's state slots
        fixed += engine.speculator.proposer.fixed_bytes(args.max_num_seqs)

    def device_budget(device: torch.device) -> int:
        if device.type == "cuda":
            return cuda_kv_budget(device, args.gpu_memory_utilization)
        wanted = pools_bytes_wanted(specs, groups, args.block_size, args.max_num_seqs,
                                    args.max_num_batched_tokens, seq_tokens)
        return min(CPU_KV_CAP, wanted + fixed)
    if args.kv_cache_memory:
        budget = args.kv_cache_memory
    elif is_split(engine.model) or draft_device not in (None, engine.model.device):
        layers = len(engine.model.layers)  # each device's caches: its layers', the drafter's on its own
        devices = [layer_device(engine.model, i) if i < layers else draft_device for i in range(len(specs))]
        budget = split_kv_budget(specs, devices, device_budget)
    else:
        budget = device_budget(engine.model.device)
    budget -= fixed
    pools = plan_pools(specs, groups, budget, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                       engine.max_model_len)
    num_blocks = pools[0]
    if num_blocks < blocks_per_seq:
        needed = (f"one pooled sequence ({seq_tokens} tokens: --kv-pool-tokens and a step's tokens)"
                  if args.kv_pool_tokens else f"one sequence of max_model_len={engine.max_model_len}")
        raise RequestError(
            f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num_blocks * args.block_size} tokens, "
            f"less than {needed}; lower --max-model-len (or --kv-pool-tokens) or raise --kv-cache-memory / "
            f"--gpu-memory-utilization")
    return pools


def make_kv_pool(engine, specs, groups) -> KVPool:
    """KVFlash's pool over the primary KV cache group: the target's full-attention layers' caches and a
    proposer's on the same block table, host-backed."""
    args, runner = engine.args, engine.runner
    if engine.speculator is not None and engine.speculator.proposer.runs_model is not None:
        raise UnsupportedError("kv_pool_tokens (KVFlash) with a draft model (method draft_model) is not supported "
                               "yet; use dflash or ngram speculation")
    target = [pair for layer, pair in zip(runner.paged_layers, runner.caches) if runner.layer_group[layer] == 0]
    proposer = list(getattr(engine.speculator.proposer, "caches", ())) if engine.speculator is not None else []
    caches = [c for pair in target + proposer for c in pair]
    windows = tuple(g.window for g in groups[1:])
    return KVPool(engine.scheduler.cache, caches, [k for k, _ in target], args.kv_pool_tokens,
                  args.kv_reselect_interval, args.kv_pool_host_memory, engine.max_model_len, windows,
                  args.max_num_seqs, args.max_num_batched_tokens)
