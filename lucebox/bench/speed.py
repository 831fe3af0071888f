"""`lucebox bench speed` (and bare `lucebox bench`): batch-1 speed against limits measured in the same run.

One process, one model (a checkpoint, or random weights of a named real shape: bench/shapes.py):
  reference   a large GEMV (the bandwidth a decode step can hope for) and a large matmul (TFLOP/s)
  prefill     TTFT and tok/s per prompt length; its FLOPs over the measured matmul rate
  prefix      --prefix-lens P.. --suffix-lens N..: TTFT of N new tokens on a cached prefix of P tokens
              beside a fresh N-token prompt (bench/prefix.py); llama-bench's pp N at depth P as its peer
  decode      tok/s per context through LLMEngine steps; weight (MoE: routed experts), recurrent state
              and KV bytes per token (bench/limits.py; sliding-window layers read at most their window),
              GB/s and % of the GEMV bandwidth; the KV memory the sequence holds (all KV cache groups:
              bench/kv_tables.py); the runner's forward alone too, to show the engine's overhead;
              joules per token from NVML power samples during the timed decode (bench/energy.py)
  verify      one 16-token forward against one decode forward (speculation pays only near 1x); hybrids
              run it as a verify row, keeping each position's DeltaNet state
  forced      speculation with drafts forced to be accepted (bench/forced.py), against its bound
  spec        tau, tok/s and speedup over plain decoding (with --draft, or --spec-method ngram)
  peer        --peer transformers: `generate` (static cache) over the very same float tensors (dense
              models, bench/transformers_peer.py); --peer llama.cpp: llama-bench on a GGUF of the same
              shape and mix (bench/llama_cpp.py), run last with the device to itself; as ratios
Each point is run once untimed (kernel compilation), then --repeats times; the median is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..engine.step_plan import PlanRow, RowKind, StepPlan
from ..errors import RequestError
from ..model.cache_spec import bytes_per_sequence, kv_bytes_per_token
from ..model.loader import resolve_device
from ..sampling import SamplingParams
from . import energy, kv_tables, limits, llama_cpp, prefix, shapes, transformers_peer, tree_verify
from .flags import add_model_flags, add_run_flags
from .forced import forced_phase
from .speed_report import print_report

DEFAULT_LENS = (512, 4096, 32768)
PHASES = ("reference", "prefill", "decode", "verify", "forced", "spec", "peer")
VERIFY_TOKENS = 16
PEERS = ("transformers", "llama.cpp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    for flag, what in (("--prompt-lens", "prefill prompt lengths"), ("--contexts", "decode contexts")):
        p.add_argument(flag, type=int, nargs="+", default=None,
                       help=f"{what} (default: those of 512 4096 32768 that fit the model and memory)")
    p.add_argument("--prefix-lens", type=int, nargs="+", default=[],
                   help="cached prefixes: time --suffix-lens new tokens on top of each, served from the prefix cache")
    p.add_argument("--suffix-lens", type=int, nargs="+", default=[128, 256, 512],
                   help="new tokens on top of each --prefix-lens prefix")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=EngineArgs.prefill_graphs,
                   help=EngineArgs.HELP["prefill_graphs"])
    p.add_argument("--tree-nodes", type=int, nargs="+", default=[],
                   help="also time a DDTree verify of N nodes against the decode forward (verify phase), e.g. 22 32 63")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded per measured run")
    p.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=EngineArgs.async_decode,
                   help=EngineArgs.HELP["async_decode"])
    p.add_argument("--repeats", type=int, default=3, help="measured runs per point; the median is reported")
    p.add_argument("--skip", nargs="+", default=[], choices=PHASES, help="measurements to leave out")
    p.add_argument("--no-peer", action="store_true", help="leave out the peer (= --skip peer)")
    p.add_argument("--peer", default="transformers", choices=PEERS,
                   help="the peer measured in the same run: transformers generate over the same float tensors "
                        "(dense models), or llama.cpp's llama-bench on a GGUF of the same shape and mix")
    p.add_argument("--llama-bench", default=".llama/bin/llama-bench",
                   help="llama-bench binary of the llama.cpp peer (scripts/build_llama_cpp.sh)")
    p.add_argument("--peer-dir", default=None,
                   help="where the llama.cpp peer writes its random GGUF (default: /dev/shm, else the temp dir)")
    p.add_argument("--peer-timeout", type=float, default=420.0, help="seconds llama-bench may run")
    p.add_argument("--peer-args", default="", help="more llama-bench flags, e.g. \"-ub 2048\" (one string)")
    p.add_argument("--draft", default=None, help="drafter for the speculative row (DFlash dir or draft model)")
    p.add_argument("--spec-method", default=None, choices=["dflash", "draft_model", "ngram"],
                   help="speculative method (default: dflash with --draft; ngram needs no --draft)")
    p.add_argument("--spec-tokens", type=int, default=None, help="draft tokens per step (default: the method's)")
    add_run_flags(p)


def default_args(**overrides) -> argparse.Namespace:
    """The CLI's defaults as a namespace, for calling `run` from Python."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    if set(overrides) - set(vars(p.parse_args([]))):
        raise RequestError(f"unknown bench speed option(s): {sorted(set(overrides) - set(vars(p.parse_args([]))))}")
    return argparse.Namespace(**{**vars(p.parse_args([])), **overrides})


