#!/usr/bin/env bash
# llama.cpp's llama-bench for the H200 (sm_90, CUDA), the peer of `lucebox bench speed --peer llama.cpp`.
#   scripts/build_llama_cpp.sh [DEST]   -> DEST/bin/llama-bench (default .llama)
# Source: the llama.cpp tree vendored in the llama-cpp-python sdist (PyPI), trimmed to what the build reads
# and packed as .whl/llama-cpp-src.tar.xz (git-ignored, carried to the device). A built tree packed as
# .whl/llama-bench-sm90.tar.xz is unpacked instead of building (~6 min saved); with PACK_LLAMA=1 and $OUT set,
# a fresh build is packed there in 15 MB pieces (files come back at most 16 MiB): `cat llama-bench-sm90.tar.xz.*
# > ...`. Off by default: its ~40 MiB crowd a call's results out of the 64 MiB that come back, and it cannot
# travel beside the tracked tree anyway.
set -euo pipefail
dest=${1:-.llama}
if [ -x "$dest/bin/llama-bench" ]; then echo "llama-bench: $dest/bin/llama-bench"; exit 0; fi
if [ -f .whl/llama-bench-sm90.tar.xz ]; then
  mkdir -p "$dest" && tar xJf .whl/llama-bench-sm90.tar.xz -C "$dest"
  echo "llama-bench: unpacked $dest/bin/llama-bench"; exit 0
fi
src=$dest/work  # kept: a build cut off by the call's limit resumes where it stopped on a warm machine
mkdir -p "$src"
[ -d "$src/lltrim" ] || tar xJf .whl/llama-cpp-src.tar.xz -C "$src"
cmake -S "$src/lltrim" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF > "$src/cmake.log"
cmake --build "$src/build" --target llama-bench -j "$(nproc)" > "$src/build.log" 2>&1 || { tail -n 40 "$src/build.log"; exit 1; }
mkdir -p "$dest/bin" && cp "$src/build/bin/llama-bench" "$dest/bin/"
echo "llama-bench: built $dest/bin/llama-bench ($(du -h "$dest/bin/llama-bench" | cut -f1))"
if [ "${PACK_LLAMA:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
  tar cJf "$src/llama-bench-sm90.tar.xz" -C "$dest" bin
  split -b 15M -d "$src/llama-bench-sm90.tar.xz" "$OUT/llama-bench-sm90.tar.xz."
fi
