# Bench modes (sourced by scripts/gpu_session.sh): lucebox bench speed / spec rows on the H200.

#: bench        bench speed: qwen3-8b bf16, q8_0, q4_k_m, qwen3-0.6b bf16 (~6 min; within one call's 600 s)
mode_bench() {
  bench 8b-bf16 240 --shape qwen3-8b --quant bf16
  bench 8b-q8_0 90 --shape qwen3-8b --quant q8_0 --prompt-lens 512 --contexts 512 --no-peer
  bench 8b-q4_k_m 90 --shape qwen3-8b --quant q4_k_m --prompt-lens 512 --contexts 512 --no-peer
  bench 06b-bf16 90 --shape qwen3-0.6b --quant bf16 --prompt-lens 512 --contexts 512
}

#: kv-pool      issue 30 (KVFlash): bench kv-pool, qwen3-8b bf16, an 8192-token pool against the full KV at
#:              8K / 32K / 128K and the pool alone at 256K: prefill s, decode tok/s, device and host KV (~5 min);
#:              KV_POOL_ARGS adds or overrides flags, e.g. "--shape qwen3.6-27b --quant q4_k_m"
mode_kv_pool() {
  step kv-pool "${SECONDS_KV_POOL:-540}" python3 -m lucebox.cli bench kv-pool --shape qwen3-8b --quant bf16 \
    --contexts 8192 32768 131072 262144 --full-contexts 8192 32768 131072 --pool-tokens 8192 --no-progress \
    --json "$out/kv-pool.json" ${KV_POOL_ARGS:-}
  sed -n '/^| context/,$p' "$out/kv-pool.log"
}

#: kv-pool-draft  issue 30's drafter row: bench kv-pool, qwen3-8b bf16 with a random 5-layer DFlash drafter,
#:              speculative tok/s at 8K and 128K with --draft-kv-pool-tokens 4096 and without (target KV
#:              whole: lossless), beside the target pool at 8K / 128K (~5 min); KV_POOL_ARGS as kv-pool
mode_kv_pool_draft() {
  step kv-pool-draft "${SECONDS_KV_POOL:-540}" python3 -m lucebox.cli bench kv-pool --shape qwen3-8b --quant bf16 \
    --contexts 8192 131072 --full-contexts --draft-pool-tokens 4096 --draft-contexts 8192 131072 --no-progress \
    --json "$out/kv-pool-draft.json" ${KV_POOL_ARGS:-}
  sed -n '/^| context/,$p' "$out/kv-pool-draft.log"
}

#: device-map   issue 31: qwen3-8b bf16 split cuda:0 + cpu at several split points (prefill and decode rates,
#:              beside the whole model through graphs and eagerly), and a DFlash drafter on the CPU (~6 min)
mode_device_map() {
  step device-map "${SECONDS_DEVICE_MAP:-560}" python3 scripts/bench_device_map.py --json "$out/device-map.json" \
    ${DEVICE_MAP_ARGS:-}
  sed -n '/^| row/,$p' "$out/device-map.log"
}

#: tree-verify  issue 28's bound: bench speed's verify phase with DDTree verifies of 16/22/32/63 nodes (CUDA-graph
#:              tree buckets) against the decode forward, qwen3-8b bf16 and q4_k_m at 512 (~3 min)
mode_tree_verify() {
  local quant
  for quant in bf16 q4_k_m; do
    bench "tree-verify-$quant" 200 --shape qwen3-8b --quant $quant --contexts 512 --prompt-lens 512 \
      --skip prefill forced spec peer --tree-nodes 16 22 32 63
  done
}

#: spec         bench spec on the bundled pair (models/default + default-dflash), 15 repeats (~100 s: 120
#:              requests a row, what the per-request interval needs to resolve the 5% bound); SPEC_ARGS adds
#:              flags, e.g. SPEC_ARGS=--no-adaptive
mode_spec() {
  step spec "${SECONDS_SPEC:-400}" python3 -m lucebox.cli bench spec --draft models/default-dflash --repeats 15 \
    --json "$out/spec.json" ${SPEC_ARGS:-}
  sed -n '/^| /,$p' "$out/spec.log"
}

