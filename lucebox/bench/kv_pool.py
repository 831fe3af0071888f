"""`lucebox bench kv-pool`: KVFlash (issue 30) in one run -- decode speed and device KV memory as the
context grows, with a bounded KV pool (--pool-tokens resident on the device, the rest in host memory)
and with the full KV.

Per context (--contexts; default 8K / 32K / 128K / 256K), batch 1, greedy: a prompt of that many random
token ids (speed does not depend on which) is prefilled, its time reported on its own, then
--decode-tokens are decoded and timed. Pooled runs share one engine started with --kv-pool-tokens
whose device KV holds one pool (the request says kv_pool: true); full runs share one engine whose KV
holds the longest context of --full-contexts that fits the device (longer ones are skipped with a
note). Memory per run: the KV blocks the sequence holds on the device (after its prefill and after its
decode, the larger) x their bytes, the device's peak allocation during the request above what was
allocated at its start (activations, staging), and the pooled sequence's KV copied to host memory.
With --draft-pool-tokens and a DFlash drafter shape for the target (bench/drafter_shapes.py): the
speculative rate at --draft-contexts with the drafter's KV pooled (lossless) and without; the random
drafter's drafts are rarely accepted, so the rows compare the steps' cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..engine.kv_pool import device_tokens_per_sequence, host_memory_available
from ..errors import RequestError
from ..model.cache_spec import kv_bytes_per_token
from ..model.loader import resolve_device
from ..sampling import SamplingParams
from . import drafter_shapes, kv_tables, shapes
from .flags import add_model_flags, add_run_flags
from .speed import Clock, engine_args

DEFAULT_CONTEXTS = (8192, 32768, 131072, 262144)
GOAL_CONTEXT, GOAL_RATIO, GOAL_DRAFT = 131072, 0.9, 1.3  # issue 30, H200: 128K within 10% of 8K; drafter 1.3x
DRAFT_TOKENS = 15
DEVICE_RESERVE = 4 << 30  # activations and prefill workspace beside a full context's KV
MIB = 2 ** 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, shape_default="qwen3-8b")
    p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS), help="prompt lengths")
    p.add_argument("--full-contexts", type=int, nargs="*", default=None,
                   help="contexts also run with the full KV (default: all of --contexts; none if given empty)")
    p.add_argument("--pool-tokens", type=int, default=8192, help=EngineArgs.HELP["kv_pool_tokens"])
    p.add_argument("--reselect-interval", type=int, default=EngineArgs.kv_reselect_interval,
                   help=EngineArgs.HELP["kv_reselect_interval"])
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded and timed per run")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens,
                   help=EngineArgs.HELP["max_num_batched_tokens"] + " (a prompt chunk: the pool grows by one)")
    p.add_argument("--draft-pool-tokens", type=int, default=None,
                   help="also time DFlash speculation with the drafter's KV pooled to this many tokens and without")
    p.add_argument("--draft-contexts", type=int, nargs="+", default=None,
                   help="contexts of the drafter rows (default: the longest full-KV context)")
    add_run_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check(args) -> None:
    lengths = args.contexts + (args.full_contexts or []) + (args.draft_contexts or [])
    if min(lengths) < 1 or args.decode_tokens < 2:
        raise RequestError("--contexts (and --full-contexts, --draft-contexts) must be positive, --decode-tokens >= 2")
    if set(args.full_contexts or []) - set(args.contexts) or set(args.draft_contexts or []) - set(args.contexts):
        raise RequestError("--full-contexts and --draft-contexts must be among --contexts")
    if args.pool_tokens < 1:
        raise RequestError(f"--pool-tokens must be positive, got {args.pool_tokens}")
    if args.draft_contexts and args.draft_pool_tokens is None:
        raise RequestError("--draft-contexts needs --draft-pool-tokens (the drafter rows' pool)")


def timed_request(engine: LLMEngine, clock: Clock, prompt: list[int], tokens: int, pooled: bool) -> dict:
    """One greedy request: prefill seconds, then `tokens` decoded tokens timed; the device KV the sequence
    holds after each (the larger reported), its KV in host memory, the device's peak above the start."""
    cuda = engine.model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.model.device)
        start_bytes = torch.cuda.memory_allocated(engine.model.device)
    params = SamplingParams(temperature=0, max_tokens=tokens + 2, ignore_eos=True)  # running when measured
    start = clock.now()
    engine.add_request("kv-pool", {"prompt_token_ids": prompt, **({"kv_pool": True} if pooled else {})}, params)
    seq = engine.requests["kv-pool"][1][0]
    while not seq.output_token_ids:
        engine.step()
    first = clock.now()
    held = kv_tables.held_kv_bytes(engine)  # between the timings: it walks the block tables
    resume = clock.now()
    while len(seq.output_token_ids) < 1 + tokens:
        engine.step()
    end, decoded = clock.now(), len(seq.output_token_ids) - 1
    held = max(held, kv_tables.held_kv_bytes(engine))
    pool = engine.kv_pool
    member = pool.members.get(id(seq)) if pool is not None else None
    m = seq.metrics
    while engine.has_unfinished():
        engine.step()
    return {"context": len(prompt), "prefill_s": first - start, "prefill_tok_s": len(prompt) / (first - start),
            "decode_tokens": decoded, "decode_s": end - resume, "tok_s": decoded / (end - resume),
            "device_kv_bytes": held, "host_kv_bytes": member.saved * pool.store.block_bytes if member else 0,
            "peak_above_start_bytes": torch.cuda.max_memory_allocated(engine.model.device) - start_bytes
            if cuda else None, "tau": m.mean_accepted_length if m.num_drafts else None}


