#!/usr/bin/env bash
# .whl/ (git-ignored) for the device machine, which reaches no registry: the wheels scripts/gpu_session.sh
# installs (gguf, nvidia-ml-py; fla-core with FLA=1) and llama.cpp's sources for scripts/build_llama_cpp.sh,
# taken from the llama-cpp-python sdist and trimmed to what the build reads (~9 MB packed). A fresh checkout
# lacks them: run this once, then carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps -d .whl gguf nvidia-ml-py fla-core
if [ ! -f .whl/llama-cpp-src.tar.xz ]; then
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$work" llama-cpp-python
  tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  mv "$work"/llama_cpp_python-*/vendor/llama.cpp "$work/lltrim"
  rm -rf "$work/lltrim/"{models,docs,benches,media,.git*}
  tar cJf .whl/llama-cpp-src.tar.xz -C "$work" lltrim
  rm -rf "$work"
fi
ls -la .whl