def _say(text: str) -> None:
    print(f"[bench speed] {text}", file=sys.stderr, flush=True)


class Clock:
    """Host time stamps taken after torch.cuda.synchronize, so queued GPU work is counted."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def per_call(self, fn, calls: int, rounds: int = 5) -> float:
        """Median over rounds of the mean time of `calls` back-to-back calls (one sync per round,
        so a short kernel is not dwarfed by the sync), after one untimed round."""
        times = []
        for r in range(rounds + 1):
            start = self.now()
            for _ in range(calls):
                fn()
            if r:
                times.append((self.now() - start) / calls)
        return statistics.median(times)


def reference(device: torch.device, clock: Clock) -> dict:
    """Device limits measured now: bandwidth of a GEMV far larger than any cache, matmul TFLOP/s."""
    cuda = device.type == "cuda"
    rows, cols, n = (32768, 16384, 8192) if cuda else (2048, 2048, 512)  # CPU: small, so tests stay fast
    dtype = torch.bfloat16 if cuda else torch.float32
    w, x = torch.randn(rows, cols, device=device, dtype=dtype), torch.randn(1, cols, device=device, dtype=dtype)
    gemv = clock.per_call(lambda: F.linear(x, w), 20 if cuda else 3)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    w = x = None  # the 1 GiB matrix goes before the timing of the matmul
    matmul = clock.per_call(lambda: a @ b, 10 if cuda else 2)
    a = b = None
    torch.cuda.empty_cache()  # a no-op without CUDA
    size = torch.empty(0, dtype=dtype).element_size()
    return {"dtype": str(dtype).removeprefix("torch."), "gemv_shape": [rows, cols], "matmul_shape": [n, n, n],
            "gemv_gb_s": (rows * cols + rows + cols) * size / gemv / 1e9, "matmul_tflops": 2 * n ** 3 / matmul / 1e12}


def _lengths(given, name: str, limit: int, fits, notes: list[str]) -> list[int]:
    """Requested lengths must fit (an error says which does not); defaults that do not are dropped."""
    for n in given or ():
        if n < 1 or not fits(n):
            raise RequestError(f"--{name} {n} does not fit: lengths are positive and at most the model's {limit} "
                               f"positions less --decode-tokens and {VERIFY_TOKENS} verify tokens, with memory "
                               f"for their KV cache")
    if given:
        return sorted(set(given))
    kept = [n for n in DEFAULT_LENS if fits(n)]
    if len(kept) < len(DEFAULT_LENS):
        notes.append(f"{name}: skipped {[n for n in DEFAULT_LENS if n not in kept]} (beyond the model's "
                     f"{limit} positions or the device's free memory)")
    return kept


def timed_request(engine: LLMEngine, clock: Clock, prompt: list[int],
             max_tokens: int) -> tuple[float, tuple[float, float], list[int], int]:
    """One greedy request to the end: (time to first token, (start, end) stamps of the remaining tokens,
    output ids, KV bytes the sequence held after its prompt, every KV cache group; read between the two)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start, out = clock.now(), None
    engine.add_request("bench", {"prompt_token_ids": prompt}, params)
    while out is None:
        out = next(iter(engine.step()), None)
    first = clock.now()
    held = kv_tables.held_kv_bytes(engine)
    resume = clock.now()
    while engine.has_unfinished():
        out = next(iter(engine.step()), out)
    return first - start, (resume, clock.now()), out.outputs[0].token_ids, held


