#!/usr/bin/env bash
# Train the default model's DFlash drafter (block 16, 2 layers) with `lucebox train-drafter`, on
# the same kind of corpus as the target (the training machine's installed Python sources, the
# target's held-out files excluded), on the target's own regenerated greedy continuations. The
# held-out figures (tau, loss) are measured on the target's held-out files ("$DATA-eval"): code the
# target never trained on, rather than a split of the drafter's own data (the target's training
# text: tau 3.4 there against 1.5-2.3 in the engine on standard-library snippets; BENCHMARKS.md).
# Usage: scripts/train_default_drafter.sh OUT_DIR [TRAIN_SECONDS]   (one H200: about 7 minutes)
# Then: python scripts/write_model_card.py (models/default/README.md, from OUT_DIR/stats.json).
# Short continuations: 128-token prompts, each continued by the target for 128 tokens. The target's
# greedy text falls into loops after a hundred tokens or so (distinct 8-grams ~0.3 over 300 tokens),
# and a drafter trained on 768-token continuations learnt mostly to copy loops: trainer tau 3.4, but
# 1.6 over the first 48 tokens after a snippet, which is where a request spends its drafts. Every
# block here anchors within the first 128 tokens the target writes, as in serving.
# Env: SAMPLES (regenerated sequences, default 65536), BATCH (default 64), EVAL_EVERY (default 250),
# ARCH (dflash or dflash2; default dflash), LAYERS (default 2), INIT_FROM_TARGET=1 (draft layers
# start as copies of the target's last ones), INIT_DRAFTER (start from this drafter: a DFlash one grows
# into DFlash2 computing what it did), LR (default 6e-4),
# DATA (corpus directory; it and "$DATA-eval" are each written if empty, reused otherwise: runs
# sharing them can share REGEN_FROM, another run's regenerated.pt, whose key includes the data and
# eval files' paths). TAPS (default 3,4,5,6,7): the deeper half of the 8 layers; at equal CPU steps
# it learned faster than the reference spread 1,2,3,4,5 (BENCHMARKS.md, "Drafter taps").
# Measured (H200, 8,192 samples, 330 s; held out from the drafter's own corpus then): regeneration
# 83k tok/s, 0.18 s/step, held-out tau 2.2 with eval loss rising after ~6 epochs -- hence more
# samples by default.
set -euo pipefail
out=${1:-models/default-dflash}
seconds=${2:-380}
data=${DATA:-$(mktemp -d)}
data=${data%/}
eval=$data-eval
mkdir -p "$data" "$eval" "$out"
if [ -n "${REGEN_FROM:-}" ]; then cp "$REGEN_FROM" "$out/regenerated.pt"; fi
[ -n "$(ls -A "$data")" ] && [ -n "$(ls -A "$eval")" ] || python3 - "$data" "$eval" <<'PY'
import sys
from pathlib import Path
from lucebox.train import corpus
# The same hash split as the target: the drafter trains on the target's training files and is
# evaluated on its held-out ones.
train, held, stats = corpus.collect(40 << 20)
for where, texts in zip(sys.argv[1:], (train, held)):
    if any(Path(where).iterdir()):  # reused as it is
        continue
    for i, text in enumerate(texts):
        Path(where, f"{i:05d}.py").write_text(text)
    print(f"{where}: {len(texts)} files", flush=True)
PY
# --max-seconds fits the cosine schedule to the steps that the budget allows (timed on the first
# steps); the outer timeout only guards against a stuck run.
timeout --signal=INT $((seconds + 300)) python3 -m lucebox.cli train-drafter --target models/default \
  --data "$data" --eval-data "$eval" --out "$out" --layers "${LAYERS:-2}" --block-size 16 \
  --taps "${TAPS:-3,4,5,6,7}" --batch-size "${BATCH:-64}" --seq-len 256 --prompt-len 128 --anchors 128 \
  --lr "${LR:-6e-4}" --regenerate --max-samples "${SAMPLES:-65536}" --regen-batch 2048 --max-seconds "$seconds" \
  --eval-every "${EVAL_EVERY:-250}" --save-every 1000000 --seed 0 ${INIT_FROM_TARGET:+--init-from-target} \
  ${ARCH:+--arch "$ARCH"} ${INIT_DRAFTER:+--init-drafter "$INIT_DRAFTER"} \
  2>&1 | tee "$out/training.log"
# stats.json for the model card: the trainer's figures and tau in the engine on the test's snippets.
python3 scripts/drafter_stats.py "$out" --target models/default