#: overlap      bench speed decode with and without --async-decode, 0.6b and 8b at 512, after the
#:              overlapped-decoding GPU tests (~4 min)
mode_overlap() {
  run_tests overlap-tests 120 tests/engine/test_overlapped_decoding.py
  local shape mode flag
  for shape in qwen3-0.6b qwen3-8b; do
    for mode in sync async; do
      flag=$([ $mode = async ] && echo --async-decode || echo --no-async-decode)
      bench "$shape-$mode" 100 --shape $shape --quant bf16 --prompt-lens 512 --contexts 512 \
        --skip prefill forced spec peer $flag
    done
  done
}

#: pdl          decode with programmatic dependent launch on and off (LUCEBOX_PDL), 0.6b and 8b bf16 and 8b
#:              Q4_K_M at 512, alternating (~4 min)
mode_pdl() {
  local shape_quant run pdl
  for shape_quant in "qwen3-0.6b bf16" "qwen3-8b bf16" "qwen3-8b q4_k_m"; do
    set -- $shape_quant
    for run in 1 2; do
      for pdl in 1 0; do
        LUCEBOX_PDL=$pdl bench "$1-$2-pdl$pdl-$run" 90 --shape $1 --quant $2 --prompt-lens 512 --contexts 512 \
          --skip prefill forced spec peer
      done
    done
  done
}

#: pdl-tiles    q4_k_m and q8_0 verify (tensor-core quant products) with and without LUCEBOX_PDL_TILES (~3 min)
mode_pdl_tiles() {
  local quant tiles
  for quant in q4_k_m q8_0; do
    for tiles in 0 1; do
      LUCEBOX_PDL_TILES=$tiles bench "8b-$quant-pdl-tiles-$tiles" 60 --shape qwen3-8b --quant $quant \
        --prompt-lens 512 --contexts 512 --skip prefill decode forced spec peer
    done
  done
}

#: int8         int8 activations (kernels/triton_quant_int8.py): their GPU tests, decode-vs-verify agreement
#:              (q4_k_m), bench speed q4_k_m / q8_0 with and without LUCEBOX_INT8_ACTIVATIONS, then the
#:              M = 16 kernels swept (~8 min)
mode_int8() {
  run_tests int8-tests 150 tests/kernels/test_triton_kernels.py tests/kernels/test_int8_activations.py -k "int8 or rounded or split_rows or model_forward"
  step int8-numerics 120 python3 scripts/check_decode_numerics.py --shape qwen3-8b --quant q4_k_m --prompt-len 256 --tokens 32
  grep "^|" "$out/int8-numerics.log"
  local quant int8
  for quant in q4_k_m q8_0; do
    for int8 in 1 0; do
      LUCEBOX_INT8_ACTIVATIONS=$int8 bench "8b-$quant-int8-$int8" 90 --shape qwen3-8b --quant $quant \
        --prompt-lens 512 --contexts 512 --skip prefill forced spec peer
    done
  done
  step int8-kernels "${SECONDS_KERNELS:-150}" python3 scripts/bench_kernels.py --only quant --ms 16 --sweep \
    --qtypes Q4_K Q6_K Q8_0 --json "$out/int8-kernels.json"
  grep -E "^\| (kernel|quant_matmul)" "$out/int8-kernels.log" | cut -c1-600
}

#: quant        qwen3-8b q4_k_m and q8_0: bench speed (decode, verify, forced acceptance), then
#:              scripts/profile_decode.py of each step (~6 min)
mode_quant() {
  local quant
  for quant in q4_k_m q8_0; do
    bench "8b-$quant" 100 --shape qwen3-8b --quant $quant --prompt-lens 512 --contexts 512 --skip prefill spec peer
  done
  for quant in q4_k_m q8_0; do
    step "profile-$quant" 120 python3 scripts/profile_decode.py --shape qwen3-8b --quant $quant --context 512
    grep -E "^forward|device kernels per forward" "$out/profile-$quant.log"
    sed -n '/one graph replay/,$p' "$out/profile-$quant.log" | head -n 24 | cut -c1-160
  done
}

