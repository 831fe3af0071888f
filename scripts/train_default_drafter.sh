#!/usr/bin/env bash
# Train the default model's DFlash drafter (block 16, 2 layers) with `lucebox train-drafter`, on
# the same kind of corpus as the target (the training machine's installed Python sources, the
# target's held-out files excluded), on the target's own regenerated greedy continuations.
# Usage: scripts/train_default_drafter.sh OUT_DIR [TRAIN_SECONDS]   (one H200: about 8 minutes)
# Env: SAMPLES (regenerated sequences, default 16384), BATCH (default 32), EVAL_EVERY (default 250),
# LAYERS (default 2), INIT_FROM_TARGET=1 (draft layers start as copies of the target's last ones),
# DATA (corpus directory, written if missing: runs sharing it can share REGEN_FROM, another run's
# regenerated.pt, whose key includes the data files' paths).
# Measured (H200, 8,192 samples, 330 s): regeneration 83k tok/s, 0.18 s/step, held-out tau 2.2 with
# eval loss rising after ~6 epochs -- hence more samples by default. TAPS (default 3,4,5,6,7): the
# deeper half of the 8 layers; at equal CPU steps it learned faster than the reference spread
# 1,2,3,4,5 (BENCHMARKS.md, "Drafter taps").
set -euo pipefail
out=${1:-models/default-dflash}
seconds=${2:-380}
data=${DATA:-$(mktemp -d)}
mkdir -p "$data" "$out"
if [ -n "${REGEN_FROM:-}" ]; then cp "$REGEN_FROM" "$out/regenerated.pt"; fi
[ -n "$(ls -A "$data")" ] || python3 - "$data" <<'PY'
import sys
from pathlib import Path
from lucebox.train import corpus
train, _, stats = corpus.collect(40 << 20)  # the same hash split as the target: its held-out files stay out
for i, text in enumerate(train):
    Path(sys.argv[1], f"{i:05d}.py").write_text(text)
print(f"drafter corpus: {len(train)} files", flush=True)
PY
# --max-seconds fits the cosine schedule to the steps that the budget allows (timed on the first
# steps); the outer timeout only guards against a stuck run.
timeout --signal=INT $((seconds + 300)) python3 -m lucebox.cli train-drafter --target models/default --data "$data" \
  --out "$out" --layers "${LAYERS:-2}" --block-size 16 --taps "${TAPS:-3,4,5,6,7}" --batch-size "${BATCH:-32}" --seq-len 1024 --anchors 256 --lr 6e-4 \
  --regenerate --max-samples "${SAMPLES:-16384}" --regen-batch 2048 --max-seconds "$seconds" \
  --eval-every "${EVAL_EVERY:-250}" --save-every 1000000 --seed 0 ${INIT_FROM_TARGET:+--init-from-target}
