"""`lucebox bench throughput`: batched decode throughput against the batch's limit, KV bytes per token,
prefix-cache hit rate.

Output tok/s at several concurrency levels (a checkpoint, or random weights of a named --shape / --quant
like `bench speed`), with its ratio to one sequence measured in the same run, and the limit of that batch
(bench/batch_limits.py): the weights read once a step plus every sequence's KV (and recurrent state) read a
step, at the GEMV bandwidth measured in the same run, or where lower (marked "compute") the step's rows at the
matmul rate measured in the same run. With --spec-method each level runs speculating too, on
the same prompts; `forced` drafts each sequence's own greedy continuation (bench/forced.py: every draft
accepted once the recording converges), what batched verification delivers whatever a drafter's quality.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..errors import RequestError
from ..model.cache_spec import kv_bytes_per_token
from ..model.kv_cache import CACHE_TYPES
from ..model.loader import resolve_device
from ..sampling import SamplingParams
from . import batch_limits, shapes
from .flags import add_model_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128], help="sequences decoded at once")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per sequence")
    p.add_argument("--spec-method", default=None, choices=["dflash", "draft_model", "ngram", "forced"],
                   help="also measure each level speculating (ngram and forced need no --draft; forced: drafts "
                        "of each sequence's recorded greedy continuation, all accepted)")
    p.add_argument("--draft", default=None, help="drafter of --spec-method dflash / draft_model")
    p.add_argument("--spec-tokens", type=int, default=None, help="draft tokens per step (default: the method's)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=EngineArgs.cuda_graph_max_batch,
                   help=EngineArgs.HELP["cuda_graph_max_batch"])
    p.add_argument("--no-reference", action="store_true", help="skip the GEMV bandwidth (and so the limits)")
    p.add_argument("--no-hit-rate", action="store_true", help="skip the multi-turn prefix-cache hit rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def _run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
               outputs: dict | None = None) -> tuple[int, float, int, int]:
    """(tokens decoded once every prompt was prefilled, their seconds, sequence-steps that produced them, draft
    tokens the requests verified); `outputs`, given, gets each prompt's (a tuple) greedy output."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    # Time decode only: run until every prompt is prefilled, then count the tokens produced after.
    start, before, done, advanced, drafts = None, 0, 0, 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        done += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        drafts += sum(o.metrics.num_draft_tokens for o in outs if o.finished and o.metrics)
        if outputs is not None:
            outputs.update((tuple(prompts[int(o.request_id[1:])]), list(o.outputs[0].token_ids))
                           for o in outs if o.finished)
        if start is not None:
            advanced += len(outs)  # sequences that advanced this step (speculating: by one token or more)
        elif all(s.num_computed >= len(s.prompt_token_ids) for s in engine.scheduler.running) \
                and not engine.scheduler.waiting:
            _sync(engine)
            start = time.perf_counter()
            before = done + sum(len(s.output_token_ids) for s in engine.scheduler.running)
    _sync(engine)
    return done - before, time.perf_counter() - start, advanced, drafts


def _sync(engine):
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def multi_turn_hit_rate(engine: LLMEngine, conversations: int, turns: int, rng: random.Random) -> float:
    """Conversations sharing a system prompt; each turn resends the whole history (as chat clients do)."""
    vocab = engine.model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(48)]
    histories = [list(system) for _ in range(conversations)]
    prompt_tokens = cached = 0
    for turn in range(turns):
        for c, history in enumerate(histories):
            history += [rng.randrange(vocab) for _ in range(rng.randint(8, 24))]  # the user's message
            engine.add_request(f"t{turn}-{c}", {"prompt_token_ids": list(history)},
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    c = int(out.request_id.split("-")[1])
                    histories[c] += out.outputs[0].token_ids
                    prompt_tokens += len(out.prompt_token_ids)
                    cached += out.num_cached_tokens
    return cached / prompt_tokens


def _engine(loaded, args, **extra) -> LLMEngine:
    return LLMEngine.from_args(EngineArgs(
        model=loaded.source, max_num_seqs=max(args.concurrency), max_model_len=args.prompt_len + args.output_len + 64,
        enable_prefix_caching=False, cuda_graph_max_batch=args.cuda_graph_max_batch, **extra), loaded)


def _measure(engine: LLMEngine, prompts: list[list[int]], args, outputs: dict | None = None) -> dict:
    _run_batch(engine, prompts, 4)  # warm-up: this batch size's shapes compiled, its graphs captured
    tokens, seconds, advanced, drafts = _run_batch(engine, prompts, args.output_len, outputs)
    # rows a step computes: one a sequence plus its drafts (drafted only after its prompt: all in the timing)
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "tokens_per_sequence_step": tokens / advanced if advanced else None,
            "tokens_per_row": tokens / (advanced + drafts) if advanced else None}