def engine_memory(engine: LLMEngine) -> dict:
    """The KV the engine reserved on the device (every group's blocks) and, with a pool, in host memory."""
    cache, pool = engine.scheduler.cache, engine.kv_pool
    device = sum(blocks * size for (_, blocks, _), size in zip(cache.pool_usage(), kv_tables.group_block_bytes(cache)))
    host = pool.store.num_host_blocks * pool.store.block_bytes if pool is not None else 0
    return {"device_kv_reserved_bytes": device, "host_kv_reserved_bytes": host}


def run_engine(loaded, eargs: EngineArgs, contexts: list[int], prompts: dict, args, clock, bar,
               label: str, pooled: bool = False) -> tuple[dict, list[dict]]:
    """One engine, a warm-up request (kernels, graphs, a reselection), then one timed run per context."""
    engine = LLMEngine.from_args(eargs, loaded)  # it frees the KV the previous engine left in the model
    memory = engine_memory(engine)
    bar.set_description(f"{label}: warm-up")
    warm = prompts[max(contexts)][:2 * args.pool_tokens]  # past the pool: prefill and decode reselect
    timed_request(engine, clock, warm, args.reselect_interval + 8, pooled)
    rows = []
    for n in contexts:
        bar.set_description(f"{label} at {n:,}")
        rows.append(x := dict(timed_request(engine, clock, prompts[n], args.decode_tokens, pooled), kv=label))
        bar.update()
        tqdm.write(f"[bench kv-pool] {label} at {n:,}: prefill {x['prefill_s']:.2f} s, decode {x['tok_s']:,.1f} "
                   f"tok/s, device KV {_mib(x['device_kv_bytes'])} MiB", file=sys.stderr)  # a cut-off run keeps it
    return memory, rows


def max_len(contexts: list[int], args) -> int:
    """Positions an engine's sequence may reach: the longest context, the tokens decoded after it (the
    warm-up's included) and a verify step's drafts."""
    return max(contexts) + max(args.decode_tokens, args.reselect_interval + 8) + 2 * (DRAFT_TOKENS + 1) + 8


def full_fits(loaded, specs, n: int, args, device, extra: int = 0) -> bool:
    """Whether a context's whole KV (and `extra` bytes: a drafter's) fits the device's free memory now."""
    if device.type != "cuda":
        return True
    free = torch.cuda.mem_get_info(device)[0] - DEVICE_RESERVE
    return kv_tables.pool_bytes(loaded.model, specs, max_len([n], args), EngineArgs.block_size,
                                EngineArgs.max_num_batched_tokens) + extra < free


def pooled_engine_args(loaded, specs, contexts: list[int], args) -> EngineArgs:
    """Device KV for one pooled sequence (its pool, a prompt chunk, an interval), host KV for one whole context."""
    longest = max_len(contexts, args)
    resident = device_tokens_per_sequence(args.pool_tokens, args.max_num_batched_tokens, args.reselect_interval)
    host = kv_tables.pool_bytes(loaded.model, specs, longest, EngineArgs.block_size, 1)
    available = host_memory_available()
    if available and host > available * 0.8:
        raise RequestError(f"the pool's host KV for {longest:,} positions needs {host / 2**30:.1f} GiB, more than "
                           f"80% of the {available / 2**30:.1f} GiB of host memory available: lower --contexts")
    return engine_args(args, longest, loaded, kv_len=min(longest, resident), speculative_config={},
                       kv_pool_tokens=args.pool_tokens, kv_reselect_interval=args.reselect_interval,
                       kv_pool_host_memory=host, max_num_batched_tokens=args.max_num_batched_tokens)


