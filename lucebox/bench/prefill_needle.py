"""`lucebox bench prefill --needle`: recall of speculative prefill's selection. A haystack of filler prose
hides one needle sentence at several depths; the prompt ends in a question about it. A needle counts as
recalled when its value survives in the kept text (what the target will see): decidable with any
scorer, meaningful with real checkpoints (--model / --scorer), not random shapes."""
from __future__ import annotations

import random

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FILLER = ["The river bends twice before it reaches the old mill.", "Grain prices rose slowly through the autumn.",
          "A committee met on Tuesday to discuss the new bridge.", "Most of the orchard was planted by hand.",
          "The library opens late on the first day of each month.", "Fog rolled over the harbour before noon.",
          "Several letters were found in a drawer of the desk.", "The train to the coast leaves every hour."]


def needle_prompt(tokenizer, tokens: int, depth: float, value: str, rng: random.Random) -> str:
    """About `tokens` tokens of filler with the needle at `depth` (0: start, 1: end), then the question."""
    needle = f"The secret passphrase of the lighthouse keeper is {value}."
    question = "\n\nQuestion: what is the secret passphrase of the lighthouse keeper? Answer:"
    per_line = max(1, len(tokenizer.encode(" ".join(FILLER), add_special_tokens=False)) // len(FILLER))
    lines = [rng.choice(FILLER) for _ in range(max(1, tokens // per_line))]
    lines.insert(int(depth * len(lines)), needle)
    return " ".join(lines) + question


def recall(engine, lengths: list[int], ratios: list[float], depths=DEPTHS, seed: int = 0) -> list[dict]:
    """Per (prompt length, keep ratio): needles recalled of len(depths), and the mean kept share."""
    rng, prefill, tok = random.Random(seed), engine.speculative_prefill(), engine.tokenizer
    rows = []
    for n in lengths:
        for ratio in ratios:
            found, kept = 0, 0.0
            for depth in depths:
                value = f"{rng.randint(10000, 99999)}-{rng.choice(['amber', 'cobalt', 'violet', 'saffron'])}"
                ids = tok.encode(needle_prompt(tok, n, depth, value, rng))
                compression = prefill.compress(ids, ratio)
                kept_ids = compression.kept_ids if compression is not None else ids
                found += value in tok.decode(kept_ids)
                kept += len(kept_ids) / len(ids)
            rows.append({"prompt_tokens": n, "keep_ratio": ratio, "recalled": found, "needles": len(depths),
                         "kept_share": kept / len(depths)})
    return rows


def print_recall(rows: list[dict]) -> None:
    print(f"{'prompt':>8} {'ratio':>6} {'recall':>8} {'kept':>6}")
    for r in rows:
        print(f"{r['prompt_tokens']:>8} {r['keep_ratio']:>6.3f} {r['recalled']:>4}/{r['needles']:<3} "
              f"{r['kept_share']:>6.3f}")