def _graph_replays(engine: LLMEngine) -> int | None:
    """Steps the runner replayed through CUDA graphs so far (None: it keeps no graphs, e.g. on CPU)."""
    graphs = getattr(engine.runner, "graphs", None)
    return sum(graphs.replays.values()) if graphs is not None else None


def _bandwidth_row(row: dict, ref: dict | None) -> dict:
    row["ms_per_token"] = 1e3 / row["tok_s"]
    row["gb_s"] = row["bytes_per_token"] * row["tok_s"] / 1e9
    if ref:
        row["pct_bandwidth"] = 100 * row["gb_s"] / ref["gemv_gb_s"]
    return row


def engine_phase(engine, loaded, args, prompt_lens, contexts, kv: int, ref, clock, rng,
                 meter=None) -> tuple[list, list, dict]:
    """Prefill and decode through the engine. Returns the rows and, per length, its last (prompt, output);
    with a power meter (bench/energy.py) running, decode rows carry the joules of their timed decode."""
    wbytes = limits.weight_bytes_per_token(loaded.model)
    state = limits.state_bytes_per_token(loaded.model)
    specs = loaded.model.cache_specs(args.cache_type_k, args.cache_type_v)
    prefill, decode, last = [], [], {}
    for length in sorted(set(prompt_lens) | set(contexts)):
        runs = []
        for r in range(args.repeats + 1):  # run 0 warms up the kernels for this length's shapes
            prompt = [rng.randrange(loaded.config.vocab_size) for _ in range(length)]
            ttft, (t0, t1), ids, held = timed_request(engine, clock, prompt,
                                                 1 + args.decode_tokens if length in contexts else 1)
            joules = meter.joules(t0, t1) if meter and length in contexts else None
            runs += [(ttft, t1 - t0, joules)] if r else []
        last[length] = (prompt, ids)
        if length in prompt_lens:
            ttft, flops = statistics.median(t for t, _, _ in runs), limits.prefill_flops(loaded.config, length)
            row = {"prompt_len": length, "ttft_s": ttft, "tok_s": length / ttft, "flops": flops,
                   "tflops": flops / ttft / 1e12}
            prefill.append(dict(row, pct_matmul=100 * row["tflops"] / ref["matmul_tflops"]) if ref else row)
            _say(f"prefill {length}: {row['tok_s']:,.0f} tok/s, TTFT {1e3 * ttft:.1f} ms")
        if length in contexts:
            seconds = statistics.median(s for _, s, _ in runs)
            # Decode step i (1..n) reads the KV of length + i positions: length + (n + 1)/2 on average
            # (a sliding-window layer at most its window).
            kv_read = limits.kv_read_bytes(specs, length + (args.decode_tokens + 1) / 2)
            decode.append(_bandwidth_row({"context": length, "tokens": args.decode_tokens,
                                          "tok_s": args.decode_tokens / seconds, "weight_bytes_per_token": wbytes,
                                          "state_bytes_per_token": state, "kv_bytes_per_token": kv,
                                          "kv_read_bytes": kv_read, "kv_held_bytes": held,
                                          "bytes_per_token": wbytes + state + kv_read}, ref))
            if meter:  # the median over runs of each decode's joules; the board's counter too, where kept
                decode[-1]["joules_per_token"] = statistics.median(j["joules"] for *_, j in runs) / args.decode_tokens
                counted = [j["counter_joules"] for *_, j in runs if j["counter_joules"] is not None]
                decode[-1]["counter_joules_per_token"] = (statistics.median(counted) / args.decode_tokens
                                                          if counted else None)
            _say(f"decode at {length}: {decode[-1]['tok_s']:,.1f} tok/s, KV held {held / 2**20:,.1f} MiB")
    return prefill, decode, last