def draft_rows(loaded, specs, args, contexts, prompts, clock, bar, notes) -> list[dict]:
    """Speculative rate at each context: the drafter's KV whole, then pooled to --draft-pool-tokens."""
    # the drafter's KV for every position beside the target's (its blocks share the target's table)
    per_token = drafter_shapes.kv_bytes_per_token(loaded.config, loaded.model.dtype)
    fitting = [n for n in contexts if full_fits(loaded, specs, n, args, loaded.model.device,
                                                per_token * max_len([n], args))]
    if fitting != contexts:
        notes.append(f"drafter rows skipped at {[n for n in contexts if n not in fitting]}: the target's whole KV "
                     f"and the drafter's do not fit the device")
    bar.total -= 2 * (len(contexts) - len(fitting))
    if not fitting:
        return []
    contexts, rows = fitting, []
    longest = max_len(contexts, args)
    drafter_kv = per_token * (longest + 64)
    with tempfile.TemporaryDirectory() as tmp:
        drafter = drafter_shapes.random_dflash_drafter(loaded.config, Path(tmp) / "dflash", seed=args.seed)
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DRAFT_TOKENS, "adaptive": False}
        for label, extra in (("drafter full", {}), ("drafter pool", {"draft_kv_pool_tokens": args.draft_pool_tokens})):
            eargs = engine_args(args, longest, loaded, speculative_config=spec,
                                max_num_batched_tokens=args.max_num_batched_tokens, **extra)
            eargs = dataclasses.replace(eargs, kv_cache_memory=eargs.kv_cache_memory + drafter_kv)
            rows += run_engine(loaded, eargs, contexts, prompts, args, clock, bar, label)[1]
    full = {r["context"]: r["tok_s"] for r in rows if r["kv"] == "drafter full"}
    for r in rows:
        r["vs_drafter_full"] = r["tok_s"] / full[r["context"]]
    return rows


def run(args: argparse.Namespace) -> dict:
    _check(args)
    device = resolve_device(args.device)
    shape = args.shape or (None if args.model else "qwen3-8b")
    loaded, quant = shapes.load_under_test(args.model, shape, args.quant, args.dtype, device, args.seed)
    specs = loaded.model.cache_specs(args.cache_type_k, args.cache_type_v)
    contexts = sorted(set(args.contexts))
    full_wanted = sorted(set(contexts if args.full_contexts is None else args.full_contexts))
    notes = ["prompts are random token ids: decode speed does not depend on them",
             "a pooled prompt's chunks attend to the resident pool too (prefill bounded and lossy, like decode)"]
    if max(contexts) > loaded.config.max_position_embeddings:
        notes.append(f"contexts beyond the model's {loaded.config.max_position_embeddings:,} positions: RoPE "
                     f"simply continues (speed is what it would be with a longer-context model)")
    rng = random.Random(args.seed)
    prompts = {n: [rng.randrange(loaded.config.vocab_size) for _ in range(n)] for n in contexts}
    clock = Clock(device)
    kv = kv_bytes_per_token(loaded.model, args.cache_type_k, args.cache_type_v)
    result = {"meta": shapes.run_metadata(args, device), "model": dict(shapes.describe(loaded, quant), shape=shape,
              kv_bytes_per_token=kv), "pool_tokens": args.pool_tokens, "reselect_interval": args.reselect_interval,
              "engines": {}, "pooled": [], "full": [], "draft": [], "notes": notes}
    draft_contexts = []
    if args.draft_pool_tokens is not None:
        why = None if drafter_shapes.has_dflash_shape(loaded.config) else \
            f"drafter rows skipped: no DFlash drafter shape for a {loaded.config.family} target"
        draft_contexts = [] if why else sorted(set(args.draft_contexts or full_wanted[-1:] or contexts[-1:]))
        notes += [why] if why else []
    with tqdm(total=2 * len(contexts) + 2 * len(draft_contexts), file=sys.stderr, disable=args.no_progress,
              unit="run") as bar:
        eargs = pooled_engine_args(loaded, specs, contexts, args)
        result["engines"]["pool"], result["pooled"] = run_engine(loaded, eargs, contexts, prompts, args, clock, bar,
                                                                 "pool", pooled=True)
        full = [n for n in full_wanted if full_fits(loaded, specs, n, args, device)]
        if full != full_wanted:
            notes.append(f"full KV skipped at {[n for n in full_wanted if n not in full]}: it does not fit the device")
        bar.total -= len(contexts) - len(full)
        if full:
            eargs = engine_args(args, max_len(full, args), loaded, speculative_config={},
                                max_num_batched_tokens=args.max_num_batched_tokens)
            result["engines"]["full"], result["full"] = run_engine(loaded, eargs, full, prompts, args, clock, bar,
                                                                   "full")
        if draft_contexts:
            result["draft"] = draft_rows(loaded, specs, args, draft_contexts, prompts, clock, bar, notes)
    base = result["pooled"][0]["tok_s"]
    by_full = {r["context"]: r["tok_s"] for r in result["full"]}
    for r in result["pooled"]:
        r["vs_shortest"] = r["tok_s"] / base
        r["vs_full"] = r["tok_s"] / by_full[r["context"]] if r["context"] in by_full else None
    return result


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:,.1f}"


