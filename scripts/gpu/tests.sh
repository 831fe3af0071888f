# GPU test modes (sourced by scripts/gpu_session.sh). Each fits one device call (540 s of tests);
# a test's line reaches the log as it starts, so a step the timeout ends names the test it cut off.

#: check        the GPU tests that predate hybrids and windows: CUDA graphs, fused/Triton kernels, model,
#:              training, acceptance, step plans, sliding windows (~5.5 min; SECONDS_CHECK)
mode_check() {
  run_tests gpu-tests "${SECONDS_CHECK:-540}" tests/engine/test_cuda_graphs.py tests/engine/test_graph_attention.py \
    tests/engine/test_graph_sampling.py tests/engine/test_overlapped_decoding.py tests/engine/test_pdl.py tests/kernels \
    --ignore=tests/kernels/test_gated_delta.py --ignore=tests/kernels/test_triton_moe.py \
    --ignore=tests/kernels/test_triton_moe_models.py --ignore=tests/kernels/test_block32_formats.py \
    --ignore=tests/kernels/test_tree_attention.py --ignore=tests/kernels/test_gated_delta_tree.py \
    --ignore=tests/kernels/test_moe_shared_pair.py \
    tests/model/test_model.py tests/train/test_dense_lm.py tests/sampling/test_acceptance.py \
    tests/engine/test_step_plan.py tests/engine/test_sliding_window.py tests/weights/test_quant.py
}

#: check-new    the GPU tests of hybrids (Qwen 3.5/3.6, MoE), mixed windows (Gemma 4, Laguna) and DFlash
#:              graphs, fastest first (SECONDS_CHECK; FLA=1: with fla-core's prefill kernels)
mode_check_new() {
  run_tests gpu-tests-new "${SECONDS_CHECK:-540}" tests/kernels/test_gated_delta.py tests/kernels/test_triton_moe.py \
    tests/kernels/test_moe_shared_pair.py tests/spec/test_dflash_graphs.py tests/model/test_laguna_graphs.py tests/model/test_qwen3_5_graphs.py \
    tests/engine/test_hybrid_prefix.py tests/model/test_gemma4.py tests/engine/test_sliding_window_mixed.py tests/engine/test_sliding_window_graphs.py
}

#: check-trees  the GPU tests written without a GPU in the eighteenth session: GeGLU / weights-on-input
#:              experts, the 32-value block formats (Q4_1/Q5_0/Q5_1/IQ4_NL) at Gemma 4 26B-A4B's sizes, tree
#:              attention, DeltaNet tree kernels, tree graph buckets, trees on windows and hybrids, a
#:              cuda:0 + cpu layer split, Gemma 4 / Laguna speculation graphs, DFlash2 captured walks
mode_check_trees() {
  run_tests gpu-tests-trees "${SECONDS_CHECK:-540}" tests/kernels/test_triton_moe_models.py \
    tests/kernels/test_tree_attention.py tests/kernels/test_gated_delta_tree.py tests/engine/test_tree_graphs.py \
    tests/spec/test_ddtree_windows.py tests/spec/test_ddtree_hybrid.py tests/engine/test_placement.py \
    tests/spec/test_spec_gemma4_laguna.py::test_greedy_speculation_through_graphs_equals_plain_decoding \
    "tests/spec/test_dflash2.py::test_drafts_through_the_drafter_graphs_equal_the_eager_ones" \
    tests/kernels/test_block32_formats.py
}

#: check-kvflash  the GPU tests written without a GPU in the nineteenth session (KVFlash, RoPE-shift graph
#:              buckets): host-store copies on side streams, pooled engines on cuda (Triton attention over
#:              compact views), shifted rows through captured graphs, the drafter pool's captured drafts
mode_check_kvflash() {
  run_tests gpu-tests-kvflash "${SECONDS_CHECK:-540}" tests/model/test_kv_host_store.py \
    tests/engine/test_rope_shift.py tests/engine/test_kv_pool_engine.py tests/engine/test_kv_pool_families.py \
    tests/spec/test_draft_pool.py
  step kv-host-store-gpu 120 python3 scripts/check_kv_host_store_gpu.py
}

#: recheck      the GPU tests fixed or written without a GPU since their last GPU run, or not reached there:
#:              paged attention first (its tall tiles' unmasked interior, thirty-first session), hybrid
#:              speculation and trees on hybrids (bounded pools, catch-up refusal), wide GQA prefill, pooled
#:              families, placement, prefill graph buckets, KVFlash, PFlash, DFlash2, tree graphs; last the ones
#:              that passed in the thirtieth and thirty-first sessions (Triton kernels, int8 activations, Laguna,
#:              hybrid GGUF and graphs, CUDA graphs, Gemma 4, mixed windows, Laguna graphs) (~6 min; SECONDS_CHECK)
mode_recheck() {
  run_tests gpu-tests-recheck "${SECONDS_CHECK:-300}" \
    tests/kernels/test_paged_attention.py tests/kernels/test_tree_attention.py tests/kernels/test_attention_rounding.py \
    tests/engine/test_graph_attention.py tests/model/test_qwen3_5_spec.py tests/spec/test_ddtree_hybrid.py \
    tests/kernels/test_prefill_attention.py::test_heads_wider_than_fused_gqa_take_a_batch_entry_a_kv_head \
    tests/engine/test_kv_pool_families.py tests/engine/test_placement.py tests/engine/test_engine_build.py \
    tests/engine/test_prefill_graphs.py tests/model/test_qwen3_5_prefill_graphs.py \
    tests/spec/test_dflash_graphs.py tests/engine/test_kv_pool_engine.py \
    tests/engine/test_kv_pool_page_in.py tests/engine/test_pflash_score.py tests/spec/test_dflash2.py \
    tests/spec/test_dflash2_trees.py tests/engine/test_tree_graphs.py \
    tests/kernels/test_triton_kernels.py tests/kernels/test_int8_activations.py tests/kernels/test_prefill_attention.py \
    tests/model/test_laguna.py \
    tests/model/test_gguf_hybrid.py tests/model/test_qwen3_5_graphs.py tests/engine/test_cuda_graphs.py \
    tests/engine/test_graph_sampling.py tests/engine/test_overlapped_decoding.py tests/engine/test_pdl.py \
    tests/model/test_gemma4.py tests/engine/test_sliding_window_mixed.py tests/engine/test_sliding_window_graphs.py tests/model/test_laguna_graphs.py
}
