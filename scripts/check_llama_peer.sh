#!/usr/bin/env bash
# Does llama.cpp load the random GGUFs of `lucebox bench speed --peer llama.cpp`? (GPU machine, ~3 min with
# .whl/llama-bench-sm90.tar.xz; building llama-bench from source adds ~6 min)
#   scripts/check_llama_peer.sh            tiny GGUFs of each arch, then one real shape per arch
#   REAL="qwen3.6-27b:q4_k_m" scripts/check_llama_peer.sh   pick the real shapes (shape:quant, space separated)
#   LLAMA_ARGS="--repack 0 -t 2" REAL=" " ...   a CPU build (AMX repacking crashes in VMs), tiny files only
# Builds or unpacks llama-bench (scripts/build_llama_cpp.sh; carry .whl with llama-bench-sm90.tar.xz and the
# gguf wheel), writes each GGUF (bench/llama_cpp.write_gguf, timed), runs a short llama-bench on it and prints
# its JSON rows, or llama.cpp's own messages (-v) when the file does not load. Every GGUF is deleted after use.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -z "${GPU_SESSION_SITE:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:. GPU_SESSION_SITE=1
fi
bash scripts/build_llama_cpp.sh || exit 1
bench=.llama/bin/llama-bench
status=0
check() {  # check SHAPE QUANT PROMPT GEN: write (where bench speed would: /dev/shm, else /tmp), run, report
  local shape=$1 quant=$2 prompt=$3 gen=$4 file
  file=$(python3 - "$shape" "$quant" "${PEER_DIR:-}" <<'EOF'
import sys, time
from lucebox.bench import llama_cpp, shapes
shape, quant, given = sys.argv[1:]
cfg = shapes.shape_config(shape)
path = llama_cpp.work_dir(given or None, llama_cpp.expected_file_bytes(cfg, quant)) / f"check-{shape}-{quant}.gguf"
start = time.perf_counter()
size = llama_cpp.write_gguf(cfg, quant, path)
print(f"== {shape} {quant}: wrote {path}, {size / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s",
      file=sys.stderr)
print(path)
EOF
) || { status=1; return; }
  if timeout 300 "$bench" -m "$file" -ngl 99 -fa 1 -p "$prompt" -n "$gen" -r 1 ${LLAMA_ARGS:-} -o json > "$out/check-$shape-$quant.json" \
       2> "$out/check-$shape-$quant.err"; then
    python3 -c "import json, sys; from lucebox.bench.llama_cpp import parse_bench_json as p
r = p(open(sys.argv[1]).read()); print('   llama.cpp:', r['model_type'], r['prefill'], r['decode'])" \
      "$out/check-$shape-$quant.json"
  else
    status=1
    echo "   llama-bench FAILED on $shape $quant; llama.cpp says:"
    timeout 120 "$bench" -m "$file" -ngl 99 -fa 1 -p 16 -n 0 -r 1 ${LLAMA_ARGS:-} -v 2>&1 | grep -v "^llama_model_loader: - kv\|^llama_model_loader: - tensor" | tail -n 25
  fi
  rm -f "$file"
}
for shape in tiny-hybrid tiny-hybrid-moe tiny-moe tiny; do
  check "$shape" q4_k_m 64 16
done
check tiny-hybrid bf16 64 16
check tiny-hybrid-moe iq4_xs 64 16
for sq in ${REAL:-qwen3.6-27b:q4_k_m qwen3.6-35b-a3b:q4_k_m qwen3-30b-a3b:q4_k_m}; do
  check "${sq%%:*}" "${sq##*:}" 512 32
done
exit $status
