#!/usr/bin/env python
"""PFlash scoring interleaved with decoding, on the GPU: while a long prompt is scored (one scorer chunk a
engine step), a running request keeps decoding. Reports the decode request's step times before and
during scoring (the stall a scorer chunk adds to everyone's step), that it got a token in every step, and
the scoring time interleaved vs the synchronous compress of the same prompt (same kept positions).

    python scripts/check_pflash_interleave.py --shape qwen3-8b --scorer qwen3-0.6b --prompt-len 131072
    python scripts/check_pflash_interleave.py --device cpu --shape tiny --scorer tiny --prompt-len 2048  # runs

Random weights (speed, not quality); the scorer reads the target's token ids (one random vocabulary).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--scorer", default="qwen3-0.6b")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-len", type=int, default=131072)
    p.add_argument("--keep-ratio", type=float, default=0.1)
    p.add_argument("--decode-before", type=int, default=16, help="decode steps timed before the long prompt")
    p.add_argument("--rounds", type=int, default=2, help="long prompts scored one after another")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch

    from lucebox import SamplingParams
    from lucebox.bench import shapes
    from lucebox.config import EngineArgs
    from lucebox.engine.engine import LLMEngine
    from lucebox.model.cache_spec import kv_bytes_per_token
    from lucebox.model.loader import resolve_device

    device = resolve_device(args.device)
    target = shapes.build_random_model(args.shape, "bf16" if device.type == "cuda" else "f32", device, seed=0)
    scorer = shapes.build_random_model(args.scorer, "bf16" if device.type == "cuda" else "f32", device, seed=1)
    max_len = args.prompt_len + 64
    # the scorer is attached after the engine: the target's KV is bounded to two sequences, so memory is left
    # for the scorer's (by default the target's pool would take 90% of the card)
    engine = LLMEngine.from_args(EngineArgs(model=target.source, max_model_len=max_len, max_num_seqs=2,
                                            speculative_config={}, enable_prefix_caching=False, prefill_min_tokens=1,
                                            max_num_batched_tokens=8192,
                                            kv_cache_memory=2 * max_len * kv_bytes_per_token(target.model)),
                                 loaded=target)
    prefill = engine.speculative_prefill(scorer, same_vocab=True)
    vocab = min(target.config.vocab_size, scorer.config.vocab_size)
    ids = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    started = time.perf_counter()
    want = prefill.compress(ids, args.keep_ratio)  # also warms the scorer's kernels
    sync()
    sync_seconds = time.perf_counter() - started

    decode_params = SamplingParams(temperature=0, max_tokens=max_len - 64, ignore_eos=True)
    engine.add_request("decoder", {"prompt_token_ids": ids[:64]}, decode_params)
    decoder = engine.requests["decoder"][1][0]

    def timed_step() -> tuple[float, int]:
        before = len(decoder.output_token_ids)
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        return time.perf_counter() - t, len(decoder.output_token_ids) - before

    for _ in range(4):  # prefill + warm decode steps
        timed_step()
    plain = [timed_step()[0] for _ in range(args.decode_before)]
    rounds = []
    for r in range(args.rounds):  # a second round shows what the first paid once (kernels compiled on first use)
        request = f"long{r}"
        engine.add_request(request, {"prompt_token_ids": ids, "prefill_keep_ratio": args.keep_ratio},
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        long_seq = engine.requests[request][1][0]
        scoring, tokens, after = [], [], []
        while request in engine.scoring:
            seconds, emitted = timed_step()
            scoring.append(seconds)
            tokens.append(emitted)
        while not long_seq.is_finished:  # the kept tokens' prefill, chunked beside the decoder
            after.append(timed_step()[0])
        same = long_seq.compression is not None and long_seq.compression.kept_positions == want.kept_positions
        rounds.append({
            "interleaved_scoring_s": prefill.last_seconds, "scoring_steps": len(scoring),
            "decode_step_ms_during_median": 1e3 * statistics.median(scoring),
            "decode_step_ms_during_max": 1e3 * max(scoring),
            "a_token_every_step": all(n == 1 for n in tokens), "same_kept_positions": same,
            "scoring_step_ms": [round(1e3 * s, 1) for s in scoring],
            "kept_prefill_step_ms": [round(1e3 * s, 1) for s in after]})
    engine.abort("decoder")
    result = {
        "device": str(device), "target": args.shape, "scorer": args.scorer, "prompt_tokens": args.prompt_len,
        "keep_ratio": args.keep_ratio, "kept_tokens": len(want.kept_positions), "sync_compress_s": sync_seconds,
        "decode_step_ms_before": 1e3 * statistics.median(plain), "rounds": rounds,
    }
    ok = all(r["a_token_every_step"] and r["same_kept_positions"] for r in rounds)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
