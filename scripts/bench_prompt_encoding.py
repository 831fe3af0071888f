"""Host time to encode an agent's prompt each turn: the whole rendered conversation from scratch
(tokenizer.encode) against text/prompt_encoder.py's incremental encode, which reuses the previous
turn's ids up to its last special token. A conversation grows by a source file's worth of text a
turn (~1.7K tokens) through the bundled model's chat template; printed every 10 turns.

    python scripts/bench_prompt_encoding.py [--turns 60] [--model models/default]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from lucebox.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--model", default=str(ROOT / "models" / "default"))
    args = p.parse_args()
    tok = Tokenizer.from_hf_dir(args.model)
    source = (ROOT / "lucebox" / "engine" / "cuda_graphs.py").read_text()
    messages = [{"role": "system", "content": "You are a coding agent working in this repository. " * 40}]
    print("| turn | prompt tokens | whole encode | incremental | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for turn in range(args.turns):
        start = (97 * turn) % 5000
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": source[start:start + 6000]})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        t0 = time.perf_counter()
        whole = tok.encode(text, add_special_tokens=False)
        t1 = time.perf_counter()
        incremental = tok.encode_prompt(text)
        t2 = time.perf_counter()
        if incremental != whole:
            raise SystemExit(f"turn {turn}: the incremental ids differ from the whole encode")
        if turn % 10 == 9:
            print(f"| {turn + 1} | {len(whole):,} | {1e3 * (t1 - t0):.1f} ms | {1e3 * (t2 - t1):.2f} ms | "
                  f"{(t1 - t0) / (t2 - t1):.1f}x |")


if __name__ == "__main__":
    main()
