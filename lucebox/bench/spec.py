"""`lucebox bench spec`: tau, tok/s and speedup over plain decoding, measured in the same run.

Each proposer runs the same fixed prompt set (held-out standard-library source) one request at a
time (batch 1, the latency case speculation is for), at temperature 0 and 1, next to plain
decoding of the same prompts on the same loaded target; configurations are interleaved prompt by
prompt and repeated: the median run is reported, and the speedup as the median over repeats of
each repeat's ratio to plain decoding in the same pass, with its range over the repeats.
Per request too, as the bound on speculation is stated (a request never more than 5% slower than
plain decoding): each request's tok/s against the control's (a second plain engine) on the same
prompt in the same pass, the median over every prompt and repeat with a bootstrap 95% interval --
paired request by request, so it resolves what the repeats' totals (a few of them, each carrying
the host's noise) cannot.
"""
from __future__ import annotations

import gc
import json
import random
import statistics

import torch

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..model.cache_spec import kv_bytes_per_token
from ..model.loader import load_model
from ..sampling import SamplingParams
from .prompts import held_out_texts


def decode_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str) -> dict:
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    # Time from the first token on: prefill is the same with and without speculation.
    m = out.metrics
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    return {"tokens": len(out.outputs[0].token_ids) - 1, "seconds": m.finished_time - m.first_token_time,
            "draft_tokens": m.num_draft_tokens, "accepted_tokens": m.num_accepted_tokens, "steps": m.num_drafts}


def _totals(parts: list[dict]) -> dict:
    t = {key: sum(p[key] for p in parts) for key in ("tokens", "seconds", "draft_tokens", "accepted_tokens", "steps")}
    steps, drafts = t.pop("steps"), t["draft_tokens"]
    return dict(t, tok_s=t["tokens"] / t["seconds"], tau=(t["accepted_tokens"] + steps) / steps if steps else 1.0,
                acceptance=t["accepted_tokens"] / drafts if drafts else 0.0)


