"""`lucebox bench prefill`: time to first token of exact prefill against speculative prefill (PFlash) in
the same run, the latter split into scoring and target time. Random weights of named shapes (or
checkpoints); random prompts, which the scorer reads as token ids when both are random shapes (one
vocabulary), re-tokenised text otherwise. What it measures is speed, never quality: random weights
keep arbitrary chunks."""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..engine.pflash.score import SCORER_CHUNK
from ..errors import RequestError
from ..model.cache_spec import bytes_per_sequence, kv_groups, pools_bytes_wanted
from ..model.loader import load_model, resolve_device
from ..sampling import SamplingParams
from . import prefill_needle, shapes

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target checkpoint (default: --shape, else the default model)")
    p.add_argument("--shape", default=None,
                   help=f"target: random weights of a named shape ({', '.join(shapes.SHAPES)})")
    p.add_argument("--scorer", default=None, help="scorer: a named shape or a checkpoint (default: the target itself)")
    p.add_argument("--quant", default=None, help="weights of --shape (default bf16)")
    p.add_argument("--dtype", default="auto", help=EngineArgs.HELP["dtype"])
    p.add_argument("--device", default="auto", help=EngineArgs.HELP["device"])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[4096], help="prompt lengths in tokens")
    p.add_argument("--keep-ratio", type=float, nargs="+", default=[0.1, 0.2], help="keep ratios to time")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point (the median is reported)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help=EngineArgs.HELP["max_num_batched_tokens"])
    p.add_argument("--scorer-window", type=int, default=EngineArgs.prefill_scorer_window,
                   help=EngineArgs.HELP["prefill_scorer_window"])
    p.add_argument("--scorer-chunk", type=int, default=SCORER_CHUNK,
                   help="scorer prompt tokens a forward (a step, when interleaved with other requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--needle", action="store_true", help="report needle recall of the selection per keep ratio "
                                                         "instead of timing (real checkpoints: --model, --scorer)")


def first_token_seconds(engine: LLMEngine, prompt: dict, ids=itertools.count()) -> float:
    """Wall seconds from add_request to the first sampled token of one request alone."""
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    rid = f"prefill-bench-{next(ids)}"
    engine.add_request(rid, prompt, FIRST_TOKEN)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def load_scorer(name: str | None, args, device):
    if name is None:
        return None, False
    if name in shapes.SHAPES:
        quant = shapes.check_quant(args.quant or "bf16")
        return shapes.build_random_model(name, quant, device, seed=args.seed + 1), True
    return load_model(name, dtype=args.dtype, device=str(device)), False


def run(args) -> dict:
    for r in args.keep_ratio:
        if not 0 < r <= 1:
            raise RequestError(f"--keep-ratio values must be in (0, 1], got {r}")
    if min(args.prompt_lens) < 64 or args.repeats < 1 or args.scorer_chunk < 1:
        raise RequestError("--prompt-lens must be at least 64 tokens, --repeats and --scorer-chunk at least 1")
    device = resolve_device(args.device)
    target, quant = shapes.load_under_test(args.model, args.shape, args.quant, args.dtype, device, args.seed)
    scorer, random_scorer = load_scorer(args.scorer, args, device)
    same_vocab = random_scorer and args.shape is not None  # both random: token ids read as they are
    max_len = max(args.prompt_lens) + 8 if not args.needle else 2 * max(args.prompt_lens) + 256  # prose: approximate
    # the target's KV pool holds one prompt, leaving the device's memory to the scorer (built after it)
    specs = target.model.cache_specs()
    kv_bytes = pools_bytes_wanted(specs, kv_groups(specs), 16, 1, args.max_num_batched_tokens, max_len) + \
        bytes_per_sequence(specs, 1)
    engine = LLMEngine.from_args(EngineArgs(
        model=target.source, max_model_len=max_len, max_num_seqs=1, speculative_config={}, kv_cache_memory=kv_bytes,
        enable_prefix_caching=False, prefill_min_tokens=1, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_scorer_window=args.scorer_window),
        loaded=target)
    prefill = engine.speculative_prefill(scorer, same_vocab)
    prefill.scorer.chunk = args.scorer_chunk
    if args.needle:
        if args.shape is not None or random_scorer:
            raise RequestError("--needle needs real checkpoints (--model, --scorer): random shapes read no text")
        return {"target": target.source, "scorer": args.scorer or "the target",
                "needle": prefill_needle.recall(engine, args.prompt_lens, args.keep_ratio, seed=args.seed)}
    vocab = min(target.config.vocab_size, scorer.config.vocab_size if scorer is not None else target.config.vocab_size)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for n in args.prompt_lens:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        first_token_seconds(engine, {"prompt_token_ids": ids})  # untimed: kernel compilation
        exact = statistics.median(first_token_seconds(engine, {"prompt_token_ids": ids}) for _ in range(args.repeats))
        row = {"prompt_tokens": n, "exact_ttft_s": exact, "scored": []}
        for ratio in args.keep_ratio:
            prompt = {"prompt_token_ids": ids, "prefill_keep_ratio": ratio}
            first_token_seconds(engine, prompt)
            runs = []
            for _ in range(args.repeats):
                total = first_token_seconds(engine, prompt)
                runs.append((total, prefill.last_seconds))
            total, scoring = sorted(runs)[len(runs) // 2]
            kept = len(prefill.compress(ids, ratio).kept_positions)
            row["scored"].append({"keep_ratio": ratio, "kept_tokens": kept, "ttft_s": total, "scoring_s": scoring,
                                  "target_s": total - scoring, "speedup": exact / total,
                                  "scoring_share_of_exact": scoring / exact})
        rows.append(row)
    return {"target": target.source, "quant": quant, "scorer": args.scorer or "the target", "device": str(device),
            "scorer_window": args.scorer_window, "scorer_chunk": args.scorer_chunk, "rows": rows}


def print_report(result: dict) -> None:
    window = result["scorer_window"]
    print(f"speculative prefill: target {result['target']}, scorer {result['scorer']} "
          f"({f'attending to {window} keys' if window else 'dense'} before the tail, "
          f"{result['scorer_chunk']} tokens a forward), {result['device']}")
    print(f"{'prompt':>8} {'ratio':>6} {'kept':>8} {'exact s':>9} {'scored s':>9} {'scoring':>8} {'target':>8} "
          f"{'speedup':>8}")
    for row in result["rows"]:
        for s in row["scored"]:
            print(f"{row['prompt_tokens']:>8} {s['keep_ratio']:>6.3f} {s['kept_tokens']:>8} "
                  f"{row['exact_ttft_s']:>9.3f} "
                  f"{s['ttft_s']:>9.3f} {s['scoring_s']:>8.3f} {s['target_s']:>8.3f} {s['speedup']:>7.2f}x")


def main(args) -> int:
    result = run(args)
    if "needle" in result:
        prefill_needle.print_recall(result["needle"])
    else:
        print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