def _measure_forced(engine: LLMEngine, prompts: list[list[int]], args, recorded: dict) -> dict:
    """_measure with every sequence drafting its recorded greedy continuation, re-recorded from the
    speculating engine's own output until a run reproduces it (a batched verify rounds differently from
    a decode step, so near-ties of random weights can flip; bench/forced.py)."""
    from .forced import MAX_RERECORDINGS, RecordedContinuationProposer
    engine.speculator.proposer = RecordedContinuationProposer(recorded)
    rerecorded = 0
    while True:
        outputs = {}
        _run_batch(engine, prompts, args.output_len, outputs)
        converged = all(outputs[tuple(p)] == recorded[tuple(p)] for p in prompts)
        if converged or rerecorded == MAX_RERECORDINGS:
            break
        recorded.update(outputs)
        rerecorded += 1
    return dict(_measure(engine, prompts, args), rerecorded=rerecorded, converged=converged)


def _spec_config(args) -> dict | None:
    if args.spec_method is None:
        return None
    if args.spec_method == "forced":  # an n-gram speculator of the right length, its proposer swapped
        return {"method": "ngram", "num_speculative_tokens": args.spec_tokens or 4, "adaptive": False}
    if args.spec_method != "ngram" and not args.draft:
        raise RequestError(f"--spec-method {args.spec_method} needs --draft")
    config = {"method": args.spec_method, **({"model": args.draft} if args.draft else {})}
    return dict(config, num_speculative_tokens=args.spec_tokens) if args.spec_tokens else config


