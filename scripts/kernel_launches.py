"""The kernel launches scripts/compile_kernels.py compiles: the Python wrappers run on CPU tensors of real
shapes with every Triton kernel replaced by a Recorder, which keeps each launch (kernel, arguments, options)
instead of running it. record_dense: the dense kernels at qwen3-8b-like shapes and Gemma 4's wide heads;
record_gated_delta: the Gated DeltaNet kernels at Qwen3.6-27B's (scripts/bench_moe.py --compile-only records
the MoE expert kernels with the same Recorder).
"""
from __future__ import annotations

import itertools
import math

import torch
from gguf import GGML_QUANT_SIZES

from bench_kernels import SHAPES, decode_matrices
from lucebox.kernels import triton_activation, triton_gemv, triton_norm, triton_rope_kv, triton_sampling
from lucebox.kernels import split_rows as layout
from lucebox.kernels import triton_deltanet_conv as tdc
from lucebox.kernels import triton_dp4a as tdp
from lucebox.kernels import triton_dp4a_runs as tdr
from lucebox.kernels import triton_gated_delta as tgd
from lucebox.kernels import triton_one_row as tor
from lucebox.kernels import triton_paged_attention as tpa
from lucebox.kernels import triton_quant_int8 as tqi
from lucebox.kernels import triton_quant_matmul as tqm
from lucebox.kernels import triton_split_rows as tsr
from lucebox.kernels.forward_batch import ForwardBatch
from lucebox.model.kv_cache import PagedKVCache


