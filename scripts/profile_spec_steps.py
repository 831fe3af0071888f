#!/usr/bin/env python
"""Host time per section of an engine step, plain vs speculative engines on the bundled pair.

    python scripts/profile_spec_steps.py [--draft models/default-dflash] [--prompts 8]

Each engine (plain, dflash, ngram) decodes the held-out prompts on its own, twice per temperature
(the second pass is the steady state: graphs captured, policy tables settled); the sections are
timed with perf_counter wrappers (no profiler overhead) and printed in microseconds per generated
token. For the question `lucebox bench spec` cannot answer: where a speculative engine's plain
steps spend the time that the plain engine does not. `--trace plain:1` (engine:temperature) then
decodes two prompts under torch.profiler and prints the top operators by host and device time.
`--idle-overhead` instead measures a DFlash engine that never drafts against plain decoding, with
its taps and dormant, beside a second plain engine (the control). `--step-costs` instead times one
graph step of each verify width (the buckets of a 15-draft speculator): returning argmax tokens or
logits, or sampling and accepting in the graph (the Triton sampler against the torch reference).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lucebox.bench.prompts import held_out_texts  # noqa: E402
from lucebox.bench.spec import decode_one  # noqa: E402
from lucebox.config import EngineArgs  # noqa: E402
from lucebox.engine.commit import StepCommitter  # noqa: E402
from lucebox.engine.engine import LLMEngine  # noqa: E402
from lucebox.engine.output_processor import OutputProcessor  # noqa: E402
from lucebox.engine.runner import ModelRunner  # noqa: E402
from lucebox.engine.step_plan import StepPlan  # noqa: E402
from lucebox.model.cache_spec import kv_bytes_per_token  # noqa: E402
from lucebox.model.loader import load_model  # noqa: E402
from lucebox.sampling import SamplingParams  # noqa: E402
from lucebox.sampling.graph_rows import graph_row  # noqa: E402
from lucebox.sampling.sampler import Sampler  # noqa: E402
from lucebox.spec.dflash import DFlashProposer  # noqa: E402
from lucebox.spec.speculator import Speculator  # noqa: E402

SECTIONS = [(LLMEngine, "step"), (ModelRunner, "run"), (Sampler, "__call__"), (StepCommitter, "commit"),
            (OutputProcessor, "verdicts"), (OutputProcessor, "append"), (Speculator, "choose"),
            (Speculator, "propose"), (Speculator, "record_step"), (DFlashProposer, "propose"),
            (DFlashProposer, "_project"), (DFlashProposer, "_draft_logits"), (OutputProcessor, "collect")]


def instrument(totals: collections.Counter, widths: collections.defaultdict) -> None:
    """Time each section into totals; ModelRunner.run also by step width (tokens forwarded) into
    widths[width] = [calls, seconds], which splits a speculative engine's plain and verify steps."""
    for owner, name in SECTIONS:
        real = getattr(owner, name)

        def timed(*args, _real=real, _label=f"{owner.__name__}.{name}", **kwargs):
            started = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - started
                totals[_label] += seconds
                if _label == "ModelRunner.run":
                    entry = widths[args[1].total_tokens]
                    entry[0] += 1
                    entry[1] += seconds
        setattr(owner, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/default")
    p.add_argument("--draft", default="models/default-dflash")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--trace", action="append", default=[], metavar="ENGINE:T",
                   help="profile that engine at that temperature with torch.profiler (repeatable)")
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--step-costs", action="store_true", help="only time graph steps by width and output")
    p.add_argument("--idle-overhead", action="store_true",
                   help="only the cost of a DFlash engine that never drafts, against plain decoding")
    args = p.parse_args()
    if args.step_costs:
        return step_costs(load_model(args.model, dtype="auto", device="auto"))
    if args.idle_overhead:
        return idle_overhead(load_model(args.model, dtype="auto", device="auto"), args)
    totals: collections.Counter = collections.Counter()
    widths: collections.defaultdict = collections.defaultdict(lambda: [0, 0.0])
    instrument(totals, widths)
    loaded = load_model(args.model, dtype="auto", device="auto")
    prompts = [loaded.tokenizer.encode(t, add_special_tokens=False) for t in held_out_texts(args.prompts, 600, seed=1)]
    max_len = max(map(len, prompts)) + args.max_tokens + 32
    kv = 4 * kv_bytes_per_token(loaded.model, "auto", "auto") * ((-(-max_len // 16) + 2) * 16)
    configs = {"plain": None, "dflash": {"method": "dflash", "model": args.draft}, "ngram": {"method": "ngram"}}
    engines = {name: LLMEngine.from_args(EngineArgs(model=args.model, max_model_len=max_len, max_num_seqs=1,
                                                    kv_cache_memory=kv, speculative_config=config), loaded)
               for name, config in configs.items()}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True)
        for engine in engines.values():
            decode_one(engine, prompts[0], params, "warm-up")
        for rep in range(2):
            for name, engine in engines.items():
                totals.clear()
                widths.clear()
                runs = [decode_one(engine, prompt, params, f"p{i}") for i, prompt in enumerate(prompts)]
                tokens = sum(r["tokens"] for r in runs)
                per_token = sum(r["seconds"] for r in runs) / tokens
                parts = "  ".join(f"{label}={seconds / tokens * 1e6:.0f}" for label, seconds in sorted(totals.items()))
                print(f"T={temperature:g} pass {rep} {name:6s} {per_token * 1e3:.3f} ms/token, "
                      f"{sum(r['draft_tokens'] for r in runs)} draft tokens, {graphs(engine)} graphs | "
                      f"us/token: {parts}", flush=True)
                steps = "  ".join(f"{w}: {n} x {seconds / n * 1e6:.0f}" for w, (n, seconds) in sorted(widths.items())
                                  if w <= 64)  # decode and verify widths, not prefills
                print(f"T={temperature:g} pass {rep} {name:6s} runner steps by width (calls x us): {steps}", flush=True)
    for spec in args.trace:
        name, temperature = spec.split(":")
        trace(engines[name], prompts[:2], SamplingParams(temperature=float(temperature), max_tokens=args.max_tokens,
                                                         ignore_eos=True), args.rows, spec)


def idle_overhead(loaded, args, repeats: int = 5) -> None:
    """What a DFlash engine costs when it never drafts (its policy forced to k = 0, and to say so
    ahead, as between probes), against plain decoding, interleaved prompt by prompt: with its taps
    (every step capturing them, as before dormancy: no overlapped steps), and dormant (no taps, steps
    overlapped like plain ones; what is left is the speculator's host time).
    Per temperature, the median over repeats of each repeat's ratio of seconds per token to
    plain's, and per engine the host sections' time per generated token (perf_counter wrappers,
    the same on every engine)."""
    from lucebox.spec.adaptive import DraftLengthPolicy
    from lucebox.spec.speculator import Speculator
    prompts = [loaded.tokenizer.encode(t, add_special_tokens=False) for t in held_out_texts(args.prompts, 600, seed=1)]
    max_len = max(map(len, prompts)) + args.max_tokens + 32
    kv = 4 * kv_bytes_per_token(loaded.model, "auto", "auto") * ((-(-max_len // 16) + 2) * 16)
    Speculator._choose = lambda self, *a: 0  # never drafts
    DraftLengthPolicy.plain_run = lambda self: 1 << 20  # and promises so ahead
    totals: collections.Counter = collections.Counter()
    instrument(totals, collections.defaultdict(lambda: [0, 0.0]))
    dflash = {"method": "dflash", "model": args.draft}
    # "plain again": the control, a second plain engine (what a ratio shows when nothing differs).
    names = ("plain", "plain again", "idle dflash, taps", "idle dflash, dormant")
    engines = {name: LLMEngine.from_args(EngineArgs(model=args.model, max_model_len=max_len, max_num_seqs=1,
                                                    kv_cache_memory=kv,
                                                    speculative_config=None if name.startswith("plain") else dflash),
                                    loaded)
               for name in names}
    engines["idle dflash, taps"].speculator.taps_needed = lambda: True
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                output_kind="final_only")
        for engine in engines.values():  # warm-up (the tap-less engine captures its graphs here)
            for prompt in prompts[:2]:
                decode_one(engine, prompt, params, "warm-up")
        ratios = collections.defaultdict(list)
        sections = {name: collections.Counter() for name in engines}
        tokens = collections.Counter()
        for rep in range(repeats):
            per_token = collections.defaultdict(float)
            for i, prompt in enumerate(prompts):
                turn = (rep + i) % len(names)
                for name in names[turn:] + names[:turn]:
                    totals.clear()
                    run = decode_one(engines[name], prompt, params, f"r{rep}p{i}")
                    per_token[name] += run["seconds"] / run["tokens"] / len(prompts)
                    sections[name].update(totals)
                    tokens[name] += run["tokens"]
            for name in engines:
                ratios[name].append(per_token["plain"] / per_token[name])
        for name, values in ratios.items():
            values.sort()
            parts = "  ".join(f"{label}={seconds / tokens[name] * 1e6:.1f}"
                              for label, seconds in sorted(sections[name].items()))
            print(f"T={temperature:g} {name}: {values[len(values) // 2]:.3f}x plain "
                  f"({values[0]:.3f}-{values[-1]:.3f}) | us/token: {parts}", flush=True)


def step_costs(loaded, steps: int = 200) -> None:
    """Microseconds per ModelRunner.run of one sequence at context 256, by query length (every
    verify bucket of a 15-draft speculator) and by what comes back: argmax tokens, the logits
    (copied to the host, as a sampler would wait for them), or the verdict of sampling and
    accepting in the graph (temperature 1 alone, and with top-p 0.95) -- by the Triton sampler and
    by the torch reference (a second engine, captured with the reference)."""
    import torch

    from lucebox.sampling import acceptance

    vocab = loaded.config.vocab_size
    plain, top_p = (graph_row(SamplingParams(temperature=1.0, **f), vocab) for f in ({}, {"top_p": 0.95}))
    columns = {"argmax": dict(argmax=True), "logits": {},
               "T=1": dict(sample=[plain]), "top-p": dict(sample=[top_p])}
    tables = {}
    for sampler in ("triton", "torch"):
        if sampler == "torch":
            acceptance.use_triton = lambda *tensors: False  # captures from here on take the reference
            columns = {k: v for k, v in columns.items() if "sample" in v}
        # A KV budget of its own: the model keeps the first engine's caches, so planning from the
        # GPU's free memory would leave the second engine nothing.
        engine = LLMEngine.from_args(EngineArgs(model="step-costs", max_model_len=1024, max_num_seqs=1,
                                                kv_cache_memory=kv_bytes_per_token(loaded.model, "auto", "auto") * 4096,
                                                speculative_config={"method": "ngram",
                                                                    "num_speculative_tokens": 15}), loaded)
        runner = engine.runner
        if runner.graphs is None:
            print("no CUDA graphs on this device: nothing to time")
            return
        table = list(range(1024 // engine.args.block_size))  # no sequence lives in this engine: any blocks do
        for q in runner.graphs.query_lens:
            tokens = [[5] * q]
            for name, kwargs in columns.items():
                def one():
                    out = runner.run(StepPlan.forward(tokens, [256], [table], logits_rows=list(range(q)), **kwargs))
                    return out.logits.tolist() if out.logits is not None else out.tokens or out.verdicts
                for _ in range(10):
                    one()
                if loaded.model.device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(steps):
                    one()
                label = name if "sample" not in kwargs else f"{name} {sampler}"
                tables.setdefault(q, {})[label] = f"{1e6 * (time.perf_counter() - started) / steps:.0f}"
    labels = list(next(iter(tables.values())))
    print("| query length | " + " | ".join(f"{label} us" for label in labels) + " |\n|---:|" + "---:|" * len(labels))
    for q, cells in tables.items():
        print(f"| {q} | " + " | ".join(cells[label] for label in labels) + " |", flush=True)


def graphs(engine: LLMEngine) -> int:
    """CUDA graphs captured so far (target and drafter): a count that grows between passes means
    captures inside the timed decoding."""
    proposer = engine.speculator.proposer if engine.speculator else None
    drafter = getattr(proposer, "graphs", None)
    runner = engine.runner.graphs
    return (len(runner.graphs) if runner else 0) + (len(drafter.graphs) if drafter else 0)


def trace(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, rows: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.model.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        tokens = sum(decode_one(engine, p, params, f"trace{i}")["tokens"] for i, p in enumerate(prompts))
    events = prof.key_averages()
    print(f"\n{label}: {tokens} tokens under torch.profiler; top operators by host time:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50))
    if engine.model.device.type == "cuda":
        print(f"{label}: top by device time:")
        print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
