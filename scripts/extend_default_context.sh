#!/usr/bin/env bash
# Extend the default pair's context from 2,048 to 65,536 tokens (coding agents' first prompts are
# 8-38K tokens). One H200, two stages; each fits one 10-minute GPU command (run them as two).
#  1. STAGE=target: scripts/extend_default_context.py -- YaRN (factor 32 over the original 2,048)
#     and a training stage on 16K-64K-token windows of the corpus mixed with the base recipe's
#     2,048-token windows and chat examples -> OUT_DIR/default. Measured with 90 s of training:
#     207 s in all, so about 6 minutes with the default 240 s.
#  2. STAGE=drafter: `lucebox train-drafter --init-drafter models/default-dflash` against the
#     extended target (OUT_DIR/default; TARGET=models/default once it is copied there): the trained drafter's weights, the target's
#     YaRN RoPE and context, trained on the target's own 128-token greedy continuations after
#     contexts of every length up to DRAFT_CONTEXT (default 32,768) tokens -- 128-token snippets
#     as in the base recipe, single files, runs of neighbouring files of one package ->
#     OUT_DIR/default-dflash. Measured with 60 s of training: 240 s in all (regeneration 135 s),
#     so about 6 minutes with the default 150 s.
# Usage: scripts/extend_default_context.sh OUT_DIR [TARGET_SECONDS=240] [DRAFTER_SECONDS=150]
#   STAGE=target|drafter|all (default all: about 12 minutes, over one GPU command's limit).
#   PACK=DIR: also write OUT_DIR as DIR/extended.tar.* pieces of 15 MB (a GPU command returns at most
#   8 files of 16 MB: `cat extended.tar.* | tar -x` puts default/ and default-dflash/ back).
# Then: rm -rf models/default models/default-dflash && cp -r OUT_DIR/default OUT_DIR/default-dflash models/
#       python scripts/write_model_card.py
set -euo pipefail
out=${1:?usage: scripts/extend_default_context.sh OUT_DIR [TARGET_SECONDS] [DRAFTER_SECONDS]}
out=${out%/}
target_seconds=${2:-240}
drafter_seconds=${3:-150}
stage=${STAGE:-all}
context=${DRAFT_CONTEXT:-32768}
mkdir -p "$out/default" "$out/default-dflash"

if [ "$stage" = all ] || [ "$stage" = target ]; then
  python3 scripts/extend_default_context.py --base models/default --out "$out/default" \
    --seconds "$target_seconds" 2>&1 | tee "$out/default/long_context.log"
fi

if [ "$stage" = all ] || [ "$stage" = drafter ]; then
  data=$(mktemp -d)
  python3 - "$data/train" "$data/eval" "$context" <<'PY'
import random
import sys
from pathlib import Path
from lucebox.train import corpus
# The target's hash split: train on its training files, evaluate on its held-out ones. Documents
# of mixed length: a 128-token snippet, one file, or neighbouring files of one package (path
# order) of a quarter to one and a half contexts; each becomes prompts of up to the context, each
# continued by the target for 128 tokens. (Regeneration time grows with the long prompts' tokens.)
BYTES_PER_TOKEN = 3.6  # the default tokenizer on this corpus
context = int(sys.argv[3])
train, held, _ = corpus.collect(40 << 20)
for where, texts in zip(sys.argv[1:3], (train, held)):
    rng = random.Random(0)
    Path(where).mkdir(parents=True)
    docs, i = [], 0
    while i < len(texts):
        kind = rng.random()
        if kind < 0.5:  # short contexts weigh most: the engine's tau is measured after short snippets
            lines = texts[i].splitlines(keepends=True)
            first = rng.randrange(len(lines))
            docs.append("".join(lines[first:])[:460])
            i += 1
        elif kind < 0.65:
            docs.append(texts[i])
            i += 1
        else:
            size, group = rng.uniform(0.25, 1.5) * context * BYTES_PER_TOKEN, []
            while i < len(texts) and sum(map(len, group)) < size:
                group.append(texts[i])
                i += 1
            docs.append("\n\n".join(group))
    for n, doc in enumerate(docs):
        Path(where, f"{n:05d}.py").write_text(doc)
    print(f"{where}: {len(docs)} documents from {len(texts)} files", flush=True)
PY
  target=${TARGET:-$out/default}
  [ -f "$target/config.json" ] || { echo "no extended target in $target: run STAGE=target first or set TARGET" >&2; exit 2; }
  timeout --signal=INT $((drafter_seconds + 400)) python3 -m lucebox.cli train-drafter --target "$target" \
    --init-drafter models/default-dflash --data "$data/train" --eval-data "$data/eval" --out "$out/default-dflash" \
    --seq-len $((context + 128)) --prompt-len "$context" --regen-tokens 128 --regenerate --max-samples 1024 \
    --regen-batch 32 --eval-samples 48 --batch-size 4 --anchors 128 --lr 2e-4 --max-seconds "$drafter_seconds" \
    --eval-every 100 --save-every 1000000 --seed 0 2>&1 | tee "$out/default-dflash/training.log"
  rm -rf "$data" "$out/default-dflash/regenerated.pt" "$out/default-dflash/train_state.pt"  # not for models/
  python3 scripts/drafter_stats.py "$out/default-dflash" --target "$target"
fi
if [ -f "$out/default/stats.json" ]; then  # the card, once the target stage ran here
  python3 scripts/write_model_card.py --target "$out/default" --drafter "$out/default-dflash"
fi
if [ -n "${PACK:-}" ]; then
  mkdir -p "$PACK"
  tar -C "$out" -c default default-dflash | split -b 15M - "$PACK/extended.tar."
fi
