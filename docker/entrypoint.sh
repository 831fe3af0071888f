#!/bin/sh
# The images' command: `lucebox serve` on every interface, port 8000. LUCEBOX_MODEL picks the model
# (a directory or .gguf under the /models volume, or a hub id); empty serves the bundled default
# model. Arguments are passed on after these flags, and a later flag wins over an earlier one:
#   docker run ... IMAGE --max-model-len 8192 --api-key sekret
set -eu
if [ -n "${LUCEBOX_MODEL:-}" ]; then
    exec lucebox serve --host 0.0.0.0 --port 8000 --model "$LUCEBOX_MODEL" "$@"
fi
exec lucebox serve --host 0.0.0.0 --port 8000 "$@"
