"""Triton kernels compute what their torch references compute.

On a machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set
here before any kernel is defined) on tiny shapes; on a GPU they are compiled and run for real.
Tolerances: float32 inputs accumulate in float32 (~1e-5 relative); bf16 rounds its inputs (the
weights, P in attention) to 8 mantissa bits (~1e-2); the Triton dequantiser is bit-exact.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available()
# The interpreter must be switched on before Triton is first imported (its language functions are
# set up then), so no lucebox module imports Triton at import time; this checks that still holds.
TRITON_IMPORTED_TOO_EARLY = (not ON_GPU and "triton" in sys.modules
                             and os.environ.get("TRITON_INTERPRET") != "1")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
if TRITON_IMPORTED_TOO_EARLY:
    raise RuntimeError("triton was imported before tests/test_triton_kernels.py could set TRITON_INTERPRET=1: "
                       "keep Triton imports lazy (inside functions), or export TRITON_INTERPRET=1")

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from lucebox.kernels import dequant, triton_norm  # noqa: E402
from lucebox.kernels import split_rows as layout  # noqa: E402
from lucebox.kernels import triton_quant_matmul as tqm  # noqa: E402
from lucebox.kernels.linear import quant_matmul  # noqa: E402
from lucebox.weights.quant import QuantLinear, QuantTensor  # noqa: E402

from tests.weights.test_quant import random_rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
# The 32-value block formats llama.cpp falls back to for rows not a multiple of 256 (test_block32_formats.py)
FALLBACK_TYPES = [Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL]


def _patch_interpreter_bfloat16() -> None:
    """Make Triton's interpreter treat bfloat16 as a GPU does. It stores bf16 as raw uint16, so its
    tl.dot multiplies the bit patterns, and it truncates float32 -> bf16 where GPUs round to
    nearest even. Neither reaches compiled kernels; patched so the bf16 kernel paths are tested."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder, "_lucebox_bf16", False):
        return
    dot, cast = builder.create_dot, builder.cast_impl

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl, builder._lucebox_bf16 = create_dot, cast_impl, True


