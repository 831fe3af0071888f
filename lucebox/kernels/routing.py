"""Which kernel runs a product: the routing table of the linear ops (kernels/linear.py).

Decisions only: nothing here launches or imports Triton, so the table can be read (and pinned by
tests) on any machine. Rows: DECODE (one row), VERIFY (2..MAX_FUSED_M), PREFILL (more).

    op               weights                  DECODE           VERIFY        PREFILL
    linear           float                    GEMV             TORCH         TORCH
    norm_linear      float, one projection    GEMV_NORM        TORCH         TORCH
    silu_mul_linear  float                    GEMV_SILU_MUL    TORCH         TORCH
    products         float (several of one x) TORCH            TORCH         TORCH
    any              quantised                QUANT_ROUTES     QUANT_ROUTES  DEQUANT_MATMUL
    experts (MoE)    float or quantised       MOE_PAIRS        by tokens: MOE_PAIRS up to
                                                               MOE_PAIRS_MAX_TOKENS, then MOE_GROUPED

The gated delta rule (kernels/gated_delta.py), one table per op:

    op                  CUDA (Triton)                        elsewhere
    gated_delta_steps   TRITON_STEPS                         TORCH_STEPS
    conv_steps          TRITON_CONV                          TORCH_CONV
    gates               TRITON_GATES                         TORCH_GATES
    gated_rms_norm      TRITON_NORM                          TORCH_NORM
    gated_delta_chunk   FLA_CHUNK (fla-core installed)       TORCH_CHUNK

Expert products (kernels/moe.py) count tokens, not routed rows: the rows are tokens x top_k.
Float GEMVs need Triton for x and every operand, one contiguous row and no autograd (else TORCH:
the op's torch reference). Quantised products need Triton and rows its kernels can read (else
DEQUANT_MATMUL); int8 entries of QUANT_ROUTES apply where int8 activations are allowed
(dispatch.int8_activations, NVIDIA), else the float kernel of the same rows.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from ..config import bucket_chunks_setting, dp4a_runs_setting
from .dispatch import int8_activations, use_triton
from .norm import needs_grad

MAX_FUSED_M = 64  # above this, dequantise + torch.matmul (compute-bound; tensor cores win)
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

DECODE, VERIFY, PREFILL = "decode", "verify", "prefill"
# Kernels: the Triton module that runs each, in brackets.
TORCH = "torch"  # the op's torch reference (F.linear after the op before it)
GEMV, GEMV_NORM, GEMV_SILU_MUL = "gemv", "gemv+norm", "gemv+silu_mul"  # [triton_gemv] float weights
QUANT_GEMV, QUANT_TILES = "quant_gemv", "quant_tiles"  # [triton_quant_matmul] dequantised in registers
SPLIT_GEMV = "split_gemv"  # [triton_split_rows] Q8_0 / Q6_K rows in the split layout
INT8_GEMV, INT8_TILES = "int8_gemv", "int8_tiles"  # [triton_dp4a, triton_quant_int8] int8 activations
DEQUANT_MATMUL = "dequant_matmul"  # [triton_quant_matmul.dequantize or dequant] + torch.matmul
INT8 = frozenset((INT8_GEMV, INT8_TILES))
TRITON_STEPS, TORCH_STEPS = "triton_steps", "torch_steps"  # [triton_gated_delta] token by token, slots in place
FLA_CHUNK, TORCH_CHUNK = "fla_chunk", "torch_chunk"  # [fla.ops.gated_delta_rule] chunked prefill
TRITON_CONV, TORCH_CONV = "triton_conv", "torch_conv"  # [triton_deltanet_conv] the causal conv of decode/verify rows
TRITON_GATES, TORCH_GATES = "triton_gates", "torch_gates"  # [triton_gated_delta] g and beta of each token
TRITON_NORM, TORCH_NORM = "triton_gated_norm", "torch_gated_norm"  # [triton_gated_delta] DeltaNet's output norm

# op -> (kernel where its device kernel can run, torch reference). Design choice of issue 26 (fla-core
# for prefill as the issue asks; a lucebox kernel for steps: fla's recurrent kernel has no slot
# indirection); timed by scripts/check_deltanet_gpu.py, not yet measured against alternatives.
GATED_DELTA_ROUTES = {"steps": (TRITON_STEPS, TORCH_STEPS), "conv": (TRITON_CONV, TORCH_CONV),
                      "gates": (TRITON_GATES, TORCH_GATES), "norm": (TRITON_NORM, TORCH_NORM),
                      "chunk": (FLA_CHUNK, TORCH_CHUNK)}
# [triton_moe] the routed experts read in place: GEMV per routed pair / grouped by expert on the device
MOE_PAIRS, MOE_GROUPED = "moe_pairs", "moe_grouped"
# Up to this many tokens the pairs kernels run (an expert two pairs share is read twice; the grouped
# kernels' grouping costs three launches). scripts/bench_moe.py on the H200 (docs/benchmarks-log.md,
# issue 26): at 16 tokens pairs beat grouped for bf16, Q4_K and Q8_0 (a verify's 128 rows hit ~98 experts).
MOE_PAIRS_MAX_TOKENS = 16

FLOAT_ROUTES = {"linear": GEMV, "norm_linear": GEMV_NORM, "silu_mul_linear": GEMV_SILU_MUL}

# (ggml type, split rows) -> (DECODE, VERIFY) kernel where int8 activations are allowed; types not
# listed take (QUANT_GEMV, QUANT_TILES), or (SPLIT_GEMV, QUANT_TILES) in split rows.
# scripts/bench_kernels.py --only quant --ms 1 16 --sweep, H200, qwen3-8b shapes in CUDA graphs, 2026-12-04
# Q5_K, IQ4_XS: the H100 sweep of 2026-12-05 (their runs kernels 1.3-2.2x the float GEMVs).
QUANT_ROUTES = {
    (Q.Q4_K, False): (INT8_GEMV, QUANT_TILES),
    (Q.Q6_K, True): (INT8_GEMV, QUANT_TILES),
    (Q.Q8_0, True): (SPLIT_GEMV, INT8_TILES),
    (Q.Q5_K, False): (INT8_GEMV, QUANT_TILES),
    (Q.IQ4_XS, False): (INT8_GEMV, QUANT_TILES),
}
# Rows triton_dp4a_runs' kernels read: with dp4a_runs() on, their decode products all take INT8_GEMV
# (Q5_K and IQ4_XS have no other int8 kernel: their verify stays on QUANT_TILES).
DP4A_RUNS_TYPES = frozenset({(Q.Q4_K, False), (Q.Q5_K, False), (Q.Q6_K, True), (Q.Q8_0, True), (Q.IQ4_XS, False)})
# Of those, the rows only a runs kernel reads: their one-row int8 products take it whatever the switch.
RUNS_ONLY_TYPES = frozenset({(Q.Q5_K, False), (Q.IQ4_XS, False)})


def gated_delta_route(op: str, triton: bool = False, fla: bool = False) -> str:
    """The kernel of a gated-delta op: "steps" (decode/verify/commit), "conv" (their causal conv),
    "gates" (g and beta) or "norm" (the output norm), where triton: Triton can run on the tensors; "chunk" (prefill), where fla: fla-core imports
    and the tensors are on CUDA."""
    device, reference = GATED_DELTA_ROUTES[op]
    return device if (fla if op == "chunk" else triton) else reference


def bucket_chunks() -> bool:
    """A prefill graph bucket's DeltaNet rows through the chunked rule (fla-core's kernel on CUDA, the
    torch reference elsewhere) instead of the steps kernel token by token: opt-in (LUCEBOX_BUCKET_CHUNKS=1)
    until a GPU measures it against the steps path, and shows fla-core's kernel captures in a graph."""
    return bucket_chunks_setting()


