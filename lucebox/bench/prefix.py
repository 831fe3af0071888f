"""`lucebox bench speed --prefix-lens P.. --suffix-lens N..`: an agent's turn, N new tokens on top of a
cached prefix of P tokens, beside fresh prompts of N tokens and the fresh prefill of the prefix itself.

Each round draws a new random prefix, prefills it alone (one token out: what the prefix cache then
holds, and the "fresh prefix" TTFT), then times prefix + a new random suffix; that request must be
served from the prefix cache: its cached-token count is checked against the prefix's whole blocks
(an error otherwise, so a figure never comes from a silent miss). A fresh N-token prompt is timed in
the same round. Round 0 is untimed (kernel compilation); the median of --repeats rounds is reported.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics

from ..engine.engine import LLMEngine
from ..engine.state_snapshots import snapshot_bytes
from ..sampling import SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def first_token(engine: LLMEngine, clock, prompt: list[int], ids=itertools.count()) -> tuple[float, int]:
    """(time to the first token, prompt tokens served from the prefix cache) of one request alone."""
    start, out = clock.now(), None
    engine.add_request(f"prefix-bench-{next(ids)}", {"prompt_token_ids": prompt}, FIRST_TOKEN)
    while out is None:
        out = next(iter(engine.step()), None)
    ttft = clock.now() - start
    while engine.has_unfinished():
        engine.step()
    return ttft, out.num_cached_tokens


def prefix_engine(loaded, args, engine_args, prefix_lens, suffix_lens) -> LLMEngine:
    """Batch 1 with prefix caching on; the pool holds the longest prefix and two suffixes (the cached
    prefix's finished request and the timed one)."""
    longest = max(prefix_lens) + 2 * max(suffix_lens) + 64
    given = engine_args(args, longest, loaded)
    # prefix caching keeps recurrent-state snapshots (hybrids) beside the pool
    specs = loaded.model.cache_specs(args.cache_type_k, args.cache_type_v)
    memory = given.kv_cache_memory + snapshot_bytes(specs, given.recurrent_prefix_snapshots)
    return LLMEngine.from_args(dataclasses.replace(given, enable_prefix_caching=True, kv_cache_memory=memory), loaded)


def prefix_phase(loaded, args, engine_args, clock, rng, say) -> list[dict]:
    """One row per (prefix, suffix) pair: cached TTFT, fresh N-token TTFT, fresh prefix TTFT, cached count."""
    engine = prefix_engine(loaded, args, engine_args, args.prefix_lens, args.suffix_lens)
    block, vocab = engine.args.block_size, loaded.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]
    rows = []
    for prefix_len in sorted(set(args.prefix_lens)):
        expected = prefix_len // block * block  # whole blocks only are cached
        for suffix_len in sorted(set(args.suffix_lens)):
            runs = []
            for r in range(args.repeats + 1):
                prefix = tokens(prefix_len)
                fresh_prefix, _ = first_token(engine, clock, prefix)
                cached_ttft, cached = first_token(engine, clock, prefix + tokens(suffix_len))
                if cached < expected:
                    raise RuntimeError(f"prefix {prefix_len} + suffix {suffix_len}: the engine served {cached} "
                                       f"prompt tokens from the prefix cache, expected {expected}: not a cached-"
                                       f"prefix measurement")
                fresh_ttft, fresh_cached = first_token(engine, clock, tokens(suffix_len))
                if fresh_cached:
                    raise RuntimeError(f"a fresh {suffix_len}-token prompt hit the prefix cache ({fresh_cached})")
                runs += [(cached_ttft, fresh_ttft, fresh_prefix)] if r else []
            cached_s, fresh_s, prefix_s = (statistics.median(x[i] for x in runs) for i in range(3))
            rows.append({"prefix_len": prefix_len, "suffix_len": suffix_len, "cached_tokens": cached,
                         "expected_cached_tokens": expected, "computed_tokens": prefix_len + suffix_len - cached,
                         "ttft_s": cached_s, "fresh_ttft_s": fresh_s, "fresh_prefix_ttft_s": prefix_s,
                         "tok_s": suffix_len / cached_s})
            say(f"suffix {suffix_len} on cached prefix {prefix_len} ({cached} cached): TTFT {1e3 * cached_s:.1f} ms "
                f"(fresh {suffix_len}: {1e3 * fresh_s:.1f} ms)")
    return rows


def peer_ratios(rows: list[dict], peer_rows: list[dict]) -> None:
    """llama-bench's pp N at depth P (the same N tokens on top of P positions of KV) beside each row:
    its TTFT is N over its prompt rate. Adds llama_cpp_ttft_s and ratio (lucebox TTFT / llama.cpp's)."""
    theirs = {(p["depth"], p["prompt_len"]): p["tok_s"] for p in peer_rows}
    for row in rows:
        rate = theirs.get((row["prefix_len"], row["suffix_len"]))
        if rate:
            row["llama_cpp_ttft_s"] = row["suffix_len"] / rate
            row["llama_cpp_ttft_ratio"] = row["ttft_s"] / row["llama_cpp_ttft_s"]


def report_rows(r: dict, n) -> list[tuple[str, str, str, str, str]]:
    """Table rows of the cached-prefix measurements (n: the report's number formatter)."""
    rows = []
    for x in r.get("prefix") or []:
        peer = (f"; llama.cpp {n(1e3 * x['llama_cpp_ttft_s'])} ms" if "llama_cpp_ttft_s" in x
                else "; llama.cpp not measured")
        ratio = f"{x['llama_cpp_ttft_ratio']:.2f}x llama.cpp" if "llama_cpp_ttft_ratio" in x else ""
        measure = f"{x['suffix_len']:,} tokens on a cached {x['prefix_len']:,}-token prefix ({x['cached_tokens']:,} cached)"
        beside = (f"fresh {x['suffix_len']:,}-token prompt {n(1e3 * x['fresh_ttft_s'])} ms; fresh prefix "
                  f"{n(1e3 * x['fresh_prefix_ttft_s'])} ms{peer}")
        rows.append((measure, f"TTFT {n(1e3 * x['ttft_s'])} ms, {n(x['tok_s'])} tok/s", beside, ratio, ""))
    return rows
