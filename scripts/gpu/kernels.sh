# Kernel modes (sourced by scripts/gpu_session.sh): launch configs swept, kernels against torch.

#: kernels      scripts/bench_kernels.py: quantised GEMV rows at M = 1 and 16 (decode, verify), launch configs
#:              (one row: also stages) swept, timed in CUDA graphs, float
#:              and int8 paths (~9 min; MS=1 for the one-row sweep alone, MS="32 64" for batched rows)
mode_kernels() {
  local m
  for m in ${MS:-1 16}; do
    step "kernels-quant-m$m" "${SECONDS_KERNELS:-270}" python3 scripts/bench_kernels.py --only quant --ms $m \
      --sweep --qtypes Q8_0 Q4_K Q6_K --json "$out/kernels-quant-m$m.json"
    grep -E "^\| (kernel|quant_matmul)" "$out/kernels-quant-m$m.log" | cut -c1-900
  done
}

#: tiles        issue 33 items 3 / 6: the bf16 tile tests on the GPU (their PTX), then bench_kernels' quant
#:              sweep of Q4_K and Q6_K at 16 and 64 rows: each float path's best time and error (split
#:              Q6_K too) beside the int8 tiles (~8 min; MS)
mode_tiles() {
  run_tests tiles-tests 150 tests/kernels/test_triton_kernels.py -k "bf16_tiles or bfloat16"
  local m
  for m in ${MS:-16 64}; do
    step "tiles-m$m" "${SECONDS_KERNELS:-200}" python3 scripts/bench_kernels.py --only quant --ms $m --sweep \
      --qtypes Q4_K Q6_K --json "$out/tiles-m$m.json"
    grep -E "^\| (kernel|quant_matmul)" "$out/tiles-m$m.log" | cut -c1-1200
  done
}

#: dp4a-runs    one-row int8 GEMVs: triton_dp4a_runs' tests on the GPU (their PTX), then the kernels (no
#:              reduction across threads in the loop) against the default ones per qwen3-8b matrix with
#:              launch grids (Q4_K, split Q6_K / Q8_0; Q5_K and IQ4_XS against their float kernels;
#:              RUNS_SWEEP=0 skips it, ~4 min), then decode
#:              at 512 on qwen3-8b with LUCEBOX_DP4A_RUNS=0 / 1 alternating, QUANTS (default q4_k_m
#:              iq4_xs, ~4 min; also q8_0 q5_k_m); PROFILE=1: scripts/profile_decode.py of each quant
#:              with the switch off and on (~1 min each)
mode_dp4a_runs() {
  local quant runs turn
  run_tests dp4a-runs-tests 150 tests/kernels/test_int8_activations.py tests/kernels/test_fused_kernels.py \
    -k "runs or int8 or round or gate or rope"  # the PTX paths (prmt, dp4a), the fused rope / gate kernels
  if [ "${RUNS_SWEEP:-1}" = 1 ]; then
    step kernels-runs "${SECONDS_KERNELS:-270}" python3 scripts/bench_kernels.py --only quant --ms 1 --sweep \
      --sweep-paths int8 --qtypes Q4_K Q5_K Q6_K Q8_0 IQ4_XS --json "$out/kernels-runs.json"
    grep -E "^\| (kernel|quant_matmul)" "$out/kernels-runs.log" | cut -c1-900
  fi
  for quant in ${QUANTS:-q4_k_m iq4_xs}; do
    if [ "${PROFILE:-0}" = 1 ]; then
      for runs in 0 1; do
        LUCEBOX_DP4A_RUNS=$runs step "profile-$quant-runs$runs" 120 python3 scripts/profile_decode.py \
          --shape qwen3-8b --quant $quant --context 512 --rows 30
      done
    fi
    turn=0
    for runs in 0 1 0 1; do
      export LUCEBOX_DP4A_RUNS=$runs
      turn=$((turn + 1))
      bench "dp4a-runs-$quant-$turn-runs$runs" 60 --shape qwen3-8b --quant $quant --prompt-lens 128 --contexts 512 \
        --skip verify forced spec peer
    done
  done
  unset LUCEBOX_DP4A_RUNS
}