def verify_phase(loaded, args, context: int, kv: int, ref, clock) -> dict:
    """The runner's forward alone at `context`: one token vs VERIFY_TOKENS tokens with all their logits
    (what a verify step computes). Its engine has an n-gram speculator (never consulted here) so that,
    like a speculating engine, it keeps CUDA-graph buckets for verify steps too. The K/V read is
    whatever the pool holds: the timing does not depend on it."""
    spec = {"method": "ngram", "num_speculative_tokens": VERIFY_TOKENS - 1, "adaptive": False}
    row_len = max([VERIFY_TOKENS, *(n + 1 for n in args.tree_nodes)])
    engine = LLMEngine.from_args(engine_args(args, context + 2 * row_len, loaded, speculative_config=spec), loaded)
    tables = kv_tables.allocate(engine, context + row_len, context)
    calls = 4 * args.repeats
    try:
        one = clock.per_call(bare_forward(engine.runner, [1], context, *tables), calls)
        many = clock.per_call(bare_forward(engine.runner, list(range(1, VERIFY_TOKENS + 1)), context, *tables), calls)
        trees = tree_verify.tree_rows(engine.runner, args.tree_nodes, context, tables, one,
                                      lambda fn: clock.per_call(fn, calls))
    finally:
        kv_tables.free(engine, *tables)
    specs = loaded.model.cache_specs(args.cache_type_k, args.cache_type_v)
    per_token = (limits.weight_bytes_per_token(loaded.model) + limits.state_bytes_per_token(loaded.model)
                 + limits.kv_read_bytes(specs, context + 1))
    forward = _bandwidth_row({"context": context, "tok_s": 1 / one, "bytes_per_token": per_token}, ref)
    return {"context": context, "q_len": VERIFY_TOKENS, "decode_step_s": one, "verify_step_s": many,
            "ratio": many / one, "decode_forward": forward, "cuda_graph_replays": _graph_replays(engine),
            "trees": trees}


def bare_forward(runner, tokens: list[int], context: int, table: list[int], windows: list[list[int]]):
    """One bare forward of `tokens` after `context` cached positions, all their logits; `windows`: the
    tables of the window KV cache groups (kv_tables.allocate). A model with recurrent layers runs in
    state slot 0, and a multi-token forward as a verify row (its DeltaNet layers keep each position's
    state, as a speculating engine's verify does)."""
    rows = list(range(len(tokens))) if len(tokens) > 1 else None
    if not runner.recurrent_layers:
        return lambda: runner.forward([tokens], [context], [table], window_tables=[windows], logits_rows=rows)
    kind = RowKind.VERIFY if len(tokens) > 1 else RowKind.DECODE
    return lambda: runner.run(StepPlan([PlanRow(list(tokens), context, table, kind=kind, window_tables=windows)],
                                       logits_rows=rows, state_slots=[0]))


