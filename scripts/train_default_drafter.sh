#!/usr/bin/env bash
# Train the default model's DFlash drafter (block 16, 2 layers) with `lucebox train-drafter`, on
# the same kind of corpus as the target (the training machine's installed Python sources, the
# target's held-out files excluded), on the target's own regenerated continuations.
# Usage: scripts/train_default_drafter.sh OUT_DIR [SECONDS]   (one H200: ~8 minutes)
set -euo pipefail
out=${1:-models/default-dflash}
seconds=${2:-400}
data=$(mktemp -d)
python3 - "$data" <<'PY'
import sys
from pathlib import Path
from lucebox.train import corpus
train, _, stats = corpus.collect(40 << 20)  # the same hash split as the target: its held-out files stay out
for i, text in enumerate(train):
    Path(sys.argv[1], f"{i:05d}.py").write_text(text)
print(f"drafter corpus: {len(train)} files", flush=True)
PY
# The trainer stops at --steps; `timeout` keeps the run inside one GPU command, and checkpoints
# (which rewrite the z-lab files) make whatever finished usable.
timeout --signal=INT "$seconds" python3 -m lucebox.cli train-drafter --target models/default --data "$data" \
  --out "$out" --layers 2 --block-size 16 --steps "${STEPS:-3000}" --batch-size "${BATCH:-32}" --seq-len 1024 \
  --anchors 256 --lr 6e-4 --regenerate --max-samples "${SAMPLES:-2048}" --regen-batch 512 \
  --eval-every "${EVAL_EVERY:-500}" --save-every 250 --seed 0 || echo "trainer stopped (timeout or error): $?"