#: gemv         decode GEMVs with their fused prologues vs the unfused kernels (0.6b and 8b matrices, launch
#:              configs swept), decode-vs-verify logit agreement (scripts/check_decode_numerics.py), then
#:              bench speed 0.6b and 8b at 512
mode_gemv() {
  local shape
  for shape in qwen3-0.6b qwen3-8b; do
    step "gemv-$shape" 150 python3 scripts/bench_kernels.py --only gemv --sweep --shape $shape --json "$out/gemv-$shape.json"
    grep -E "^\| (norm|o |silu|matrix)" "$out/gemv-$shape.log"
  done
  step numerics 150 python3 scripts/check_decode_numerics.py --shape qwen3-0.6b
  grep "^|" "$out/numerics.log"
  bench 06b-bf16 90 --shape qwen3-0.6b --quant bf16 --prompt-lens 512 --contexts 512 --no-peer
  bench 8b-bf16 120 --shape qwen3-8b --quant bf16 --prompt-lens 512 --contexts 512 --no-peer
}

#: sampler      the in-graph sampler by vocabulary size, each Triton search against torch
#:              (scripts/bench_sampler.py), after its tests
mode_sampler() {
  run_tests sampler-tests 120 tests/kernels/test_triton_sampling.py tests/sampling/test_acceptance.py
  step sampler 120 python3 scripts/bench_sampler.py
  grep "^|" "$out/sampler.log"
}

#: attention    paged attention (bf16 KV) at 512 / 4K / 32K with its launch swept (1 and 16 queries: ~3.5 min),
#:              then 256-query prefill chunks on a cached 4K / 16K / 32K (stages swept too; their compiles are
#:              slow: Q_LENS=256 runs them alone); after the attention GPU tests (~1.5 min; ATTENTION_TESTS=0 skips)
mode_attention() {
  # the kernel's GPU tests first (the tall tiles' unmasked interior loop had never run on a GPU)
  [ "${ATTENTION_TESTS:-1}" = 1 ] && run_tests attention-tests 150 tests/kernels/test_paged_attention.py \
    tests/kernels/test_tree_attention.py tests/kernels/test_attention_rounding.py tests/engine/test_graph_attention.py
  # shellcheck disable=SC2086  # Q_LENS is a list
  step attention "${SECONDS_ATTENTION:-360}" python3 scripts/bench_kernels.py --only attention --sweep \
    --cache-types bf16 --q-lens ${Q_LENS:-1 16 256} --json "$out/attention.json"
  grep -E "^\| (kernel|paged_attention)" "$out/attention.log"
}

#: tree-attention  tree verify attention (DDTree): 16/22/32/64-node trees vs chains of the same length vs a
#:              decode, bf16 and q8_0 KV at 512 / 4K / 32K (scripts/bench_tree_attention.py), after its tests
mode_tree_attention() {
  run_tests tree-attention-tests 120 tests/kernels/test_tree_attention.py
  step tree-attention "${SECONDS_TREE_ATTENTION:-240}" python3 scripts/bench_tree_attention.py \
    --cache-types bf16 q8_0 --json "$out/tree-attention.json"
  grep "^|" "$out/tree-attention.log"
}

#: draft-attention  a DFlash draft block's attention over 2K-256K keys: SDPA against split_key_attention at
#:              8K / 16K / 32K-key slices, as graph replays (scripts/bench_draft_attention.py; ~2 min): are
#:              SPLIT_KEYS_ABOVE and KEY_SPLIT right?
mode_draft_attention() {
  step draft-attention "${SECONDS_DRAFT_ATTENTION:-180}" python3 scripts/bench_draft_attention.py \
    --json "$out/draft-attention.json"
  grep "^|" "$out/draft-attention.log"
}