def spec_phase(loaded, args, rng) -> dict:
    """tau and speedup on the same prompts, plain then speculative, each engine built for them."""
    from .prompts import held_out_texts
    from .spec import decode_runs, median_of
    if loaded.format == "random":  # a random model's text means nothing: random ids (expect a low tau)
        prompts = [[rng.randrange(loaded.config.vocab_size) for _ in range(256)] for _ in range(4)]
    else:
        prompts = [loaded.tokenizer.encode(t, add_special_tokens=False) for t in held_out_texts(4, 600, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    config = {"method": args.spec_method or "dflash", **({"model": args.draft} if args.draft else {})}
    if args.spec_tokens:
        config["num_speculative_tokens"] = args.spec_tokens
    max_len = max(map(len, prompts)) + args.decode_tokens + 64

    def measure(**extra) -> dict:
        engine = LLMEngine.from_args(engine_args(args, max_len, loaded, **extra), loaded)
        decode_runs(engine, prompts[:1], params)  # warm-up
        return median_of([decode_runs(engine, prompts, params) for _ in range(args.repeats)])
    plain, spec = measure(), measure(kv_factor=4, speculative_config=config)
    return {"method": config["method"], "draft": args.draft, "prompts": len(prompts), "tau": spec["tau"],
            "acceptance": spec["acceptance"], "tok_s": spec["tok_s"], "plain_tok_s": plain["tok_s"],
            "speedup": spec["tok_s"] / plain["tok_s"]}


def engine_args(args, max_len: int, loaded, kv_factor: float = 1, kv_len: int | None = None, **extra) -> EngineArgs:
    """Batch 1, no prefix caching (every run must prefill), a KV pool of one context so the rest of the
    memory stays free (the peer needs it): sliding-window groups only their window (kv_tables.pool_bytes);
    kv_factor > 1 leaves room for a drafter's KV; kv_len: positions the pool holds (default max_len)."""
    specs = loaded.model.cache_specs(args.cache_type_k, args.cache_type_v)
    kv = kv_tables.pool_bytes(loaded.model, specs, kv_len or max_len, EngineArgs.block_size,
                              EngineArgs.max_num_batched_tokens)
    # the recurrent state of one sequence (hybrids) and a verify's per-position snapshots of it
    state = bytes_per_sequence(specs, 1 + VERIFY_TOKENS)
    return EngineArgs(model=loaded.source, max_model_len=max_len, max_num_seqs=1, enable_prefix_caching=False,
                      cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                      cuda_graphs=getattr(args, "cuda_graphs", None),
                      prefill_graphs=getattr(args, "prefill_graphs", EngineArgs.prefill_graphs),
                      async_decode=getattr(args, "async_decode", EngineArgs.async_decode),
                      kv_cache_memory=int(kv_factor * (kv + state)), **extra)


def run(args: argparse.Namespace) -> dict:
    skip = set(args.skip) | ({"peer"} if args.no_peer else set())
    if args.decode_tokens < 2 or args.repeats < 1:
        raise RequestError("--decode-tokens must be at least 2 and --repeats at least 1")
    device = resolve_device(args.device)
    clock, rng, notes = Clock(device), random.Random(args.seed), []
    result = dict(meta=shapes.run_metadata(args, device), model=None, reference=None, prefill=[], prefix=[],
                  decode=[], energy=None, verify=None, forced=None, spec=None, peer=None, peak_memory_bytes=None,
                  notes=notes)
    # The model first: a bad --model / --shape / --quant fails before anything is measured.
    loaded, quant = shapes.load_under_test(args.model, args.shape, args.quant, args.dtype, device, args.seed)
    _say(f"{loaded.source} on {result['meta']['device']}")
    if "reference" not in skip:
        ref = result["reference"] = reference(device, clock)
        _say(f"reference: GEMV {ref['gemv_gb_s']:,.0f} GB/s, matmul {ref['matmul_tflops']:,.1f} TFLOP/s")
    if device.type == "cuda":  # the peak starts from the weights, without the reference's buffers
        torch.cuda.reset_peak_memory_stats(device)
    kv = kv_bytes_per_token(loaded.model, args.cache_type_k, args.cache_type_v)
    unbounded = limits.kv_unbounded_bytes_per_token(loaded.model.cache_specs(args.cache_type_k, args.cache_type_v))
    result["model"] = dict(shapes.describe(loaded, quant), shape=args.shape, kv_bytes_per_token=kv,
                           kv_unbounded_bytes_per_token=unbounded,
                           kv_cache_types=[args.cache_type_k, args.cache_type_v])
    # Keep 4 GiB for activations and the peer's static cache; the rest may hold the KV of a context.
    free = torch.cuda.mem_get_info(device)[0] - (4 << 30) if device.type == "cuda" else float("inf")
    limit = loaded.config.max_position_embeddings
    specs = loaded.model.cache_specs(args.cache_type_k, args.cache_type_v)

    def fits(n: int) -> bool:  # the context, the decoded tokens and a verify step, their KV in free memory
        total = n + args.decode_tokens + VERIFY_TOKENS
        return total <= limit and kv_tables.pool_bytes(loaded.model, specs, total, EngineArgs.block_size,
                                                       EngineArgs.max_num_batched_tokens) < free
    longest_turn = max(args.prefix_lens, default=0) + 2 * max(args.suffix_lens) + 64  # prefix_engine's pool
    if min([*args.prefix_lens, *args.suffix_lens]) < 1 or (args.prefix_lens and longest_turn > limit):
        raise RequestError(f"--prefix-lens {args.prefix_lens} / --suffix-lens {args.suffix_lens} do not fit: lengths "
                           f"are positive and the longest prefix with two of the longest suffixes (and 64) fits the "
                           f"model's {limit} positions")
    prompt_lens = [] if "prefill" in skip else _lengths(args.prompt_lens, "prompt-lens", limit, fits, notes)
    contexts = [] if "decode" in skip else _lengths(args.contexts, "contexts", limit, fits, notes)
    longest = max([64, *prompt_lens, *contexts]) + args.decode_tokens + VERIFY_TOKENS
    engine = LLMEngine.from_args(engine_args(args, longest, loaded), loaded)
    timed_request(engine, clock, [1] * 32, 4)  # first-call costs (kernel compilation) stay out of every figure
    meter, why = energy.open_meter(device)
    result["energy"] = {"skipped": why} if why else {"source": "NVML power", "interval_s": energy.INTERVAL_S}
    with meter or contextlib.nullcontext():
        result["prefill"], result["decode"], last = engine_phase(engine, loaded, args, prompt_lens, contexts, kv,
                                                                 result["reference"], clock, rng, meter)
    result["model"]["cuda_graph_replays"] = _graph_replays(engine)  # how many engine steps replayed a graph
    at = 512 if 512 in contexts else min(contexts or [512])
    del engine  # each engine's runner installs its own KV caches in the model: this one is done
    if args.prefix_lens:
        result["prefix"] = prefix.prefix_phase(loaded, args, engine_args, clock, rng, _say)
    if "verify" not in skip:
        result["verify"] = verify_phase(loaded, args, at, kv, result["reference"], clock)
        _say(f"verify {VERIFY_TOKENS} tokens / decode step: {result['verify']['ratio']:.2f}x")
        if "forced" not in skip:
            prompt = [rng.randrange(loaded.config.vocab_size) for _ in range(at)]
            f = result["forced"] = forced_phase(loaded, args, engine_args, result["verify"], prompt,
                                                VERIFY_TOKENS - 1)
            _say(f"forced acceptance: tau {f['tau']:.2f}, {f['speedup']:.2f}x (bound {f['bound']:.2f}x)")
    if device.type == "cuda":  # lucebox's own peak: weights, the KV of the longest context, activations
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    if "peer" not in skip and args.peer == "transformers":
        result["peer"] = transformers_peer.peer_phase(loaded, quant, args, device, last, at, result["decode"],
                                                      clock, _say)
    if "spec" not in skip:
        result["spec"] = (spec_phase(loaded, args, rng) if args.draft or args.spec_method == "ngram"
                          else {"skipped": "no drafter: pass --draft PATH (or --spec-method ngram)"})
    if "peer" not in skip and args.peer == "llama.cpp":
        cfg, gguf = loaded.config, args.model if (args.model or "").endswith(".gguf") else None
        del loaded  # llama.cpp gets the whole device: lucebox's weights and caches go first
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["peer"] = llama_cpp.peer_phase(args, cfg, quant, gguf, result["prefill"], result["decode"], _say,
                                              result["prefix"])
        prefix.peer_ratios(result["prefix"], (result["peer"] or {}).get("prefix", []))
    notes += [f"{key}: {result[key]['skipped']}" for key in ("peer", "spec") if "skipped" in (result[key] or {})]
    return result


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        _say(f"wrote {args.json}")
    return 0