def decode_runs(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    return _totals([decode_one(engine, p, params, f"s{i}") for i, p in enumerate(prompts)])


def verify_costs(engine: LLMEngine) -> dict[int, float]:
    """The engine step's measured cost by the tokens in it (batch 1: the pending token and the drafts,
    or a tree's nodes), over a plain step's: the verify cost per node count (the adaptive policy's
    table, drafting excluded; settled sizes only)."""
    spec = engine.speculator
    table = spec.policy.forward if spec is not None else None
    plain = table.values.get(1) if table is not None else None
    if not plain:
        return {}
    return {n: seconds / plain for n, seconds in sorted(table.values.items()) if n > 1 and table.settled(n)}


def _spec_config(config: dict, args) -> dict:
    spec = dict(config, adaptive=not args.no_adaptive)
    if args.spec_tokens:
        spec["num_speculative_tokens"] = args.spec_tokens
    return spec


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median and its bootstrap 95% interval (NaNs with no values)."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return statistics.median(values), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def median_of(results: list[dict]) -> dict:
    """The run with the median tok/s (tau and counts come from that same run)."""
    return sorted(results, key=lambda r: r["tok_s"])[len(results) // 2]


def run(args) -> dict:
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    torch.manual_seed(0)
    texts = held_out_texts(args.prompts, args.chars, seed=1)
    prompts = [loaded.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    max_len = max(map(len, prompts)) + args.max_tokens + 32
    methods = []
    if args.draft:
        methods.append({"method": args.spec_method, "model": args.draft})
        methods.append({"method": args.spec_method, "model": args.draft, "ngram_first": True})
        for budget in getattr(args, "tree_budget", None) or ():  # dflash draft trees beside the chain
            methods.append({"method": args.spec_method, "model": args.draft, "tree_budget": budget})
    methods.append({"method": "ngram"})
    rows = []
    for temperature in args.temperatures:
        # Unseeded, as most requests come: a seeded one keeps its own generator and samples outside
        # the CUDA graphs. The global generator is seeded once per run instead.
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                output_kind="final_only")  # as LLM.generate asks
        # "plain again": a second plain engine, the control -- what a configuration's ratio shows
        # when nothing differs but the engine (the run's noise and bias, against which the bound of
        # 5% that speculation may cost is judged).
        configs = [("plain", None), ("plain again", None)] + [
            (c["method"] + ("+ngram" if c.get("ngram_first") else "")
             + (f"+tree{c['tree_budget']}" if c.get("tree_budget") else ""), _spec_config(c, args)) for c in methods]
        # All engines live at once, each with the KV of one sequence (and room for a drafter's):
        # a share of the whole GPU each would leave the later ones nothing.
        tokens = (-(-max_len // EngineArgs.block_size) + 2) * EngineArgs.block_size
        kv_memory = 4 * kv_bytes_per_token(loaded.model, "auto", "auto") * tokens
        engines = [(name, LLMEngine.from_args(EngineArgs(model=args.model, max_model_len=max_len, max_num_seqs=1,
                                                         kv_cache_memory=kv_memory, speculative_config=spec,
                                                         async_decode=args.async_decode), loaded))
                   for name, spec in configs]
        for _, engine in engines:
            decode_runs(engine, prompts[:1], params)  # warm-up
            engine.step_counts.clear()
        gc.collect()
        gc.freeze()  # as `lucebox serve` does: no full collection stalls one configuration's steps
        runs: dict[str, list[dict]] = {name: [] for name, _ in engines}
        per_request: dict[str, list[float]] = {name: [] for name, _ in engines}  # tok/s over the control's
        # Interleaved prompt by prompt (the order rotating), repeated: the machine's drift hits all
        # configurations alike, even when it changes within one pass over the prompts.
        for r in range(args.repeats):
            parts: dict[str, list[dict]] = {name: [] for name, _ in engines}
            for i, prompt in enumerate(prompts):
                turn = (r + i) % len(engines)
                for name, engine in engines[turn:] + engines[:turn]:
                    parts[name].append(decode_one(engine, prompt, params, f"r{r}p{i}"))
            for name in runs:
                runs[name].append(_totals(parts[name]))
                per_request[name] += [(p["tokens"] / p["seconds"]) / (c["tokens"] / c["seconds"])
                                      for p, c in zip(parts[name], parts["plain again"])
                                      if min(p["tokens"], p["seconds"], c["tokens"], c["seconds"]) > 0]
        for name, _ in engines:
            # Paired by repeat: each repeat's ratio to plain decoding of the same prompts in the same
            # pass, so drift between passes cancels; the median ratio and the range over repeats.
            ratios = sorted(r["tok_s"] / p["tok_s"] for r, p in zip(runs[name], runs["plain"]))
            median, low, high = median_interval(per_request[name])
            rows.append({"method": name, "temperature": temperature, **median_of(runs[name]),
                         "speedup": ratios[len(ratios) // 2], "speedup_range": [ratios[0], ratios[-1]],
                         "per_request_vs_control": median, "per_request_interval": [low, high],
                         "repeats": args.repeats, "steps": dict(dict(engines)[name].step_counts),
                         "verify_cost": verify_costs(dict(engines)[name])})
        control = next(r["speedup"] for r in rows[-len(engines):] if r["method"] == "plain again")
        for r in rows[-len(engines):]:
            r["vs_control"] = r["speedup"] / control  # the speedup judged against the run's own noise
        gc.unfreeze()  # these engines can go
    return {"model": args.model, "draft": args.draft, "device": str(loaded.model.device),
            "prompts": args.prompts, "max_tokens": args.max_tokens, "rows": rows}


def main(args) -> int:
    result = run(args)
    print(f"target {result['model']} on {result['device']}; drafter {result['draft'] or '-'}; "
          f"{result['prompts']} held-out code prompts, {result['max_tokens']} tokens each, batch 1\n")
    print("| method | T | tau | acceptance | tok/s | speedup vs plain (range over repeats) | vs control | per request "
          "vs control (95% interval) | decode steps: verify / overlapped / in turn |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        plain = r["method"].startswith("plain")
        tau = f"{r['tau']:.2f}" if not plain else "-"
        acc = f"{100 * r['acceptance']:.0f}%" if not plain else "-"
        low, high = r["speedup_range"]
        spread = f" ({low:.2f}-{high:.2f})" if r["method"] != "plain" and r["repeats"] > 1 else ""
        steps = r["steps"]
        decode = sum(steps.get(k, 0) for k in ("verify", "overlapped", "plain")) or 1
        mix = " / ".join(f"{100 * steps.get(k, 0) / decode:.0f}%" for k in ("verify", "overlapped", "plain"))
        low, high = r["per_request_interval"]
        print(f"| {r['method']} | {r['temperature']:g} | {tau} | {acc} | {r['tok_s']:.1f} "
              f"| {r['speedup']:.2f}x{spread} | {r['vs_control']:.2f}x "
              f"| {r['per_request_vs_control']:.3f}x ({low:.3f}-{high:.3f}) | {mix} |")
    costs = [r for r in result["rows"] if r["verify_cost"]]
    if costs:
        print("\n| method | T | step cost by tokens verified (pending + drafts or tree nodes), x a plain step |\n"
              "|---|---:|---|")
        for r in costs:
            cells = ", ".join(f"{n}: {c:.2f}x" for n, c in r["verify_cost"].items())
            print(f"| {r['method']} | {r['temperature']:g} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
