"""`lucebox bench serve`'s figures: vLLM `bench serve`'s metrics (names, JSON keys, printed layout)
from per-request timings, plus prefix-cache and speculation figures from the server's counters."""
from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import numpy as np

from .serve_load import RequestResult

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
WIDTH = 50


def percentile_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (vLLM's p99_ttft_ms / p99.9_ttft_ms keys)."""
    return str(int(p)) if int(p) == p else str(p)


def latency_stats(name: str, seconds: list[float], percentiles: list[float]) -> dict:
    """mean / median / std / p<P> of `seconds`, in milliseconds, under vLLM's keys; None when empty."""
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    stats = {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None}
    stats.update({f"p{percentile_word(p)}_{name}_ms": None for p in percentiles})
    if ms.size:
        stats.update({f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                      f"std_{name}_ms": float(ms.std())})
        stats.update({f"p{percentile_word(p)}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles})
    return stats


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    """Throughput over the benchmark's wall time and latency statistics over the successful requests.
    TPOT is per request, (E2EL - TTFT) / (output tokens - 1), for requests of 2+ tokens; ITL is every
    gap between streamed chunks (a chunk may carry several tokens when the server speculates)."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    metrics = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
               "total_input_tokens": total_input, "total_output_tokens": total_output,
               "request_throughput": len(ok) / duration, "output_throughput": total_output / duration,
               "total_token_throughput": (total_input + total_output) / duration}
    samples = {"ttft": [r.ttft for r in ok],
               "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
               "itl": [gap for r in ok for gap in r.itl],
               "e2el": [r.latency for r in ok]}
    for name, values in samples.items():
        metrics.update(latency_stats(name, values, percentiles))
    return metrics


def counter_deltas(before: dict | None, after: dict | None) -> dict:
    """The server's counters' growth over the run (those both scrapes saw)."""
    if not before or not after:
        return {}
    return {k: after[k] - before[k] for k in after if k in before}


def server_figures(deltas: dict, results: list[RequestResult]) -> dict:
    """Prefix-cache hit rate (prompt tokens served from the cache) and speculation acceptance.
    The hit rate comes from the server's counters; without them, from the usage's cached_tokens."""
    out = {"prefix_cache_hit_rate": None, "prefix_cache_source": None, "spec_decode_acceptance_rate": None,
           "spec_decode_acceptance_length": None}
    queries, hits = deltas.get("prefix_cache_queries"), deltas.get("prefix_cache_hits")
    ok = [r for r in results if r.success]
    if queries:
        out.update(prefix_cache_hit_rate=hits / queries, prefix_cache_source="/metrics")
    elif ok and all(r.cached_tokens is not None for r in ok) and sum(r.prompt_len for r in ok):
        out.update(prefix_cache_hit_rate=sum(r.cached_tokens for r in ok) / sum(r.prompt_len for r in ok),
                   prefix_cache_source="usage")
    drafts, draft_tokens = deltas.get("spec_decode_num_drafts"), deltas.get("spec_decode_num_draft_tokens")
    accepted = deltas.get("spec_decode_num_accepted_tokens")
    if draft_tokens and accepted is not None:
        out["spec_decode_acceptance_rate"] = accepted / draft_tokens
    if drafts and accepted is not None:
        out["spec_decode_acceptance_length"] = 1 + accepted / drafts  # tokens per verify step, the bonus included
    return out


def result_json(config: dict, metrics: dict, figures: dict, deltas: dict, results: list[RequestResult]) -> dict:
    """vLLM bench serve's result layout: the run's settings, the metrics, and per-request lists."""
    ok = [r for r in results if r.success]
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **config, **metrics, **figures,
            "server_metrics": deltas,
            "input_lens": [r.prompt_len for r in ok], "output_lens": [r.output_len for r in ok],
            "ttfts": [r.ttft for r in ok], "itls": [r.itl for r in ok], "e2els": [r.latency for r in ok],
            "generated_texts": [r.generated_text for r in ok], "errors": [r.error for r in results if not r.success]}


def result_filename(result: dict) -> str:
    """vLLM's file name: <backend>-<rate>qps[-concurrency<n>]-<model>-<date>.json."""
    concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] else ""
    model = str(result["model_id"]).rstrip("/").split("/")[-1]
    return f"{result['backend']}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"


def write_json(path: str | Path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _row(label: str, value, digits: int = 2) -> str:
    if value is None:
        return f"{label:<40} {'n/a':<10}"
    if isinstance(value, float) and not math.isinf(value):
        return f"{label:<40} {value:<10.{digits}f}"
    return f"{label:<40} {value!s:<10}"


def report_text(result: dict, percentile_metrics: list[str], percentiles: list[float]) -> str:
    """The printed report, laid out as vLLM's bench serve prints it (sections of 50 columns)."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             _row("Successful requests:", result["completed"]), _row("Failed requests:", result["failed"]),
             _row("Maximum request concurrency:", result["max_concurrency"]),
             _row("Request rate configured (RPS):", result["request_rate"]),
             _row("Benchmark duration (s):", result["duration"]),
             _row("Total input tokens:", result["total_input_tokens"]),
             _row("Total generated tokens:", result["total_output_tokens"]),
             _row("Request throughput (req/s):", result["request_throughput"]),
             _row("Output token throughput (tok/s):", result["output_throughput"]),
             _row("Total Token throughput (tok/s):", result["total_token_throughput"])]
    for name in percentile_metrics:
        upper = name.upper()
        lines.append(METRICS[name].center(WIDTH, "-"))
        lines.append(_row(f"Mean {upper} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {upper} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            word = percentile_word(p)
            lines.append(_row(f"P{word} {upper} (ms):", result[f"p{word}_{name}_ms"]))
    deltas = result["server_metrics"]
    lines.append("Prefix Cache".center(WIDTH, "-"))
    rate = result["prefix_cache_hit_rate"]
    lines.append(_row(f"Prefix cache hit rate (%, {result['prefix_cache_source'] or 'not served'}):",
                      None if rate is None else 100 * rate))
    if "prefix_cache_queries" in deltas:
        lines.append(_row("Prefix cache queries (tokens):", int(deltas["prefix_cache_queries"])))
        lines.append(_row("Prefix cache hits (tokens):", int(deltas.get("prefix_cache_hits", 0))))
    lines.append("Speculative Decoding".center(WIDTH, "-"))
    acceptance = result["spec_decode_acceptance_rate"]
    lines.append(_row("Acceptance rate (%):", None if acceptance is None else 100 * acceptance))
    lines.append(_row("Acceptance length:", result["spec_decode_acceptance_length"]))
    for key, label in (("spec_decode_num_drafts", "Drafts:"), ("spec_decode_num_draft_tokens", "Draft tokens:"),
                       ("spec_decode_num_accepted_tokens", "Accepted tokens:")):
        if key in deltas:
            lines.append(_row(label, int(deltas[key])))
    lines.append("=" * WIDTH)
    if result["errors"]:
        lines.append(f"first error ({result['failed']} failed): {result['errors'][0]}")
    return "\n".join(lines)


def sweep_table(results: list[dict]) -> str:
    """One markdown row per run of a sweep."""
    def ms(value):
        return "n/a" if value is None else f"{value:.1f}"

    def pct(value):
        return "n/a" if value is None else f"{100 * value:.1f}%"

    lines = ["| max concurrency | request rate | ok / failed | req/s | output tok/s | median TTFT ms | P99 TTFT ms "
             "| median TPOT ms | P99 ITL ms | prefix hits | acceptance |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['max_concurrency'] or 'none'} | {r['request_rate']} | {r['completed']} / {r['failed']} "
                     f"| {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {ms(r['median_ttft_ms'])} "
                     f"| {ms(r.get('p99_ttft_ms'))} | {ms(r['median_tpot_ms'])} | {ms(r.get('p99_itl_ms'))} "
                     f"| {pct(r['prefix_cache_hit_rate'])} | {pct(r['spec_decode_acceptance_rate'])} |")
    return "\n".join(lines)
