# Hybrid (issue 26) modes (sourced by scripts/gpu_session.sh): lucebox against llama.cpp on the same
# shapes (carry .whl: the gguf wheel and llama-bench-sm90.tar.xz for the peer).

hybrid_with_peer() {  # hybrid_with_peer "SHAPES" "QUANTS": bench speed of each with the llama.cpp peer, 560 s shared
  local shapes=$1 quants=$2 n=0 shape quant
  if [ -x .llama/bin/llama-bench ] || [ -f .whl/llama-bench-sm90.tar.xz ]; then  # unpacking takes seconds
    bash scripts/build_llama_cpp.sh > "$out/llama-build.log" 2>&1 || tail -n 5 "$out/llama-build.log"
  else  # building takes ~6 min: a call of its own (scripts/build_llama_cpp.sh with $OUT packs the result)
    echo "== no llama-bench and no .whl/llama-bench-sm90.tar.xz: the llama.cpp peer will be skipped"
  fi
  for shape in $shapes; do for quant in $quants; do n=$((n + 1)); done; done
  for shape in $shapes; do
    for quant in $quants; do
      bench "$shape-$quant" $((560 / n)) --shape "$shape" --quant "$quant" --prompt-lens 4096 --contexts 512 \
        --decode-tokens 64 --repeats 2 --skip spec --peer llama.cpp --peer-timeout $((560 / n / 2))
    done
  done
}

llama_rows() {  # llama_rows SHAPE QUANT SECONDS: llama-bench of a random GGUF of SHAPE, as bench speed's peer runs it
               # (decode depths LLAMA_CONTEXTS, default 512)
  timeout "$3" python3 - "$1" "$2" <<'PY'
import os, subprocess, sys, time
from lucebox.bench import llama_cpp, shapes
shape, quant = sys.argv[1:]
cfg = shapes.shape_config(shape)
path = llama_cpp.work_dir(None, llama_cpp.expected_file_bytes(cfg, quant)) / f"peer-{shape}-{quant}.gguf"
start = time.perf_counter()
size = llama_cpp.write_gguf(cfg, quant, path)
print(f"== llama.cpp {shape} {quant}: GGUF {size / 2**30:.2f} GiB written in {time.perf_counter() - start:.1f} s")
contexts = [int(c) for c in os.environ.get("LLAMA_CONTEXTS", "512").split()]
command = llama_cpp.bench_command(".llama/bin/llama-bench", path, [4096], 64, contexts, 2,
                                  os.environ.get("LLAMA_BENCH_ARGS", "").split())
done = subprocess.run(command, capture_output=True, text=True, check=False)
path.unlink()
if done.returncode:
    print(" ".join(command), done.stderr[-2000:])
    sys.exit(1)
r = llama_cpp.parse_bench_json(done.stdout)
print(" ".join(command))
for row in r["prefill"] + r["decode"]:
    print(f"   llama.cpp {r['model_type']}: {row}")
PY
}

#: hybrid-dense issue 26: bench speed of qwen3.6-27b in q4_k_m, iq4_xs, q8_0, bf16 with --peer llama.cpp (4 steps
#:              of <= 140 s: lucebox ~60-90 s, the GGUF 5-15 s, llama-bench ~30 s; bf16's 50 GB GGUF is skipped
#:              where no disk holds it)
mode_hybrid_dense() { hybrid_with_peer qwen3.6-27b "q4_k_m iq4_xs q8_0 bf16"; }

#: hybrid-moe   the same for qwen3.6-35b-a3b and qwen3-30b-a3b in q4_k_m and iq4_xs
mode_hybrid_moe() { hybrid_with_peer "qwen3.6-35b-a3b qwen3-30b-a3b" "q4_k_m iq4_xs"; }

#: hybrid       SHAPES x QUANTS (env, default: the three shapes x q4_k_m), 560 s shared between the steps;
#:              e.g. SHAPES=qwen3.6-35b-a3b QUANTS="q8_0 bf16"
mode_hybrid() { hybrid_with_peer "${SHAPES:-qwen3.6-27b qwen3.6-35b-a3b qwen3-30b-a3b}" "${QUANTS:-q4_k_m}"; }