def goal_lines(r: dict) -> list[str]:
    """Issue 30's goals for an H200, where the run has the figures."""
    lines, pooled = [], {x["context"]: x for x in r["pooled"]}
    if GOAL_CONTEXT in pooled and r["pool_tokens"] == 8192 and len(pooled) > 1:
        ratio, first = pooled[GOAL_CONTEXT]["vs_shortest"], min(pooled)
        lines.append(f"goal: pooled decode at {GOAL_CONTEXT:,} >= {GOAL_RATIO:.0%} of at {first:,}: {ratio:.1%} "
                     f"{'met' if ratio >= GOAL_RATIO else 'MISSED'}")
    for x in r["draft"]:
        if x["kv"] == "drafter pool" and x["context"] == GOAL_CONTEXT:
            lines.append(f"goal: speculative rate at {GOAL_CONTEXT:,} with the drafter pool >= {GOAL_DRAFT}x without: "
                         f"{x['vs_drafter_full']:.2f}x {'met' if x['vs_drafter_full'] >= GOAL_DRAFT else 'MISSED'}")
    return lines


def print_report(r: dict) -> None:
    m, e = r["model"], r["engines"]
    print(f"{m['source']}: {m['quant']} weights, {r['meta']['device']}, batch 1, greedy; KVFlash pool of "
          f"{r['pool_tokens']:,} tokens (reselected every {r['reselect_interval']}) against the full KV; "
          f"{m['kv_bytes_per_token']:,} B of KV per token")
    for name, x in e.items():
        print(f"{name} engine: device KV reserved {_mib(x['device_kv_reserved_bytes'])} MiB"
              + (f", host KV reserved {_mib(x['host_kv_reserved_bytes'])} MiB" if x["host_kv_reserved_bytes"] else ""))
    print("\n| context | KV | prefill s | decode tok/s | / shortest | pool / full | device KV MiB | peak above start "
          "MiB | host KV MiB |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for x in sorted(r["pooled"] + r["full"], key=lambda x: (x["context"], x["kv"])):
        ratio = f"{x['vs_shortest']:.3f}" if "vs_shortest" in x else "-"
        vs = f"{x['vs_full']:.2f}x" if x.get("vs_full") else "-"
        print(f"| {x['context']:,} | {x['kv']} | {x['prefill_s']:.2f} | {x['tok_s']:,.1f} | {ratio} | {vs} | "
              f"{_mib(x['device_kv_bytes'])} | {_mib(x['peak_above_start_bytes'])} | {_mib(x['host_kv_bytes'])} |")
    if r["draft"]:
        print("\n| context | speculation (DFlash, random drafter) | tok/s | tau | / drafter full |\n"
              "|---:|---|---:|---:|---:|")
        for x in r["draft"]:
            tau = f"{x['tau']:.2f}" if x["tau"] else "-"
            print(f"| {x['context']:,} | {x['kv']} | {x['tok_s']:,.1f} | {tau} | {x['vs_drafter_full']:.2f}x |")
    for line in goal_lines(r) + [f"note: {n}" for n in r["notes"]]:
        print(f"\n{line}")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0