#: compare      bench speed (prefill 512 / 4K, decode and verify at 512) of the tree in .before/ (e.g.
#:              `git archive COMMIT lucebox | tar -x -C .before`, carried) against this one, alternating in
#:              one call; COMPARE picks shape:quant pairs (default 0.6b bf16, 8b q4_k_m, 8b bf16; ~8 min);
#:              COMPARE_ARGS replaces the bench flags, e.g. "--prompt-lens 512 --prefix-lens 4096 16384
#:              --suffix-lens 256 --skip verify forced spec peer" (a turn on a cached prefix)
mode_compare() {
  local sq tree dir
  ln -sfn ../models .before/models
  for sq in ${COMPARE:-qwen3-0.6b:bf16 qwen3-8b:q4_k_m qwen3-8b:bf16}; do
    set -- ${sq/:/ }
    for tree in before after; do
      dir=.; [ $tree = before ] && dir=.before
      # shellcheck disable=SC2086  # COMPARE_ARGS is a list of flags
      (cd $dir && bench "$1-$2-$tree" 150 --shape $1 --quant $2 --contexts 512 \
        ${COMPARE_ARGS:---prompt-lens 512 4096 --skip forced spec peer})
    done
  done
}

#: setting      bench speed decode at 512 with an environment switch off and on, alternating in one call:
#:              SETTING names it (default LUCEBOX_PDL_PREFETCH), COMPARE the shape:quant pairs (default 0.6b
#:              bf16, 8b bf16, 8b q4_k_m), two rounds (~4 min)
mode_setting() {
  local sq value round name=${SETTING:-LUCEBOX_PDL_PREFETCH}
  for sq in ${COMPARE:-qwen3-0.6b:bf16 qwen3-8b:bf16 qwen3-8b:q4_k_m}; do
    set -- ${sq/:/ }
    for round in 1 2; do
      for value in 0 1; do
        export "$name=$value"
        bench "$1-$2-$value-r$round" 120 --shape $1 --quant $2 --contexts 512 --skip prefill verify forced spec peer \
          | grep -E '^(==|\| decode)'
      done
    done
  done
  unset "$name"
}

#: short-prefill  issue 33 item 1: bench speed TTFT of 128/256/512 new tokens fresh and on a cached 4K / 16K
#:              prefix (its cached-token count checked), decode at 512 with joules per token, on qwen3-8b bf16
#:              and q4_k_m and qwen3-0.6b bf16; then scripts/profile_prefill.py of one 256-token suffix on a
#:              cached 16K prefix (8b) and one fresh 512-token prompt (0.6b): top ops, syncs (~8 min; PEER=1
#:              adds llama-bench's pp N at depth P, needs .llama/bin/llama-bench carried, and more time)
mode_short_prefill() {
  local sq peer=(--skip verify forced spec peer)
  [ "${PEER:-0}" = 1 ] && peer=(--skip verify forced spec --peer llama.cpp)
  for sq in qwen3-8b:bf16:130 qwen3-8b:q4_k_m:130 qwen3-0.6b:bf16:80; do  # shape:quant:seconds
    IFS=: read -r shape quant seconds <<< "$sq"
    set -- $shape $quant
    bench "short-prefill-$1-$2" "$seconds" --shape $1 --quant $2 --prompt-lens 128 256 512 \
      --contexts 512 --prefix-lens 4096 16384 --suffix-lens 128 256 512 "${peer[@]}"
  done
  for sq in qwen3-8b:bf16:16384:256 qwen3-8b:q4_k_m:16384:256 qwen3-0.6b:bf16:0:512; do
    IFS=: read -r shape quant prefix tokens <<< "$sq"
    step "profile-prefill-$shape-$quant" 55 python3 scripts/profile_prefill.py --shape $shape --quant $quant \
      --prefix-len $prefix --tokens $tokens --rows 15
    sed -n '1p;/top operators by device time/,/^$/p;/host-device syncs/,$p' \
      "$out/profile-prefill-$shape-$quant.log" | cut -c1-200 | head -n 45
  done
}