if not ON_GPU:
    _patch_interpreter_bfloat16()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def quant_rows(qtype, rows: int, cols: int, seed: int) -> torch.Tensor:
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_rows(qtype, rows, cols // block, np.random.default_rng(seed), small_scales=True)
    return torch.from_numpy(raw).to(DEVICE)


# ----------------------------------------------------------------------------- quantised matmul

@pytest.mark.parametrize("qtype", QUANT_TYPES + FALLBACK_TYPES, ids=lambda t: t.name)
def test_triton_dequantize_is_bit_exact_with_the_reference(qtype):
    raw = quant_rows(qtype, 5, 512, seed=qtype.value)
    want = dequant.dequantize(raw, qtype)
    assert torch.equal(tqm.dequantize(raw, qtype, 512), want)
    assert torch.equal(tqm.dequantize(raw, qtype, 512, torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 5], ids=["gemv", "dot"])
@pytest.mark.parametrize("qtype", QUANT_TYPES + FALLBACK_TYPES, ids=lambda t: t.name)
def test_fused_quant_matmul_matches_dequantise_then_matmul_in_float32(qtype, m):
    k, n = 512, 40  # two super-blocks per row; 40 rows leave a partial tile of output features
    raw = quant_rows(qtype, n, k, seed=10 + qtype.value)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    want = x @ dequant.dequantize(raw, qtype).T
    got = tqm.quant_matmul(x, raw, qtype, k, split_k=2)  # split-K and its reduction included
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_one_row_through_the_tensor_core_path_matches_the_elementwise_path(qtype):
    k, n = 512, 40
    raw = quant_rows(qtype, n, k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = x @ dequant.dequantize(raw, qtype).T
    for tensor_cores in (False, True):
        assert rel_err(tqm.quant_matmul(x, raw, qtype, k, tensor_cores=tensor_cores), want) <= 1e-5
    with pytest.raises(ValueError, match="one row"):
        tqm.quant_matmul(x.repeat(2, 1), raw, qtype, k, tensor_cores=False)


@pytest.mark.parametrize("qtype, split", [(Q.Q4_K, False), (Q.Q6_K, False), (Q.Q6_K, True)],
                         ids=["Q4_K", "Q6_K", "Q6_K-split"])
def test_bf16_tiles_round_each_weight_once_from_bf16_scales(qtype, split):
    """bf16 x: each weight is q * bf16(scale) - bf16(offset) rounded once to bf16 (on a GPU by the bf16x2
    PTX itself), so the product equals the exact weights' to bf16 rounding; float32 x to its own rounding."""
    k, n = 512, 40
    raw = quant_rows(qtype, n, k, seed=41)
    weights = layout.split_rows(raw, qtype) if split else raw
    g = torch.Generator().manual_seed(6)
    for m in (2, 17, 64):
        x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
        want = x.float() @ dequant.dequantize(raw, qtype).T
        for split_k in (1, 2):
            got = tqm.quant_matmul(x, weights, qtype, k, split_k=split_k, split_rows=split)
            assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 1e-2
            x32 = x.float()
            got = tqm.quant_matmul(x32, weights, qtype, k, split_k=split_k, split_rows=split)
            assert got.dtype == torch.float32 and rel_err(got, x32 @ dequant.dequantize(raw, qtype).T) <= 1e-5


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m", [1, 7, tqm.MAX_FUSED_M // 2])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_fused_quant_matmul_in_bfloat16_with_bias(qtype, m, split_k):
    k, n = 256, 48
    raw = quant_rows(qtype, n, k, seed=20 + qtype.value)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, m, k, generator=g).to(DEVICE, torch.bfloat16)  # leading dims are flattened
    bias = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16)
    want = x.float() @ dequant.dequantize(raw, qtype).T + bias.float()
    got = tqm.quant_matmul(x, raw, qtype, k, bias, split_k=split_k)  # 3: the split reduction adds the bias
    assert got.dtype == torch.bfloat16 and got.shape == (2, m, n)
    assert rel_err(got, want) <= 1e-2


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K], ids=["Q8_0", "Q6_K"])
def test_split_rows_hold_the_same_weights_and_multiply_like_the_reference(qtype):
    """kernels/triton_split_rows.py (the GPU's Q8_0 and Q6_K layout): split rows reorder the ggml
    bytes field by field (join_rows undoes it); their GEMV (decode) and the fused kernel (verify)
    equal the dequantised matmul, every value and scale decoded, split-K and bias included; the
    dequantiser (prefill) reads them bit for bit."""
    from lucebox.kernels import triton_split_rows as tsr
    k, n = 512, 40
    raw = quant_rows(qtype, n, k, seed=7 + qtype.value)
    split = layout.split_rows(raw, qtype)
    assert split.shape == raw.shape and not torch.equal(split, raw) and torch.equal(layout.join_rows(split, qtype), raw)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    weight = dequant.dequantize(raw, qtype)
    want = x @ weight.T
    for split_k in (1, 2):
        assert rel_err(tsr.gemv(x[:1], split, qtype, k, split_k=split_k), want[:1]) <= 1e-5
        assert rel_err(tsr.gemv(x[:1], split, qtype, k, bias, split_k=split_k), want[:1] + bias) <= 1e-5
        assert torch.equal(tsr.gemv(x[:1], split, qtype, k, split_k=split_k, stages=3),
                           tsr.gemv(x[:1], split, qtype, k, split_k=split_k))  # the loop software-pipelined
        got = tqm.quant_matmul(x, split, qtype, k, bias, split_k=split_k, split_rows=True)
        assert rel_err(got, want + bias) <= 1e-5
    assert torch.equal(tqm.dequantize(split, qtype, k, split_rows=True), weight)
    with pytest.raises(ValueError, match="one row"):
        tsr.gemv(x, split, qtype, k)
    with pytest.raises(ValueError, match="multiple of 256"):
        tsr.gemv(x[:1, :96], split[:, :1], qtype, 96)
    with pytest.raises(ValueError, match="not Q4_K"):
        tsr.gemv(x[:1], split, Q.Q4_K, k)
    assert layout.applies(qtype, 4096) and not layout.applies(qtype, 96) and not layout.applies(Q.Q4_K, 4096)


def test_split_k_changes_nothing_but_the_summation_order():
    raw = quant_rows(Q.Q4_K, 16, 1024, seed=5)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    whole = tqm.quant_matmul(x, raw, Q.Q4_K, 1024, split_k=1)
    split = tqm.quant_matmul(x, raw, Q.Q4_K, 1024, split_k=4)
    assert rel_err(split, whole) <= 1e-6