class Recorder:
    """Stands in for a kernel: records each launch (kernel, args, kwargs) in `launches` instead of running it."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *a, **kw: self.launches.append((self.fn, a, kw))


def record_dense(launches: list) -> None:
    """Record (scripts/compile_kernels.py) every dense kernel variant the Python wrappers launch at
    qwen3-8b-like shapes and Gemma 4's wide heads."""
    Capture = lambda fn: Recorder(fn, launches)  # noqa: E731

    real = (tqm._qmm_kernel, tor._sum_splits_kernel, tpa._paged_attn_kernel, tpa._merge_splits_kernel,
            tdp._quantize_rows_kernel)
    tqm._qmm_kernel, tor._sum_splits_kernel = Capture(real[0]), Capture(real[1])
    tdp._quantize_rows_kernel = Capture(real[4])
    dp4a_kernels, int8_kernels, runs_kernels = dict(tdp._KERNELS), dict(tqi._KERNELS), dict(tdr.RUNS_KERNELS)
    tdp._KERNELS = {key: Capture(kernel) for key, kernel in dp4a_kernels.items()}
    tdr.RUNS_KERNELS = {key: Capture(kernel) for key, kernel in runs_kernels.items()}
    tqi._KERNELS = {key: Capture(kernel) for key, kernel in int8_kernels.items()}
    split_gemvs = dict(tsr._GEMV)
    tsr._GEMV = {qtype: (Capture(kernel), *rest) for qtype, (kernel, *rest) in split_gemvs.items()}
    tpa._paged_attn_kernel, tpa._merge_splits_kernel = Capture(real[2]), Capture(real[3])
    lazy = (triton_norm, triton_rope_kv, triton_activation, triton_gemv)  # modules defining their kernel on first use
    lazy_real = [m._kernel for m in lazy]
    for module, make in zip(lazy, lazy_real):
        module._kernel = lambda kernel=make(): Capture(kernel)
    from lucebox.kernels import triton_moe_route
    route_real = triton_moe_route._route_kernel
    triton_moe_route._route_kernel = Capture(route_real)
    sampling_real = triton_sampling._kernels
    triton_sampling._kernels = lambda kernels=sampling_real(): tuple(Capture(k) for k in kernels)
    try:
        for qtype in sorted(tqm.SUPPORTED_TYPES):
            raw = torch.zeros(64, 4096 // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8)
            for m in (1, 16, 64):
                for dtype in (torch.bfloat16, torch.float32):
                    tqm.quant_matmul(torch.zeros(m, 4096, dtype=dtype), raw, qtype, 4096, split_k=1)
            tqm.dequantize(raw, qtype, 4096, torch.bfloat16)
        # head sizes: the Llama/Qwen 128, Gemma 4's 256 (sliding) and 512 (full attention, 16 heads a K/V head)
        for cache_type, head_dim, group in itertools.product(("bf16", "fp8", "q8_0", "q4_0"), (128, 256, 512), (4,)):
            group = 16 if head_dim == 512 else group
            for q_len, window in ((1, None), (16, None), (32, 4096), (512, None)):
                for dtype in (torch.bfloat16, torch.float32) if q_len == 1 else (torch.bfloat16,):
                    blocks = math.ceil((100 + q_len) / 16)
                    kc, vc = (PagedKVCache(blocks, 16, 2, head_dim, cache_type, dtype, "cpu") for _ in range(2))
                    fb = ForwardBatch.build([[0] * q_len], [100], [list(range(blocks))], 16, "cpu")
                    q = torch.zeros(q_len, 2 * group, head_dim, dtype=dtype)
                    tpa.paged_attention(q, kc, vc, fb, 0.1, window, num_splits=4 if q_len == 1 else 1)
                    if q_len in (16, 32):  # the same as a tree verify row (ForwardBatch.tree_mask)
                        fb.tree_mask = torch.full((q_len,), -1, dtype=torch.long)
                        tpa.paged_attention(q, kc, vc, fb, 0.1, window, num_splits=2)
        for rows in (1, 64):
            x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
            triton_norm.rms_norm_residual_triton(x, x, x[0], 1e-6)
            triton_norm.rms_norm_rounded_triton(x, x, x[0], 1e-6)  # also rows rounded to int8
            triton_norm.rms_norm_triton(torch.zeros(rows, 32, 128, dtype=torch.bfloat16), x[0, :128], 1e-6)
        tqm.quant_matmul(torch.zeros(1, 4096, dtype=torch.bfloat16), raw, qtype, 4096, split_k=4)
        for qtype, split in tqi._KERNELS:  # int8 activations: decode (dp4a) and verify (tensor cores)
            raw = torch.zeros(64, 4096 // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8)
            for m in (1, 16, 64):
                tqi.matmul(torch.zeros(m, 4096, dtype=torch.bfloat16), raw, qtype, split, 4096, split_k=1)
            for stages in (2, 3):  # the one-row GEMV's loop software-pipelined (an option of the sweep)
                tqi.matmul(torch.zeros(1, 4096, dtype=torch.bfloat16), raw, qtype, split, 4096, split_k=1,
                           stages=stages)
        for qtype, split in tdr.RUNS_KERNELS:  # one-row int8 GEMVs in runs (options of the sweep)
            raw = torch.zeros(64, 4096 // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8)
            for unroll, warps in itertools.product((1, 2), (4, 8)):
                tdp.gemv(torch.zeros(1, 4096, dtype=torch.bfloat16), raw, qtype, split, 4096, split_k=1,
                         runs=True, unroll=unroll, num_warps=warps)
        for qtype in layout.SPLIT_TYPES:  # split rows: the GEMV, the fused kernel (verify), the dequantiser (prefill)
            raw = torch.zeros(64, 4096 // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8)
            for stages in (1, 2, 3):
                tsr.gemv(torch.zeros(1, 4096, dtype=torch.bfloat16), raw, qtype, 4096, split_k=1, stages=stages)
            for m in (1, 16):
                tqm.quant_matmul(torch.zeros(m, 4096, dtype=torch.bfloat16), raw, qtype, 4096, split_k=1,
                                 split_rows=True)
            tqm.dequantize(raw, qtype, 4096, torch.bfloat16, split_rows=True)
        for qk_norm in (None, (torch.ones(128, dtype=torch.bfloat16),) * 2 + (1e-6,)):
            kc, vc = (PagedKVCache(8, 16, 8, 128, "bf16", torch.bfloat16, "cpu") for _ in range(2))
            q, k = torch.zeros(1, 32, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 128, dtype=torch.bfloat16)
            cos = torch.zeros(1, 128, dtype=torch.bfloat16)
            triton_rope_kv.rope_and_write_kv(q, k, k, cos, cos, kc, vc, torch.zeros(1, dtype=torch.long), qk_norm)
        gate_up = torch.zeros(1, 2 * 12288, dtype=torch.bfloat16)
        triton_activation.silu_and_mul_triton(*gate_up.chunk(2, dim=-1))
        triton_activation.silu_and_mul_rounded_triton(*gate_up.chunk(2, dim=-1))
        for shape in (SHAPES["qwen3-8b"], SHAPES["qwen3-0.6b"]):  # decode GEMVs, each prologue
            for _, n, k, prologue in decode_matrices(shape):
                for dtype in (torch.bfloat16, torch.float32):
                    w, x = torch.zeros(n, k, dtype=dtype), torch.zeros(1, 2 * k, dtype=dtype)
                    norm_w = torch.zeros(k, dtype=dtype)
                    x = x if prologue == triton_gemv.SILU_MUL else x[:, :k]
                    triton_gemv.gemv(x, w, None, prologue,
                                     x if prologue == triton_gemv.NORM else None, norm_w, 1e-6)
                    if k <= 4096:
                        triton_gemv.gemv(x, w, None, prologue, x if prologue == triton_gemv.NORM else None,
                                         norm_w, 1e-6, config=(2, triton_gemv.next_pow2(k), 4, 264))
        for experts, top_k, softmax, biased in ((256, 8, True, False), (128, 8, True, False), (64, 4, False, True)):
            logits = torch.zeros(16, experts, dtype=torch.bfloat16)  # a MoE router (Qwen; Laguna: sigmoid + bias)
            triton_moe_route.route(logits, top_k, softmax=softmax, softcap=0.0 if softmax else 30.0,
                                   bias=torch.zeros(experts) if biased else None, dtype=torch.bfloat16)
        for vocab, rows in ((8192, 1), (8192, 16), (151936, 16), (262144, 16)):  # in-graph sampling (262K: Gemma 4)
            row = torch.zeros(1)
            for search in triton_sampling.SEARCHES:
                triton_sampling.accept_rows_triton(torch.zeros(rows, vocab), torch.zeros(rows, dtype=torch.long),
                                                   torch.zeros(rows, dtype=torch.long), row, row.long(), row, row,
                                                   row.long(), torch.zeros(1, dtype=torch.long),  # as a graph calls it
                                                   search=search)
    finally:
        tqm._qmm_kernel, tor._sum_splits_kernel, tpa._paged_attn_kernel, tpa._merge_splits_kernel = real[:4]
        tsr._GEMV, tdp._quantize_rows_kernel = split_gemvs, real[4]
        tdp._KERNELS, tqi._KERNELS, tdr.RUNS_KERNELS = dp4a_kernels, int8_kernels, runs_kernels
        for module, make in zip(lazy, lazy_real):
            module._kernel = make
        triton_sampling._kernels = sampling_real
        triton_moe_route._route_kernel = route_real


def record_gated_delta(launches: list) -> None:
    """The Gated DeltaNet kernels' launches at Qwen3.6-27B's heads (16 key heads, 48 value heads,
    128 x 128 states, a 4-tap conv over 10,240 channels): decode/verify steps with and without outputs,
    a commit's normalised steps, tree verifies, the conv with and without a stash or a tree, gates, norm."""
    real, real_conv = tgd._kernel, tdc._kernel
    tgd._kernel = lambda kernels=real(): tuple(Recorder(k, launches) for k in kernels)
    tdc._kernel = lambda kernels=real_conv(): tuple(Recorder(k, launches) for k in kernels)
    try:
        tokens, seqs, kh, vh, d, channels, taps = 16, 2, 16, 48, 128, 2 * 16 * 128 + 48 * 128, 4
        idx = torch.zeros(seqs, dtype=torch.long)
        q, k = (torch.zeros(tokens, kh, d, dtype=torch.bfloat16) for _ in range(2))
        v = torch.zeros(tokens, vh, d, dtype=torch.bfloat16)
        g, beta = torch.zeros(tokens, vh), torch.zeros(tokens, vh)
        state = torch.zeros(seqs + 1, vh, d, d)
        for outputs, normalize in ((True, False), (False, True)):
            tgd.gated_delta_steps_triton(q, k, v, g, beta, state, idx, idx, idx, idx, outputs, normalize)
        rows = torch.zeros(tokens, dtype=torch.long)
        tgd.gated_delta_tree_triton(q, k, v, g, beta, state, idx, idx, rows, rows, idx, rows)
        qkv = torch.zeros(tokens, channels, dtype=torch.bfloat16)
        conv = torch.zeros(seqs + 1, channels, taps - 1, dtype=torch.bfloat16)
        weight = torch.zeros(channels, taps, dtype=torch.bfloat16)
        stash = (torch.zeros(64, channels, dtype=torch.bfloat16),) * 2
        a = torch.zeros(tokens, vh, dtype=torch.bfloat16)
        gate_stash = (torch.zeros(64, vh), torch.zeros(64, vh), rows)
        for extra in ({}, {"stash": stash, "positions": 8}, {"stash": stash, "positions": 8, "tree": (rows, rows)}):
            tdc.conv_steps_triton(qkv, conv, weight, idx, idx, idx, rows, rows, **extra)
            tdc.conv_gate_steps_triton(qkv, a, a, conv, weight, torch.zeros(vh), torch.zeros(vh), idx, idx, idx, idx,
                                       rows, **extra, gate_stash=gate_stash if extra else None)
        tgd.gates_triton(a, a, torch.zeros(vh), torch.zeros(vh))
        tgd.gated_rms_norm_triton(v.float(), v, torch.zeros(d), 1e-6, torch.bfloat16)
    finally:
        tgd._kernel, tdc._kernel = real, real_conv
