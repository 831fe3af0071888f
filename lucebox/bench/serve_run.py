"""`lucebox bench serve`'s runs: size the prompts, check the endpoint with one request, then one timed
run per (max concurrency, request rate) with the server's counters read before and after."""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

from tqdm import tqdm

from ..errors import LuceboxError
from .serve_data import (
    ESTIMATED_CHARS_PER_TOKEN,
    BenchRequest,
    CharSizer,
    TokenSizer,
    agent_requests,
    file_requests,
    random_requests,
    words_text,
)
from .serve_load import CHAT, Client, run_load
from .serve_report import (
    calculate_metrics,
    counter_deltas,
    report_text,
    result_filename,
    result_json,
    server_figures,
    sweep_table,
    write_json,
)


async def pick_sizer(client: Client, tokenizer):
    """The model's tokenizer where we have it; else the server's /tokenize on a sample; else a guess."""
    if tokenizer is not None:
        return TokenSizer(tokenizer)
    sample = words_text(random.Random(0), 2000, CharSizer(ESTIMATED_CHARS_PER_TOKEN, ""))
    ratio = await client.chars_per_token(sample)
    if ratio is not None:
        return CharSizer(ratio, f"prompt lengths sized at {ratio:.2f} chars per token, measured by the "
                                "server's /tokenize")
    return CharSizer(ESTIMATED_CHARS_PER_TOKEN, f"the server has no /tokenize: prompt lengths estimated at "
                                                f"{ESTIMATED_CHARS_PER_TOKEN:g} chars per token (--tokenizer "
                                                "MODEL sizes them exactly); reported token counts are the "
                                                "server's own where it streams usage")


def build_requests(args, sizer, seed: int) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, sizer, seed)
    if args.dataset == "agent":
        return agent_requests(args.num_prompts, args.prefix_len, args.suffix_len, args.agent_output_len,
                              args.turns, sizer, seed)
    return file_requests(args.dataset, args.num_prompts, args.random_output_len, sizer, seed)


def _rate_label(rate: float):
    return "inf" if math.isinf(rate) else rate


async def run_sweep(args, url: str, tokenizer, percentile_metrics: list[str], percentiles: list[float]) -> list[dict]:
    client = Client(url, args.endpoint, None, args.api_key, args.ignore_eos, args.temperature)
    try:
        try:
            client.model = args.served_model_name or await client.served_model()
        except Exception as e:  # noqa: BLE001 - unreachable, not OpenAI-shaped: one clear line either way
            raise LuceboxError(f"{url}/v1/models: cannot list the server's models ({type(e).__name__}: {e})") from None
        sizer = await pick_sizer(client, tokenizer)
        print(f"[bench serve: {sizer.note}]", file=sys.stderr)
        first = build_requests(args, sizer, args.seed)  # a bad dataset fails before any request is sent
        # One request before the clock starts: a wrong URL or endpoint is one clear error, not N failures.
        # A prompt of its own, so the run's prefix-cache figures are the run's.
        probe = await client.send(BenchRequest([{"role": "user", "content": "ping"}], "ping", 1, 2))
        if not probe.success:
            raise LuceboxError(f"the test request to {url}{args.endpoint} failed: {probe.error}")
        results = []
        runs = [(concurrency, rate) for concurrency in args.max_concurrency for rate in args.request_rate]
        for i, (concurrency, rate) in enumerate(runs):
            # Each run its own prompts (seed + run index): a run must not find the previous run's
            # prompts in the prefix cache (a file's prompts are only resampled, so they may).
            seed = args.seed + i
            requests = first if i == 0 else build_requests(args, sizer, seed)
            results.append(await _one_run(client, args, url, requests, seed, rate, concurrency, percentile_metrics,
                                          percentiles))
    finally:
        await client.close()
    if len(results) > 1:
        print("\n" + sweep_table(results))
    if args.json:
        write_json(args.json, results[0] if len(results) == 1 else results)
    return results


async def _one_run(client: Client, args, url: str, requests, seed: int, rate: float, concurrency,
                   percentile_metrics, percentiles) -> dict:
    print(f"\n[bench serve: {len(requests)} requests, request rate {_rate_label(rate)}, "
          f"max concurrency {concurrency or 'none'}]", file=sys.stderr)
    before = await client.metrics()
    with tqdm(total=len(requests), disable=args.disable_tqdm, file=sys.stderr, unit="req") as bar:
        outcomes, duration = await run_load(client.send, requests, rate, concurrency, seed,
                                            on_done=lambda: bar.update(1))
    deltas = counter_deltas(before, await client.metrics())
    config = {"backend": "openai-chat" if args.endpoint == CHAT else "openai", "endpoint": args.endpoint,
              "base_url": url, "model_id": args.model or client.model, "served_model_name": client.model,
              "tokenizer_id": args.tokenizer or args.model, "dataset": args.dataset, "num_prompts": len(requests),
              "request_rate": _rate_label(rate), "burstiness": 1.0, "max_concurrency": concurrency, "seed": seed}
    metrics = calculate_metrics(outcomes, duration, percentiles)
    result = result_json(config, metrics, server_figures(deltas, outcomes), deltas, outcomes)
    print(report_text(result, percentile_metrics, percentiles))
    if args.save_result:
        path = Path(args.result_dir) / result_filename(result)
        write_json(path, result)
        print(f"[bench serve: wrote {path}]", file=sys.stderr)
    return result
