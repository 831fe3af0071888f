#!/usr/bin/env bash
# One GPU call's worth of work, for the device machine (H200): every step writes its log (and JSON)
# under $OUT and is bounded by `timeout`, so one failing step never loses the others' results.
#   scripts/gpu_session.sh check     GPU tests: CUDA graphs, fused kernels, Triton kernels, model (~5.5 min)
#   scripts/gpu_session.sh bench     bench speed: qwen3-8b bf16, q8_0, q4_k_m, qwen3-0.6b bf16 (~6 min;
#                                    within one device call's 600 s)
#   scripts/gpu_session.sh spec      bench spec on the bundled pair (models/default + default-dflash), 15 repeats
#                                    (~100 s: 120 requests a row, what the per-request interval needs to
#                                    resolve the 5% bound)
#   scripts/gpu_session.sh kernels   scripts/bench_kernels.py: quantised GEMV rows at M = 1 and 16 (decode,
#                                    verify), launch configs (one row: also stages) swept, timed in CUDA
#                                    graphs (~9 min; MS=1 for the one-row sweep alone)
#   scripts/gpu_session.sh gemv      decode GEMVs with their fused prologues vs the unfused kernels (0.6b and
#                                    8b matrices, launch configs swept), decode-vs-verify logit agreement
#                                    (scripts/check_decode_numerics.py), then bench speed 0.6b and 8b at 512
#   scripts/gpu_session.sh overlap   bench speed decode with and without --async-decode, 0.6b and 8b at 512 (~4 min)
#   scripts/gpu_session.sh pdl       decode with programmatic dependent launch on and off (LUCEBOX_PDL), 0.6b and
#                                    8b bf16 and 8b Q4_K_M at 512, alternating (~4 min)
#   scripts/gpu_session.sh int8      int8 activations (kernels/triton_quant_int8.py): their GPU tests, decode-vs-verify
#                                    agreement (q4_k_m), bench speed q4_k_m / q8_0 with and without
#                                    LUCEBOX_INT8_ACTIVATIONS, then the M = 16 kernels swept (~8 min)
#   scripts/gpu_session.sh quant     qwen3-8b q4_k_m and q8_0: bench speed (decode, verify, forced acceptance), then
#                                    scripts/profile_decode.py of each step (~6 min)
#   scripts/gpu_session.sh pdl-tiles q4_k_m and q8_0 verify with and without LUCEBOX_PDL_TILES (~3 min)
#   scripts/gpu_session.sh profile   host time per engine-step section, plain vs speculative engines,
#                                    torch.profiler tables of DFlash passes at T=0 and T=1, and one graph
#                                    step's time by verify width and output (scripts/profile_spec_steps.py)
#   scripts/gpu_session.sh idle      a DFlash engine that never drafts against plain decoding, with and
#                                    without its taps (profile_spec_steps.py --idle-overhead, ~2 min)
#   scripts/gpu_session.sh sampler   the in-graph sampler by vocabulary size, each Triton search against
#                                    torch (scripts/bench_sampler.py), after its tests
#   scripts/gpu_session.sh attention paged attention (bf16 KV) at 512 / 4K / 32K with its launch swept:
#                                    is the split heuristic (>= 256 tokens a split) right at short contexts?
#   scripts/gpu_session.sh drafter   the default drafter (scripts/train_default_drafter.sh, ~7 min)
#   scripts/gpu_session.sh compare   bench speed (prefill 512 / 4K, decode and verify at 512) of the tree in .before/
#                                    (e.g. `git archive COMMIT lucebox | tar -x -C .before`, carried) against this
#                                    one, alternating in one call: 0.6b bf16, 8b q4_k_m, 8b bf16 (~8 min)
#   scripts/gpu_session.sh hybrid-dense  issue 26: bench speed of qwen3.6-27b in q4_k_m, iq4_xs, q8_0, bf16 with
#                                    --peer llama.cpp (4 steps of <= 140 s: lucebox ~60-90 s, the GGUF 5-15 s,
#                                    llama-bench ~30 s; bf16's 50 GB GGUF is skipped where no disk holds it)
#   scripts/gpu_session.sh hybrid-moe    the same for qwen3.6-35b-a3b and qwen3-30b-a3b in q4_k_m and iq4_xs
#   scripts/gpu_session.sh hybrid        SHAPES x QUANTS (env, default: the three shapes x q4_k_m), 560 s shared
#                                    between the steps; e.g. SHAPES=qwen3.6-35b-a3b QUANTS="q8_0 bf16"
#                                    (carry .whl: the gguf wheel and llama-bench-sm90.tar.xz for the peer)
#   scripts/gpu_session.sh hybrid-all    one call for a machine without llama-bench (the prebuilt one is too big to carry
#                                    beside the tree): llama-bench builds on the CPUs (~6.5 min) while the hybrid GPU
#                                    tests and lucebox's bench speed of RUNS (shape:quant, default qwen3.6-27b:q4_k_m
#                                    qwen3.6-35b-a3b:q4_k_m) run on the GPU; then llama-bench on the same shapes
#                                    (random GGUFs, bench/llama_cpp.py), all before 570 s
#   scripts/gpu_session.sh gemma-laguna  issue 27: bench speed of gemma4-31b, gemma4-26b-a4b, laguna-xs-33b (random
#                                    weights, q4_k_m) with prefill 4096 and decode at 512 and 32768: the decode rows show
#                                    the KV each sequence holds (sliding-window layers only their window), 185 s a
#                                    shape; SHAPES / QUANT / CONTEXTS / REPEATS override (128K: CONTEXTS="512 131072"
#                                    REPEATS=1, one shape a call). --no-peer: the llama.cpp peer needs gemma4 / laguna
#                                    GGUF writers in bench/llama_cpp.py, which do not exist yet
# The device lacks the gguf package: keep its wheel in .whl/ (git-ignored) and pass carry [".whl"].
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -z "${GPU_SESSION_SITE:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:. GPU_SESSION_SITE=1  # a nested call installs nothing again
fi
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run, log to $out/NAME.log, report the exit status
  local name=$1 seconds=$2; shift 2
  timeout --signal=INT --kill-after=20 "$seconds" "$@" > "$out/$name.log" 2>&1  # INT: the trainer saves its weights
  echo "== $name: exit $? ($(tail -n 1 "$out/$name.log" | cut -c1-160))"
}
bench() {  # bench NAME SECONDS ARGS...: lucebox bench speed with --json, its table shown
  local name=$1 seconds=$2; shift 2
  step "$name" "$seconds" python3 -m lucebox.cli bench speed --json "$out/$name.json" "$@"
  sed -n '/^| measure/,$p' "$out/$name.log"
}
hybrid() {  # hybrid "SHAPES" "QUANTS": bench speed of each with the llama.cpp peer, 560 s shared between them
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
  timeout "$3" python3 - "$1" "$2" <<'PY'
import os, subprocess, sys, time
from lucebox.bench import llama_cpp, shapes
shape, quant = sys.argv[1:]
cfg = shapes.shape_config(shape)
path = llama_cpp.work_dir(None, llama_cpp.expected_file_bytes(cfg, quant)) / f"peer-{shape}-{quant}.gguf"
start = time.perf_counter()
size = llama_cpp.write_gguf(cfg, quant, path)
print(f"== llama.cpp {shape} {quant}: GGUF {size / 2**30:.2f} GiB written in {time.perf_counter() - start:.1f} s")
command = llama_cpp.bench_command(".llama/bin/llama-bench", path, [4096], 64, [512], 2, os.environ.get("LLAMA_BENCH_ARGS", "").split())
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
case "${1:-check}" in
  check)
    step gpu-tests "${SECONDS_CHECK:-540}" python3 -m pytest -rs tests/engine/test_cuda_graphs.py tests/kernels \
      tests/model/test_model.py tests/train/test_dense_lm.py tests/sampling/test_acceptance.py \
      tests/engine/test_step_plan.py tests/engine/test_sliding_window.py
    tail -n 30 "$out/gpu-tests.log" ;;
  bench)
    bench 8b-bf16 240 --shape qwen3-8b --quant bf16
    bench 8b-q8_0 90 --shape qwen3-8b --quant q8_0 --prompt-lens 512 --contexts 512 --no-peer
    bench 8b-q4_k_m 90 --shape qwen3-8b --quant q4_k_m --prompt-lens 512 --contexts 512 --no-peer
    bench 06b-bf16 90 --shape qwen3-0.6b --quant bf16 --prompt-lens 512 --contexts 512 ;;
  spec)
    # SPEC_ARGS adds flags, e.g. SPEC_ARGS=--no-adaptive
    step spec "${SECONDS_SPEC:-400}" python3 -m lucebox.cli bench spec --draft models/default-dflash --repeats 15 \
      --json "$out/spec.json" ${SPEC_ARGS:-}
    sed -n '/^| /,$p' "$out/spec.log" ;;
  kernels)  # quantised GEMV rows for decode (M = 1) and a 15-draft verify (M = 16), launch configs swept
    for m in ${MS:-1 16}; do  # MS=1: the one-row sweep alone
      step "kernels-quant-m$m" "${SECONDS_KERNELS:-270}" python3 scripts/bench_kernels.py --only quant --ms $m \
        --sweep --qtypes Q8_0 Q4_K Q6_K --json "$out/kernels-quant-m$m.json"
      grep -E "^\| (kernel|quant_matmul)" "$out/kernels-quant-m$m.log" | cut -c1-900
    done ;;
  gemv)
    for shape in qwen3-0.6b qwen3-8b; do
      step "gemv-$shape" 150 python3 scripts/bench_kernels.py --only gemv --sweep --shape $shape --json "$out/gemv-$shape.json"
      grep -E "^\| (norm|o |silu|matrix)" "$out/gemv-$shape.log"
    done
    step numerics 150 python3 scripts/check_decode_numerics.py --shape qwen3-0.6b
    grep "^|" "$out/numerics.log"
    bench 06b-bf16 90 --shape qwen3-0.6b --quant bf16 --prompt-lens 512 --contexts 512 --no-peer
    bench 8b-bf16 120 --shape qwen3-8b --quant bf16 --prompt-lens 512 --contexts 512 --no-peer ;;
  overlap)  # the GPU tests of overlapped decoding first, then the same decode with and without it
    step overlap-tests 120 python3 -m pytest -q tests/engine/test_cuda_graphs.py -k overlapped
    tail -n 2 "$out/overlap-tests.log"
    for shape in qwen3-0.6b qwen3-8b; do
      for mode in sync async; do
        flag=$([ $mode = async ] && echo --async-decode || echo --no-async-decode)
        bench "$shape-$mode" 100 --shape $shape --quant bf16 --prompt-lens 512 --contexts 512 \
          --skip prefill forced spec peer $flag
      done
    done ;;
  pdl)  # the same decode with and without programmatic dependent launch, alternating
    for shape_quant in "qwen3-0.6b bf16" "qwen3-8b bf16" "qwen3-8b q4_k_m"; do
      set -- $shape_quant
      for run in 1 2; do
        for pdl in 1 0; do
          LUCEBOX_PDL=$pdl bench "$1-$2-pdl$pdl-$run" 90 --shape $1 --quant $2 --prompt-lens 512 --contexts 512 \
            --skip prefill forced spec peer
        done
      done
    done ;;
  int8)  # int8 activations (kernels/triton_quant_int8.py): tests, agreement, decode and verify on and off, M = 16 kernels
    step int8-tests 150 python3 -m pytest -rs tests/kernels/test_triton_kernels.py -k "int8 or rounded or split_rows or model_forward"
    tail -n 2 "$out/int8-tests.log"
    step int8-numerics 120 python3 scripts/check_decode_numerics.py --shape qwen3-8b --quant q4_k_m --prompt-len 256 --tokens 32
    grep "^|" "$out/int8-numerics.log"
    for quant in q4_k_m q8_0; do
      for int8 in 1 0; do
        LUCEBOX_INT8_ACTIVATIONS=$int8 bench "8b-$quant-int8-$int8" 90 --shape qwen3-8b --quant $quant \
          --prompt-lens 512 --contexts 512 --skip prefill forced spec peer
      done
    done
    step int8-kernels "${SECONDS_KERNELS:-150}" python3 scripts/bench_kernels.py --only quant --ms 16 --sweep \
      --qtypes Q4_K Q6_K Q8_0 --json "$out/int8-kernels.json"
    grep -E "^\| (kernel|quant_matmul)" "$out/int8-kernels.log" | cut -c1-600 ;;
  quant)  # where quantised decode stands: bench speed q4_k_m / q8_0 (decode, verify, forced), then a profile of each step
    for quant in q4_k_m q8_0; do
      bench "8b-$quant" 100 --shape qwen3-8b --quant $quant --prompt-lens 512 --contexts 512 --skip prefill spec peer
    done
    for quant in q4_k_m q8_0; do
      step "profile-$quant" 120 python3 scripts/profile_decode.py --shape qwen3-8b --quant $quant --context 512
      grep -E "^forward|device kernels per forward" "$out/profile-$quant.log"
      sed -n '/one graph replay/,$p' "$out/profile-$quant.log" | head -n 24 | cut -c1-160
    done ;;
  pdl-tiles)  # verify (tensor-core quant products) launched with and without PDL
    for quant in q4_k_m q8_0; do
      for tiles in 0 1; do
        LUCEBOX_PDL_TILES=$tiles bench "8b-$quant-pdl-tiles-$tiles" 60 --shape qwen3-8b --quant $quant \
          --prompt-lens 512 --contexts 512 --skip prefill decode forced spec peer
      done
    done ;;
  profile)
    step profile "${SECONDS_PROFILE:-240}" python3 scripts/profile_spec_steps.py --trace dflash:0 --trace dflash:1
    grep "pass 1" "$out/profile.log"
    step step-costs 120 python3 scripts/profile_spec_steps.py --step-costs
    grep "^|" "$out/step-costs.log" ;;
  idle)
    step idle "${SECONDS_IDLE:-240}" python3 scripts/profile_spec_steps.py --idle-overhead
    grep "plain (" "$out/idle.log" ;;
  sampler)
    step sampler-tests 120 python3 -m pytest -q tests/kernels/test_triton_sampling.py tests/sampling/test_acceptance.py
    tail -n 2 "$out/sampler-tests.log"
    step sampler 120 python3 scripts/bench_sampler.py
    grep "^|" "$out/sampler.log" ;;
  attention)  # decode / verify attention (bf16 KV) at 512 / 4K / 32K, split counts and tiles swept
    step attention "${SECONDS_ATTENTION:-240}" python3 scripts/bench_kernels.py --only attention --sweep \
      --cache-types bf16 --json "$out/attention.json"
    grep -E "^\| (kernel|paged_attention)" "$out/attention.log" ;;
  compare)  # a restructure's before/after: the same benches, alternating trees, in one call
    ln -sfn ../models .before/models
    for sq in ${COMPARE:-qwen3-0.6b:bf16 qwen3-8b:q4_k_m qwen3-8b:bf16}; do  # COMPARE picks shape:quant pairs
      set -- ${sq/:/ }
      for tree in before after; do
        dir=.; [ $tree = before ] && dir=.before
        (cd $dir && bench "$1-$2-$tree" 150 --shape $1 --quant $2 --prompt-lens 512 4096 --contexts 512 \
          --skip forced spec peer)
      done
    done ;;
  hybrid-all)
    start=$SECONDS
    peer=${PEER:-1}  # PEER=0: no llama.cpp build and rows (a call with less than ~9 min of device time left)
    [ "$peer" = 0 ] || (nice -n 19 bash scripts/build_llama_cpp.sh > "$out/llama-build.log" 2>&1
                        echo "build exit $?" >> "$out/llama-build.log") &
    step hybrid-tests "${SECONDS_TESTS:-110}" python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_qwen3_5_graphs.py \
      tests/kernels/test_gated_delta.py tests/kernels/test_triton_moe.py
    grep -E "passed|failed|^FAILED|^ERROR" "$out/hybrid-tests.log" | tail -n 12
    runs=${RUNS:-qwen3.6-27b:q4_k_m qwen3.6-35b-a3b:q4_k_m}
    for sq in $runs; do
      bench "${sq%%:*}-${sq##*:}" "${SECONDS_RUN:-120}" --shape "${sq%%:*}" --quant "${sq##*:}" --prompt-lens 4096 --contexts 512 \
        --decode-tokens 64 --repeats 2 --skip spec --no-peer
    done
    [ "$peer" = 0 ] && exit 0
    while [ $((SECONDS - start)) -lt 450 ] && ! grep -q "build exit" "$out/llama-build.log"; do sleep 5; done
    tail -n 2 "$out/llama-build.log"
    for sq in $runs; do
      left=$((570 - SECONDS + start)); [ "$left" -gt 20 ] || break
      llama_rows "${sq%%:*}" "${sq##*:}" "$left" 2>&1 | tee -a "$out/llama-peer.log" | tail -n 6
    done ;;
  hybrid-dense) hybrid qwen3.6-27b "q4_k_m iq4_xs q8_0 bf16" ;;
  hybrid-moe) hybrid "qwen3.6-35b-a3b qwen3-30b-a3b" "q4_k_m iq4_xs" ;;
  hybrid) hybrid "${SHAPES:-qwen3.6-27b qwen3.6-35b-a3b qwen3-30b-a3b}" "${QUANTS:-q4_k_m}" ;;
  gemma-laguna)
    for shape in ${SHAPES:-gemma4-31b gemma4-26b-a4b laguna-xs-33b}; do
      # shellcheck disable=SC2086  # CONTEXTS is a list of numbers
      bench "$shape-${QUANT:-q4_k_m}" "${SECONDS_RUN:-185}" --shape "$shape" --quant "${QUANT:-q4_k_m}" \
        --prompt-lens 4096 --contexts ${CONTEXTS:-512 32768} --decode-tokens 64 --repeats "${REPEATS:-2}" \
        --skip spec forced --no-peer
    done ;;
  drafter)
    step drafter 570 bash scripts/train_default_drafter.sh "$out/default-dflash" "${SECONDS_TRAIN:-300}"
    rm -f "$out/default-dflash/train_state.pt" "$out/default-dflash/regenerated.pt"
    tr '\r' '\n' < "$out/drafter.log" | grep -E "tau|steps|wrote|Error|error" | tail -n 20 ;;
  *) echo "usage: $0 check|bench|spec|kernels|gemv|overlap|pdl|int8|quant|pdl-tiles|profile|idle|sampler|attention|drafter|hybrid|hybrid-dense|hybrid-moe|gemma-laguna" >&2; exit 2 ;;
esac
