"""Write a trained default drafter's stats.json (read by scripts/write_model_card.py): the recipe,
the trainer's held-out figures by step (training_log.jsonl), its speed (training.log), and tau in
the engine on the held-out snippets that tests/test_default_model.py measures.

    python scripts/drafter_stats.py models/default-dflash [--target models/default]
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SNIPPETS, CHARS, SEED, TOKENS = 6, 300, 11, 48  # tests/test_default_model.py's measure


def engine_tau(target: str, drafter: str) -> float:
    from lucebox import LLM, SamplingParams
    from lucebox.bench.prompts import held_out_texts
    llm = LLM(target, dtype="float32", device="cpu",
              speculative_config={"method": "dflash", "model": drafter, "adaptive": False})
    outs = llm.generate(held_out_texts(SNIPPETS, CHARS, seed=SEED),
                        SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)
    drafts = sum(o.metrics.num_drafts for o in outs)
    return (sum(o.metrics.num_accepted_tokens for o in outs) + drafts) / drafts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the drafter directory (config.json, training_log.jsonl, training.log)")
    p.add_argument("--target", default="models/default")
    p.add_argument("--recipe", help="how it was trained, when not by the script's defaults (for the card)")
    args = p.parse_args()
    out = Path(args.out)
    config = json.loads((out / "config.json").read_text())
    history = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines() if line.strip()]
    log = (out / "training.log").read_text() if (out / "training.log").is_file() else ""
    rate = re.search(r"([\d.]+) s/step, training (\d+) steps", log)
    wrote = re.search(r"steps \d+\.\.(\d+), (\d+) s\)", log)
    stats = {
        "arch": "dflash2" if "DFlash2DraftModel" in config.get("architectures", ()) else "dflash",
        "recipe": args.recipe,
        "selector_rank": config["dflash_config"].get("selector_rank"),
        "layers": config["num_hidden_layers"], "block_size": config["block_size"],
        "taps": config["dflash_config"]["target_layer_ids"], "hidden_size": config["hidden_size"],
        "steps": history[-1]["step"], "seconds_per_step": float(rate.group(1)) if rate else None,
        "train_seconds": int(wrote.group(2)) if wrote else None,
        "trainer_tau": {str(r["step"]): round(r["tau"], 3) for r in history},
        "slot_accuracy": [round(a, 2) for a in history[-1]["slot_accuracy"]],
        "engine_tau": {"snippets": SNIPPETS, "chars": CHARS, "tokens": TOKENS,
                       "tau": round(engine_tau(args.target, str(out)), 2)},
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