def run(args) -> dict:
    if min(args.concurrency) < 1 or args.prompt_len < 1 or args.output_len < 2:
        raise RequestError("--concurrency values and --prompt-len must be positive, --output-len at least 2")
    spec = _spec_config(args)
    device = resolve_device(args.device)
    loaded, quant = shapes.load_under_test(args.model, args.shape, args.quant, args.dtype, device, args.seed)
    from .speed import Clock, reference
    ref = None if args.no_reference else reference(device, Clock(device))
    rng = random.Random(args.seed)
    vocab, forced = loaded.config.vocab_size, args.spec_method == "forced"
    batches = [[[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(n)] for n in args.concurrency]
    rows, recorded = [], {}
    engine = _engine(loaded, args)
    for n, prompts in zip(args.concurrency, batches):
        rows.append(dict(_measure(engine, prompts, args, recorded if forced else None), concurrency=n, spec=None))
    del engine  # the next engine installs its own KV caches in the model
    if spec is not None:
        engine = _engine(loaded, args, speculative_config=spec)
        for row, prompts in zip(rows, batches):
            row["spec"] = (_measure_forced(engine, prompts, args, recorded) if forced
                           else _measure(engine, prompts, args))
            row["spec"]["ratio_to_plain"] = row["spec"]["tok_s"] / row["tok_s"]
        del engine
    base = rows[0]["tok_s"]
    for row in rows:
        row["ratio_to_1"] = row["tok_s"] / base
        row.update(batch_limits.limit(loaded.model, row["concurrency"], args.prompt_len, args.output_len, ref))
        if ref is None:
            continue
        bandwidth = row["bandwidth_limit_tok_s"]
        row.update(batch_limits.bound(bandwidth, loaded.model, row["mean_context"], 1.0, ref))
        row["pct_limit"] = 100 * row["tok_s"] / row["limit_tok_s"]
        spec_row = row["spec"]
        if spec_row and spec_row["tokens_per_sequence_step"]:
            # a verify step reads what a decode step reads and commits tau tokens a sequence; its rows cost compute
            spec_row.update(batch_limits.bound(spec_row["tokens_per_sequence_step"] * bandwidth, loaded.model,
                                               row["mean_context"], spec_row["tokens_per_row"], ref))
            spec_row["pct_limit"] = 100 * spec_row["tok_s"] / spec_row["limit_tok_s"]
    cfg, dtype = loaded.config, loaded.model.dtype
    kv = {t: kv_bytes_per_token(loaded.model, t, t) for t in CACHE_TYPES[1:] if _supported(t, cfg.head_dim)}
    hit = None
    if not args.no_hit_rate:
        cached_engine = LLMEngine.from_args(EngineArgs(model=loaded.source, max_model_len=2048), loaded)
        hit = multi_turn_hit_rate(cached_engine, conversations=8, turns=4, rng=rng)
    return {"model": loaded.source, "shape": args.shape, "quant": quant, "device": str(loaded.model.device),
            "dtype": str(dtype).replace("torch.", ""), "meta": shapes.run_metadata(args, device), "reference": ref,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "spec_config": spec,
            "spec_method": args.spec_method, "throughput": rows,
            "kv_bytes_per_token": kv, "multi_turn_prefix_hit_rate": hit}


def _supported(cache_type: str, head_dim: int) -> bool:
    return cache_type not in ("q8_0", "q4_0") or head_dim % 32 == 0


_BOUND = {"bandwidth": "", "compute": " (compute)"}  # which limit binds, as the table marks it


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def print_report(result: dict) -> None:
    ref = result["reference"]
    quant = "" if result["quant"] in result["model"] else f" ({result['quant']})"
    print(f"model {result['model']}{quant} on {result['device']} ({result['dtype']}), prompt "
          f"{result['prompt_len']} tokens, {result['output_len']} output tokens per sequence"
          + (f"; GEMV bandwidth {_fmt(ref['gemv_gb_s'])} GB/s" if ref else "") + "\n")
    spec = result["spec_config"]
    method = result.get("spec_method") or (spec or {}).get("method")
    print("| concurrent sequences | output tok/s | ratio to 1 | GB a step (weights + KV) | limit tok/s | % of limit |"
          + (f" speculative ({method}) tok/s | x plain | tokens a sequence-step | its limit tok/s | % of it |"
             if spec else "")
          + "\n|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|---:|" if spec else ""))
    for row in result["throughput"]:
        limit = (f"{_fmt(row['limit_tok_s'])}{_BOUND[row['limit_bound']]} | {row['pct_limit']:.1f}%"
                 if "limit_tok_s" in row else "- | -")
        line = (f"| {row['concurrency']} | {_fmt(row['tok_s'])} | {row['ratio_to_1']:.2f}x | "
                f"{_fmt(row['weight_bytes_per_step'] / 1e9)} + {_fmt(row['kv_bytes_per_step'] / 1e9)} | {limit} |")
        if row["spec"]:
            s = row["spec"]
            converged = "" if s.get("converged", True) else " (recording not reproduced)"
            tau = f"{s['tokens_per_sequence_step'] or 0:.2f}{converged}"
            limit = (f"{_fmt(s['limit_tok_s'])}{_BOUND[s['limit_bound']]} | {s['pct_limit']:.1f}%" if "pct_limit" in s
                     else "- | -")
            line += f" {_fmt(s['tok_s'])} | {s['ratio_to_plain']:.2f}x | {tau} | {limit} |"
        print(line)
    print("\n| KV cache type (K and V) | bytes per token |\n|---|---:|")
    for name, size in result["kv_bytes_per_token"].items():
        print(f"| {name} | {size:,.0f} |")
    if result["multi_turn_prefix_hit_rate"] is not None:
        print(f"\nprefix-cache hit rate, 8 conversations x 4 turns sharing a system prompt: "
              f"{100 * result['multi_turn_prefix_hit_rate']:.1f}% of prompt tokens")


def main(args) -> int:
    result = run(args)
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0
