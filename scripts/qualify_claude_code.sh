#!/usr/bin/env bash
# Qualify the real Claude Code against lucebox serve on the bundled model (or --model ...): the full
# check set (tool round trip, streaming, reasoning, long prompt, interrupted request). Its first prompt
# is ~38K tokens, minutes of prefill on a CPU, so CI does not run it; record the table in README.
# Usage: scripts/qualify_claude_code.sh [--out DIR] [--model M] [--max-model-len N] [--short]
# Claude Code comes from npm; when `claude` is not on PATH it is installed into $LUCEBOX_CLIENTS
# (default ~/.cache/lucebox/clients), outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${LUCEBOX_CLIENTS:-$HOME/.cache/lucebox/clients}"
export PATH="$prefix/node_modules/.bin:$PATH"
if ! command -v claude >/dev/null; then
    npm install --prefix "$prefix" @anthropic-ai/claude-code
fi
claude --version
start=$(date +%s)
python -m lucebox.cli qualify claude-code "$@"
echo "claude-code qualification took $(( $(date +%s) - start )) s"