def dp4a_runs() -> bool:
    """One-row int8 GEMVs through triton_dp4a_runs' kernels (no reduction across threads inside the
    loop) for every format they read: opt-in (LUCEBOX_DP4A_RUNS=1; qwen3-8b Q4_K_M decode 2.5% slower
    with it on an H100, 2026-12-05, though each matrix alone was faster)."""
    return dp4a_runs_setting()


def runs_kernel(qtype, split_rows: bool) -> bool:
    """Whether a one-row int8 product of these rows takes triton_dp4a_runs' kernel: with the switch
    on (dp4a_runs), or for rows only a runs kernel reads."""
    return dp4a_runs() or (qtype, split_rows) in RUNS_ONLY_TYPES


def rows_kind(rows: int) -> str:
    return DECODE if rows == 1 else VERIFY if rows <= MAX_FUSED_M else PREFILL


def float_kernel(op: str, rows: int, gemv: bool) -> str:
    """The kernel of a float product of `op`; gemv: the Triton GEMV can run it (float_gemv_applies)."""
    return FLOAT_ROUTES.get(op, TORCH) if gemv and rows == 1 else TORCH


def moe_kernel(tokens: int, fused: bool) -> str:
    """The kernel of the expert products of `tokens` tokens; fused: Triton reads the experts in place
    (kernels/moe.expert_kernel), else the torch reference."""
    if not fused:
        return TORCH
    return MOE_PAIRS if tokens <= MOE_PAIRS_MAX_TOKENS else MOE_GROUPED


def quant_kernel(qtype, split_rows: bool, rows: int, *, fused: bool, int8: bool) -> str:
    """The kernel of `rows` activation rows times quantised weights. fused: Triton reads the rows
    in place (quant_fusable); int8: int8 activations allowed (int8_allowed)."""
    kind = rows_kind(rows)
    if not fused or kind == PREFILL:
        return DEQUANT_MATMUL
    default = (SPLIT_GEMV if split_rows else QUANT_GEMV, QUANT_TILES)
    decode, verify = QUANT_ROUTES.get((qtype, split_rows), default) if int8 else default
    if kind == DECODE and int8 and (qtype, split_rows) in DP4A_RUNS_TYPES and dp4a_runs():
        return INT8_GEMV
    return decode if kind == DECODE else verify


def float_gemv_applies(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The Triton GEMV can run it: one row, float weights of x's dtype (as every other operand)."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and weight.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(t.dtype == x.dtype for t in (weight, *others) if t is not None)
            and use_triton(x, weight, *others) and not needs_grad(x, weight, *others))


def quant_fusable(x: torch.Tensor, qweight: torch.Tensor, qtype) -> bool:
    """Triton's quantised kernels can multiply x by these rows in place."""
    if not use_triton(x, qweight) or x.dtype not in ACTIVATION_DTYPES:
        return False
    from . import triton_quant_matmul
    return triton_quant_matmul.supports(qweight, qtype)


def int8_allowed() -> bool:
    """Int8 activations on: the setting, and a GPU with dp4a (triton_dp4a.serves: not ROCm)."""
    return int8_activations() and torch.version.hip is None


def quant_route(x: torch.Tensor, qweight: torch.Tensor, qtype, in_features: int, split_rows: bool) -> str:
    """The kernel of x times raw GGUF rows `qweight` (split_rows: in the split layout)."""
    rows = x.numel() // max(1, in_features)
    fused = quant_fusable(x, qweight, qtype)
    return quant_kernel(qtype, split_rows, rows, fused=fused,
                        int8=fused and rows <= MAX_FUSED_M and int8_allowed())