#: prefill-graphs  issue 33 item 1: one-sequence prefill through CUDA graphs (--prefill-graphs) against eager,
#:              alternating in one call: TTFT of 128/512/1K/2K-token prompts and of 128/256 tokens on a cached
#:              4K prefix, qwen3-0.6b bf16 and qwen3-8b bf16 / q4_k_m, after its GPU test (~6 min); RUNS picks
#:              shape:quant pairs, e.g. RUNS="qwen3.6-27b:q4_k_m qwen3.6-35b-a3b:q4_k_m" (hybrids: DeltaNet token by token)
mode_prefill_graphs() {
  local sq graphs
  run_tests prefill-graphs-tests 90 tests/engine/test_prefill_graphs.py tests/model/test_qwen3_5_prefill_graphs.py
  for sq in ${RUNS:-qwen3-0.6b:bf16 qwen3-8b:bf16 qwen3-8b:q4_k_m}; do
    for graphs in --no-prefill-graphs --prefill-graphs; do
      bench "prefill-graphs-${sq/:/-}$([ $graphs = --prefill-graphs ] && echo -on)" 80 --shape ${sq%%:*} --quant ${sq##*:} --prompt-lens 128 512 1024 2048 \
        --contexts 512 --prefix-lens 4096 --suffix-lens 128 256 --skip verify forced spec peer $graphs
    done
  done
}

#: hybrid-buckets  hybrids' prefill: eager, graph buckets whose DeltaNet rows step token by token, and buckets
#:              taking the chunked rule (LUCEBOX_BUCKET_CHUNKS=1), in one call: TTFT of 128/512/1K/2K-token
#:              prompts and 256 tokens on a cached 4K prefix, qwen3.6-27b q4_k_m (RUNS picks shape:quant
#:              pairs); run with FLA=1 for fla-core's chunk kernel (~6 min + fla's first compile)
mode_hybrid_buckets() {
  local sq
  run_tests hybrid-buckets-tests 120 tests/model/test_qwen3_5_prefill_graphs.py
  for sq in ${RUNS:-qwen3.6-27b:q4_k_m}; do
    for how in eager steps chunks; do
      local flags=(--prefill-graphs) chunks=0
      [ $how = eager ] && flags=(--no-prefill-graphs)
      [ $how = chunks ] && chunks=1
      export LUCEBOX_BUCKET_CHUNKS=$chunks
      bench "hybrid-buckets-${sq/:/-}-$how" 150 --shape ${sq%%:*} --quant ${sq##*:} \
        --prompt-lens 128 512 1024 2048 --contexts 512 --decode-tokens 32 --prefix-lens 4096 --suffix-lens 256 \
        --skip verify forced spec peer "${flags[@]}"
    done
  done
  unset LUCEBOX_BUCKET_CHUNKS
}

#: throughput   issue 33 item 6: bench throughput on qwen3-8b bf16 and q4_k_m at 1/8/32/64 sequences (prompt
#:              128, 64 out), plain and with forced-acceptance speculation (4 drafts a step, each sequence's own
#:              greedy continuation: random weights leave n-gram lookup nothing), against each batch's limit (~8 min);
#:              QUANTS picks quants; THROUGHPUT_ARGS adds flags, e.g. "--concurrency 1 8 32 64 128"
mode_throughput() {
  local quant
  for quant in ${QUANTS:-bf16 q4_k_m}; do
    step "throughput-8b-$quant" "${SECONDS_THROUGHPUT:-250}" python3 -m lucebox.cli bench throughput \
      --shape qwen3-8b --quant $quant --concurrency 1 8 32 64 --cuda-graph-max-batch 64 --spec-method forced \
      --no-hit-rate --json "$out/throughput-8b-$quant.json" ${THROUGHPUT_ARGS:-}
    sed -n '/^model /p;/^| concurrent/,/^$/p' "$out/throughput-8b-$quant.log"
  done
}

#: pflash       issue 29: bench prefill (exact vs scored TTFT, scorer qwen3-0.6b, target qwen3-8b bf16, 32K / 128K,
#:              keep 0.1 / 0.2; the scorer's default window), the same at 128K keep 0.1 with a dense scorer pass
#:              and with 16K-token scorer forwards, then scripts/check_pflash_interleave.py (decode stall of a
#:              running request while a 128K prompt scores, two rounds) (~5 min; PFLASH_ARGS adds bench prefill flags)
mode_pflash() {
  step pflash-prefill 300 python3 -m lucebox.cli bench prefill --scorer qwen3-0.6b --shape qwen3-8b --quant bf16 \
    --prompt-lens 32768 131072 --keep-ratio 0.1 0.2 --json "$out/pflash-prefill.json" ${PFLASH_ARGS:-}
  step pflash-dense 120 python3 -m lucebox.cli bench prefill --scorer qwen3-0.6b --shape qwen3-8b --quant bf16 \
    --prompt-lens 131072 --keep-ratio 0.1 --scorer-window 0 --json "$out/pflash-dense.json" ${PFLASH_ARGS:-}
  step pflash-chunk 120 python3 -m lucebox.cli bench prefill --scorer qwen3-0.6b --shape qwen3-8b --quant bf16 \
    --prompt-lens 131072 --keep-ratio 0.1 --scorer-chunk 16384 --json "$out/pflash-chunk.json" ${PFLASH_ARGS:-}
  step pflash-interleave 200 python3 scripts/check_pflash_interleave.py --shape qwen3-8b --scorer qwen3-0.6b \
    --prompt-len 131072
}

#: tp           issue 32, on two GPUs (nvidia-h200-x2): the tensor-parallel tests (NCCL on cuda:0 + cuda:1), then
#:              bench tp TP=1 against TP=2 (ranks build random shards) on qwen3-8b and qwen3-32b, bf16 and q4_k_m:
#:              TTFT 512, decode at 512, verify 16 / decode, NCCL time a step, forced speculation, every size with
#:              CUDA graphs (TP_ARGS: "--no-cuda-graphs" for eager steps); then the layer split cuda:0 + cuda:1
#:              (bench_device_map.py --rest cuda:1) (~15 min: split it with TP_RUNS, shape:quant pairs)
mode_tp() {
  local sq
  run_tests tp-tests "${SECONDS_TESTS:-240}" tests/engine/test_tensor_parallel.py \
    tests/engine/test_tensor_parallel_hybrid.py tests/engine/test_tensor_parallel_gemma4_laguna.py
  for sq in ${TP_RUNS:-qwen3-8b:bf16 qwen3-8b:q4_k_m qwen3-32b:bf16 qwen3-32b:q4_k_m}; do
    set -- ${sq/:/ }
    # shellcheck disable=SC2086  # TP_ARGS is a list of flags
    step "tp-$1-$2" 300 python3 -m lucebox.cli bench tp --shape "$1" --quant "$2" --sizes 1 2 \
      --json "$out/tp-$1-$2.json" ${TP_ARGS:---cuda-graphs}
    sed -n '/^random /,$p' "$out/tp-$1-$2.log"
  done
  # the layer split cuda:0 + cuda:1 against all layers on cuda:0 (graphs and eager), qwen3-8b bf16
  step device-map-2gpu 300 python3 scripts/bench_device_map.py --rest cuda:1 --gpu-layers 36 18 --skip-drafter \
    --json "$out/device-map-2gpu.json"
  sed -n '/^| row/,$p' "$out/device-map-2gpu.log"
}