#: hybrid-all   one call for a machine without llama-bench (the prebuilt one is too big to carry beside the
#:              tree): llama-bench builds on the CPUs (~6.5 min) while the hybrid GPU tests and lucebox's bench
#:              speed of RUNS (shape:quant, default qwen3.6-27b:q4_k_m qwen3.6-35b-a3b:q4_k_m) run on the GPU;
#:              then llama-bench on the same shapes (random GGUFs, bench/llama_cpp.py), all before 570 s;
#:              PEER=0: no llama.cpp build and rows (a call with less than ~9 min of device time left);
#:              HYBRID_TESTS replaces its test files (SECONDS_TESTS their time, default 110 s)
mode_hybrid_all() {
  local start=$SECONDS peer=${PEER:-1} runs=${RUNS:-qwen3.6-27b:q4_k_m qwen3.6-35b-a3b:q4_k_m} sq left
  [ "$peer" = 0 ] || (nice -n 19 bash scripts/build_llama_cpp.sh > "$out/llama-build.log" 2>&1
                      echo "build exit $?" >> "$out/llama-build.log") &
  # shellcheck disable=SC2086  # HYBRID_TESTS is a list of test files
  run_tests hybrid-tests "${SECONDS_TESTS:-110}" ${HYBRID_TESTS:-tests/model/test_qwen3_5_graphs.py \
    tests/kernels/test_gated_delta.py tests/kernels/test_triton_moe.py}
  for sq in $runs; do
    bench "${sq%%:*}-${sq##*:}" "${SECONDS_RUN:-120}" --shape "${sq%%:*}" --quant "${sq##*:}" --prompt-lens 4096 \
      --contexts 512 --decode-tokens 64 --repeats 2 --skip spec --no-peer
  done
  [ "$peer" = 0 ] && return 0
  while [ $((SECONDS - start)) -lt 450 ] && ! grep -q "build exit" "$out/llama-build.log"; do sleep 5; done
  tail -n 2 "$out/llama-build.log"
  for sq in $runs; do
    left=$((570 - SECONDS + start)); [ "$left" -gt 20 ] || break
    llama_rows "${sq%%:*}" "${sq##*:}" "$left" 2>&1 | tee -a "$out/llama-peer.log" | tail -n 6
  done
}

#: gemma-laguna issue 27: bench speed of gemma4-31b, gemma4-26b-a4b, laguna-xs-33b (random weights, q4_k_m) with
#:              prefill 4096 and decode at 512 and 32768: the decode rows show the KV each sequence holds
#:              (sliding-window layers only their window), 185 s a shape; SHAPES / QUANT / CONTEXTS / REPEATS
#:              override (128K: CONTEXTS="512 131072" REPEATS=1, one shape a call). --no-peer here: their
#:              llama.cpp rows come from RUNS="gemma4-31b:q4_k_m gemma4-26b-a4b:q4_k_m laguna-xs-33b:q4_k_m"
#:              hybrid-all (which builds llama-bench), or SHAPES=... hybrid where llama-bench is unpacked
mode_gemma_laguna() {
  local shape
  for shape in ${SHAPES:-gemma4-31b gemma4-26b-a4b laguna-xs-33b}; do
    # shellcheck disable=SC2086  # CONTEXTS is a list of numbers
    bench "$shape-${QUANT:-q4_k_m}" "${SECONDS_RUN:-185}" --shape "$shape" --quant "${QUANT:-q4_k_m}" \
      --prompt-lens 4096 --contexts ${CONTEXTS:-512 32768} --decode-tokens 64 --repeats "${REPEATS:-2}" \
      --skip spec forced --no-peer
  done
}

#: long-peer    issue 27 in one call: llama-bench builds on the CPUs (~6.5 min) while lucebox decodes RUNS (default
#:              gemma4-26b-a4b, laguna-xs-33b, gemma4-31b in q4_k_m) at LONG_CONTEXTS (default 32768 131072; the
#:              rows show the KV each sequence holds), then llama-bench on RUNS at depths 512 and 32768, all
#:              before 570 s
mode_long_peer() {
  local start=$SECONDS runs=${RUNS:-gemma4-26b-a4b:q4_k_m laguna-xs-33b:q4_k_m gemma4-31b:q4_k_m} sq left
  (nice -n 19 bash scripts/build_llama_cpp.sh > "$out/llama-build.log" 2>&1
   echo "build exit $?" >> "$out/llama-build.log") &
  for sq in $runs; do
    # shellcheck disable=SC2086  # LONG_CONTEXTS is a list of numbers
    bench "${sq%%:*}-${sq##*:}-long" "${SECONDS_RUN:-150}" --shape "${sq%%:*}" --quant "${sq##*:}" --prompt-lens 128 \
      --contexts ${LONG_CONTEXTS:-32768 131072} --decode-tokens 64 --repeats 1 --skip verify forced spec --no-peer
  done
  while [ $((SECONDS - start)) -lt 450 ] && ! grep -q "build exit" "$out/llama-build.log"; do sleep 5; done
  tail -n 2 "$out/llama-build.log"
  for sq in $runs; do
    left=$((570 - SECONDS + start)); [ "$left" -gt 20 ] || break
    LLAMA_CONTEXTS="512 32768" llama_rows "${sq%%:*}" "${sq##*:}" "$left" 2>&1 | tee -a "$out/llama-peer.log" | tail -n 8
  done
}