def test_quant_linear_uses_the_fused_kernel_for_decode_and_dequantise_plus_matmul_for_prefill(monkeypatch):
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls = []
    for name in ("quant_matmul", "dequantize"):
        real = getattr(tqm, name)
        monkeypatch.setattr(tqm, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    raw = quant_rows(Q.Q8_0, 24, 64, seed=7)
    layer = QuantLinear(QuantTensor(raw, Q.Q8_0, (24, 64)), bias=torch.randn(24).to(DEVICE))
    weight = dequant.dequantize(raw, Q.Q8_0)
    for rows in (1, 3, tqm.MAX_FUSED_M + 1):
        x = torch.randn(rows, 64).to(DEVICE)
        assert rel_err(layer(x), x @ weight.T + layer.bias) <= 1e-5
    assert calls == ["quant_matmul", "quant_matmul", "dequantize"]


def test_linears_in_split_rows_compute_what_they_did_for_decode_verify_and_prefill(monkeypatch):
    """Transformer.split_quant_rows: every Q8_0 / Q6_K linear and embedding table whose rows leave
    the split fields aligned takes the GPU decode kernels' layout, a fused projection's tensor
    reordered once (its layers' slices only told), and every path computes what it did: the split
    GEMV (one row), the fused kernel (verify rows), dequantise + matmul (prefill), the table's
    lookups and tied head. The raw weights read back unchanged. (On the float kernels: int8
    activations round the rows, see test_int8_activations_take_decode_and_verify...)"""
    from torch import nn

    from lucebox.kernels import triton_split_rows as tsr
    monkeypatch.setenv("LUCEBOX_INT8_ACTIVATIONS", "0")
    from lucebox.model.transformer import Transformer, fuse_linears
    from lucebox.weights.quant import QuantEmbedding
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    k = 256
    parts = [QuantLinear(QuantTensor(quant_rows(Q.Q8_0, n, k, seed=n), Q.Q8_0, (n, k), f"p{n}")) for n in (24, 8, 8)]
    parts.append(QuantLinear(QuantTensor(quant_rows(Q.Q6_K, 8, 2048, seed=4), Q.Q6_K, (8, 2048), "q6")))
    odd = QuantLinear(QuantTensor(quant_rows(Q.Q8_0, 8, 96, seed=2), Q.Q8_0, (8, 96), "odd"))  # 96: not split
    short = QuantLinear(QuantTensor(quant_rows(Q.Q6_K, 8, 512, seed=5), Q.Q6_K, (8, 512), "short"))  # Q6_K < 2048
    holder = nn.Module()
    holder.parts, holder.odd, holder.short = nn.ModuleList(parts), odd, short
    holder.qkvg = fuse_linears(parts[:3])  # any name (Laguna's qkvg): split_quant_rows finds it by its value
    holder.embed = QuantEmbedding(QuantTensor(quant_rows(Q.Q8_0, 12, k, seed=3), Q.Q8_0, (12, k), "embed"))
    raws = [m.weight.data.clone() for m in parts]
    table = holder.embed.weight.data.clone()
    ids = torch.tensor([[3, 0, 11]], device=DEVICE)
    looked_up, projected = holder.embed(ids), holder.embed.project(xs_head := torch.randn(1, k).to(DEVICE))
    xs = {width: [torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
                  for rows in (1, 3, tqm.MAX_FUSED_M + 1)] for width in (k, 2048)}
    before = [[m(x) for x in xs[m.in_features]] for m in parts] + [[holder.qkvg(x) for x in xs[k]]]
    gemvs = []
    monkeypatch.setattr(tsr, "gemv", lambda *a, _real=tsr.gemv, **kw: gemvs.append(1) or _real(*a, **kw))
    Transformer.split_quant_rows(holder)
    Transformer.split_quant_rows(holder)  # idempotent
    assert all(m.split_rows for m in parts) and holder.qkvg.__self__.split_rows
    assert not odd.split_rows and not short.split_rows
    assert all(torch.equal(m.weight.data, raw) for m, raw in zip(parts, raws))
    assert holder.embed.split_rows and torch.equal(holder.embed.weight.data, table)
    assert torch.equal(holder.embed(ids), looked_up)  # the dequantiser reads split rows bit for bit
    assert rel_err(holder.embed.project(xs_head), projected) <= 1e-5
    after = [[m(x) for x in xs[m.in_features]] for m in parts] + [[holder.qkvg(x) for x in xs[k]]]
    for got_rows, want_rows in zip(after, before):
        for got, want in zip(got_rows, want_rows):
            assert rel_err(got, want) <= 1e-5
    assert len(gemvs) == len(after) + 1  # each one-row product took the split GEMV (the head's too)
    assert fuse_linears(parts[:3]).__self__.split_rows  # fused after splitting: the projection knows


def test_without_the_switch_cpu_tensors_stay_on_the_torch_reference(monkeypatch):
    if ON_GPU:
        pytest.skip("GPU tensors always take the Triton path")
    monkeypatch.delenv("LUCEBOX_TRITON", raising=False)
    monkeypatch.setattr(tqm, "quant_matmul", lambda *a, **kw: pytest.fail("Triton path taken on CPU"))
    raw = quant_rows(Q.Q8_0, 8, 64, seed=8)
    x = torch.randn(1, 64)
    assert rel_err(quant_matmul(x, raw, Q.Q8_0, 64), x @ dequant.dequantize(raw, Q.Q8_0).T) <= 1e-6


def test_a_model_forward_with_triton_kernels_matches_the_reference(monkeypatch):
    """Prefill, verify and decode steps through the real model: attention (with a sliding-window
    layer) and quantised MLP weights go through the Triton kernels when switched on."""
    from lucebox.engine.block_manager import BlockManager
    from lucebox.engine.runner import ModelRunner
    from lucebox.model.config import ModelConfig
    from lucebox.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, sliding_windows=[None, 6])
    model = Transformer(cfg).to(DEVICE)
    mlp = model.layers[0].mlp
    for name in ("gate_proj", "up_proj"):  # Q8_0, quantised from the layer's own weights
        w = getattr(mlp, name).weight.detach().cpu().numpy()
        raw = torch.from_numpy(np.ascontiguousarray(gguf_quantize(w, Q.Q8_0)).view(np.uint8)).to(DEVICE)
        setattr(mlp, name, QuantLinear(QuantTensor(raw, Q.Q8_0, tuple(w.shape))))
    mlp.down_proj = QuantLinear(QuantTensor(quant_rows(Q.Q4_K, 64, 256, seed=1), Q.Q4_K, (64, 256)))

    def run_steps():
        runner, blocks = ModelRunner(model, 16, 4), BlockManager(16, 4)
        tables = [[], []]
        for table, n in zip(tables, (9, 13)):
            blocks.allocate(table, n)
        prompts = [list(range(1, 10)), list(range(20, 33))]
        logits = [runner.forward(prompts, [0, 0], tables, all_logits=True)]
        for table, n in zip(tables, (13, 15)):  # room for the verify and decode steps below
            blocks.allocate(table, n)
        logits.append(runner.forward([[5, 6, 7], [8]], [9, 13], tables, all_logits=True))  # verify + decode
        logits.append(runner.forward([[9], [10]], [12, 14], tables))
        return torch.cat(logits)

    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want = run_steps()
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.setenv("LUCEBOX_INT8_ACTIVATIONS", "0")  # the float kernels: the reference's arithmetic
    assert rel_err(run_steps(), want) <= 1e-4
    monkeypatch.setenv("LUCEBOX_INT8_ACTIVATIONS", "1")  # Q4_K on int8 activations: their rounding only
    assert rel_err(run_steps(), want) <= 3e-2


# ----------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 32)], ids=["rows", "per-head"])
def test_rms_norm_with_fused_residual_add_matches_the_reference(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    x, residual = (torch.randn(*shape, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    out, total = triton_norm.rms_norm_residual_triton(x, residual, weight, 1e-6)
    want_out, want_total = triton_norm.rms_norm_residual_reference(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)
    assert out.dtype == want_out.dtype and rel_err(out, want_out) <= tol
    plain = triton_norm.rms_norm_triton(x, weight, 1e-6)
    assert rel_err(plain, triton_norm.rms_norm_reference(x, weight, 1e-6)) <= tol


def test_rms_norm_dispatch_follows_the_switch(monkeypatch):
    x = torch.randn(3, 64).to(DEVICE)
    weight = torch.rand(64).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls = []
    real = triton_norm.rms_norm_residual_triton
    monkeypatch.setattr(triton_norm, "rms_norm_residual_triton",
                        lambda *a: calls.append(1) or real(*a))
    out, _ = triton_norm.rms_norm_residual(x, x, weight, 1e-6)
    assert calls == [1]
    assert rel_err(out, triton_norm.rms_norm_reference(2 * x, weight, 1e-6)) <= 1e-5
