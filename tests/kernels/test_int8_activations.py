"""Int8 activations of the quantised decode and verify products: rows rounded to int8 per 32 values
(triton_dp4a.quantize_rows, or the op that makes them: the norm, silu * up, the output gate), the dp4a
GEMVs, the runs kernels and the int8 tensor-core tiles are the float products of those rounded rows, and
the routing sends the products where int8 is faster unless it is switched off (Triton interpreted on the
CPU, compiled on a GPU).
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_kernels import (  # noqa: I001  (sets TRITON_INTERPRET=1 first)
    DEVICE, Q, dequant, layout, quant_rows, rel_err)

from lucebox.weights.quant import QuantLinear, QuantTensor

def rounded_rows(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The activations that triton_dp4a.quantize_rows' packed rows stand for: qx * xd, [M, K]."""
    q = packed[:, :k].contiguous().view(torch.int8).float().view(packed.shape[0], -1, 32)
    d = packed[:, k:k + k // 8].contiguous().view(torch.float32)
    return (q * d[..., None]).view(packed.shape[0], k)


def test_activation_rows_are_rounded_to_int8_per_32_values_alike_whatever_their_number():
    from lucebox.kernels import triton_dp4a as tdp
    k = 512
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    x[2, :32] = 0  # an all-zero block: scale 0, values 0
    packed = tdp.quantize_rows(x)
    assert packed.shape == (5, k + k // 4) and packed.dtype == torch.uint8
    q = packed[:, :k].contiguous().view(torch.int8).float().view(5, -1, 32)
    d = packed[:, k:k + k // 8].contiguous().view(torch.float32)
    sums = packed[:, k + k // 8:].contiguous().view(torch.float32)
    assert torch.allclose(d, x.view(5, -1, 32).abs().amax(-1) / 127)
    assert (rounded_rows(packed, k) - x).abs().max() <= 0.5 * d.max() * (1 + 1e-5)
    assert torch.allclose(sums, d * q.sum(-1)) and q.abs().max() <= 127 and not q[2, 0].any()
    for r in range(5):  # a row alone packs as it does among others
        assert torch.equal(tdp.quantize_rows(x[r:r + 1])[0], packed[r])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=["Q4_K", "Q8_0-split", "Q6_K-split"])
def test_int8_products_are_the_float_products_of_the_rounded_activations_alone_or_batched(qtype):
    """kernels/triton_quant_int8.py: one row on the dp4a GEMV, 2..64 on integer tensor cores; both are
    the float product of the int8-rounded rows with the exact weights (to float rounding), split-K and
    bias included, and a row's result is the same decoded alone or verified among others."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels import triton_quant_int8 as tqi
    k, n = 512, 40
    raw = quant_rows(qtype, n, k, seed=11)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    want = rounded_rows(tdp.quantize_rows(x), k) @ dequant.dequantize(raw, qtype).T
    split = qtype != Q.Q4_K
    weights = layout.split_rows(raw, qtype) if split else raw
    for split_k in (1, 2):
        one = tqi.matmul(x[:1], weights, qtype, split, k, split_k=split_k)
        assert rel_err(one, want[:1]) <= 1e-5
        assert torch.equal(tqi.matmul(x[:1], weights, qtype, split, k, split_k=split_k, stages=2), one)  # pipelined
        assert rel_err(tqi.matmul(x[:1], weights, qtype, split, k, bias, split_k=split_k), want[:1] + bias) <= 1e-5
        rows = tqi.matmul(x, weights, qtype, split, k, bias, split_k=split_k)
        assert rows.shape == (5, n) and rel_err(rows, want + bias) <= 1e-5
        assert rel_err(tqi.matmul(x, weights, qtype, split, k, split_k=split_k)[:1], one) <= 1e-6
    assert rel_err(want, x @ dequant.dequantize(raw, qtype).T) <= 3e-2  # near the unrounded product
    with pytest.raises(ValueError, match="one row"):
        tdp.gemv(x[:2], weights, qtype, split, k)
    with pytest.raises(ValueError, match="multiple of 256"):
        tqi.matmul(x[:, :96], weights[:, :1], qtype, split, 96)
    with pytest.raises(ValueError, match="at most 64 rows"):
        tqi.matmul(x.repeat(13, 1), weights, qtype, split, k)
    with pytest.raises(ValueError, match="Q5_K"):
        tqi.matmul(x, quant_rows(Q.Q5_K, n, k, seed=1), Q.Q5_K, False, k)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.Q6_K, Q.IQ4_XS],
                         ids=["Q4_K", "Q5_K", "Q8_0-split", "Q6_K-split", "IQ4_XS"])
def test_runs_kernels_are_the_float_products_of_the_rounded_row(qtype):
    """kernels/triton_dp4a_runs.py: the one-row int8 product in runs (split Q8_0 / Q6_K rows, ggml's
    Q4_K, Q5_K and IQ4_XS rows) equals the rounded row times the exact weights, whatever the split of K,
    the units an iteration and the bias."""
    from lucebox.kernels import triton_dp4a as tdp
    k, n = 768, 40  # three super-blocks: an odd one out for unroll 2 (split Q6_K: six, three a split)
    if qtype == Q.Q6_K:  # 210-byte super-blocks: an odd number leaves rows off 4-byte alignment
        with pytest.raises(ValueError, match="4-byte aligned"):
            tdp.gemv(torch.zeros(1, k, device=DEVICE), layout.split_rows(quant_rows(qtype, 2, k, 1), qtype), qtype,
                     True, k, runs=True)
        k = 1536
    raw = quant_rows(qtype, n, k, seed=31)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(32)).to(DEVICE)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(33)).to(DEVICE)
    want = rounded_rows(tdp.quantize_rows(x), k) @ dequant.dequantize(raw, qtype).T
    split = qtype in (Q.Q8_0, Q.Q6_K)
    weights = layout.split_rows(raw, qtype) if split else raw
    for split_k, unroll in ((1, 1), (1, 2), (2, 1), (2, 2)):
        got = tdp.gemv(x, weights, qtype, split, k, bias, split_k=split_k, runs=True, unroll=unroll)
        assert rel_err(got, want + bias) <= 1e-5
    with pytest.raises(ValueError, match="runs kernels" if (qtype, split) in tdp._KERNELS else "no dp4a GEMV reads"):
        tdp.gemv(x, weights, qtype, split, k, unroll=2)  # Q5_K, IQ4_XS: only a runs kernel reads them


def test_int8_activations_take_the_products_they_are_faster_for_unless_turned_off(monkeypatch):
    """By default (kernels/routing.QUANT_ROUTES): a Q4_K linear's one-row product runs on int8 activations
    and its verify rows on the float kernel; a split Q8_0 linear the other way round; Q5_K decode on
    its runs kernel (triton_dp4a_runs), its verify on the float kernel; LUCEBOX_INT8_ACTIVATIONS=0
    turns it all off."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels import triton_quant_int8 as tqi
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    monkeypatch.delenv("LUCEBOX_DP4A_RUNS", raising=False)  # the default routes
    calls = []
    monkeypatch.setattr(tqi, "matmul", lambda *a, _real=tqi.matmul, **kw: calls.append(a[2]) or _real(*a, **kw))
    k = 256
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    rounded = rounded_rows(tdp.quantize_rows(x), k)
    q4 = QuantLinear(QuantTensor(quant_rows(Q.Q4_K, 24, k, seed=21), Q.Q4_K, (24, k)))
    q8 = QuantLinear(QuantTensor(quant_rows(Q.Q8_0, 16, k, seed=24), Q.Q8_0, (16, k)))
    q5 = QuantLinear(QuantTensor(quant_rows(Q.Q5_K, 8, k, seed=22), Q.Q5_K, (8, k)))
    w4, w8 = dequant.dequantize(q4.qweight, Q.Q4_K), dequant.dequantize(q8.qweight, Q.Q8_0)
    q8.use_split_rows()
    assert rel_err(q4(x[:1]), rounded[:1] @ w4.T) <= 1e-5 and rel_err(q4(x), x @ w4.T) <= 1e-5
    assert rel_err(q8(x[:1]), x[:1] @ w8.T) <= 1e-5 and rel_err(q8(x), rounded @ w8.T) <= 1e-5
    assert calls == [Q.Q4_K, Q.Q8_0]
    w5 = dequant.dequantize(q5.qweight, Q.Q5_K)
    assert rel_err(q5(x[:1]), rounded[:1] @ w5.T) <= 1e-5 and rel_err(q5(x), x @ w5.T) <= 1e-5
    assert calls == [Q.Q4_K, Q.Q8_0, Q.Q5_K]
    monkeypatch.setenv("LUCEBOX_INT8_ACTIVATIONS", "0")
    assert rel_err(q4(x[:1]), x[:1] @ w4.T) <= 1e-5 and rel_err(q8(x), x @ w8.T) <= 1e-5
    assert rel_err(q5(x[:1]), x[:1] @ w5.T) <= 1e-5
    assert calls == [Q.Q4_K, Q.Q8_0, Q.Q5_K]


def test_the_runs_kernels_take_one_row_int8_products_when_switched_on(monkeypatch):
    """LUCEBOX_DP4A_RUNS=1 (an experiment until measured): a Q4_K linear's decode product goes to
    triton_dp4a_runs' kernel, a split Q8_0 one (float split-row GEMV by default) to int8 activations
    and its runs kernel, each equal to the float product of the rounded row; off by default. An
    IQ4_XS one takes its runs kernel either way (no other int8 kernel reads it)."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels import triton_dp4a_runs as tdr
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    launched = []
    real = tdp.one_row_gemv
    monkeypatch.setattr(tdp, "one_row_gemv", lambda kernel, *a, **kw: launched.append(kernel) or real(kernel, *a, **kw))
    k = 512
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(25)).to(DEVICE)
    rounded = rounded_rows(tdp.quantize_rows(x), k)
    linears = {qtype: QuantLinear(QuantTensor(quant_rows(qtype, 24, k, seed=26 + i), qtype, (24, k)))
               for i, qtype in enumerate((Q.Q4_K, Q.Q8_0, Q.IQ4_XS))}
    weights = {qtype: dequant.dequantize(lin.qweight, qtype) for qtype, lin in linears.items()}
    linears[Q.Q8_0].use_split_rows()
    monkeypatch.delenv("LUCEBOX_DP4A_RUNS", raising=False)
    for qtype, lin in linears.items():
        assert rel_err(lin(x), (x if qtype == Q.Q8_0 else rounded) @ weights[qtype].T) <= 1e-5
    assert launched == [tdp._KERNELS[(Q.Q4_K, False)], tdr.RUNS_KERNELS[(Q.IQ4_XS, False)]]  # Q8_0: float
    monkeypatch.setenv("LUCEBOX_DP4A_RUNS", "1")
    for qtype, lin in linears.items():
        assert rel_err(lin(x), rounded @ weights[qtype].T) <= 1e-5
    assert launched[2:] == [tdr.RUNS_KERNELS[key] for key in ((Q.Q4_K, False), (Q.Q8_0, True), (Q.IQ4_XS, False))]
    assert rel_err(lin(x.repeat(3, 1)), x.repeat(3, 1) @ weights[Q.IQ4_XS].T) <= 1e-5  # verify: the float kernel


def test_int8_activations_are_opt_in_on_rocm(monkeypatch):
    """Where int8 activations are faster was measured on an H200, and AMD GPUs run the one-row
    kernels without PTX dp4a: on a ROCm build they are off unless LUCEBOX_INT8_ACTIVATIONS=1."""
    from lucebox.kernels.dispatch import int8_activations
    for hip, setting, want in ((None, None, True), (None, "0", False), ("6.2", None, False),
                               ("6.2", "0", False), ("6.2", "1", True)):
        monkeypatch.setattr(torch.version, "hip", hip)
        if setting is None:
            monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
        else:
            monkeypatch.setenv("LUCEBOX_INT8_ACTIVATIONS", setting)
        assert int8_activations() is want, (hip, setting)


def test_products_of_one_input_share_its_rounding(monkeypatch):
    """kernels.linear.linears: products of one tensor on int8 activations quantise it once (given
    rows from its producer: not at all), and compute what they compute alone."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels import triton_quant_int8 as tqi
    from lucebox.kernels.linear import linears
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    rounds, real = [], tdp.quantize_rows
    for module in (tdp, tqi):
        monkeypatch.setattr(module, "quantize_rows", lambda x: rounds.append(1) or real(x))
    a = QuantLinear(QuantTensor(quant_rows(Q.Q4_K, 24, 256, seed=31), Q.Q4_K, (24, 256)))
    b = QuantLinear(QuantTensor(quant_rows(Q.Q4_K, 8, 256, seed=32), Q.Q4_K, (8, 256)))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(33)).to(DEVICE)
    alone = a(x), b(x)
    assert len(rounds) == 2
    shared = linears(x, (a, b.forward))  # a module, and a fused projection's bound forward
    assert len(rounds) == 2 + 1
    given = linears(x, (a, b), rows=real(x))
    assert len(rounds) == 2 + 1
    for got, want in zip(shared + given, alone + alone):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="do not match"):
        tqi.matmul(x, a.qweight, Q.Q4_K, False, 256, quantized=tdp.quantize_rows(x.repeat(2, 1)))


def test_attention_fuses_q_and_k_when_v_differs_and_rounds_their_input_once(monkeypatch):
    """Q4_K_M's layers (q and k in Q4_K, v in Q6_K): no q/k/v projection, but one for q and k; a
    decode step's q, k and v equal the unfused layer's."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.model.config import ModelConfig
    from lucebox.model.transformer import Attention
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    cfg = ModelConfig(family="qwen3", vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
    attn = Attention(cfg, 0).to(DEVICE)
    for name, qtype, seed in (("q_proj", Q.Q4_K, 41), ("k_proj", Q.Q4_K, 42), ("v_proj", Q.Q6_K, 43)):
        n = getattr(attn, name).out_features
        setattr(attn, name, QuantLinear(QuantTensor(quant_rows(qtype, n, 256, seed=seed), qtype, (n, 256))))
    h = torch.randn(1, 256, generator=torch.Generator().manual_seed(44)).to(DEVICE)
    want = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    attn.fuse()
    attn.fuse()  # idempotent
    assert attn.qkv is None and attn.qk is not None
    rounds = []
    monkeypatch.setattr(tdp, "quantize_rows", lambda x, _real=tdp.quantize_rows: rounds.append(1) or _real(x))
    got = attn._project(h)
    assert len(rounds) == 1  # q and k in one product; v (unsplit Q6_K here) on the float kernel
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) <= 1e-5


@pytest.mark.parametrize("residual", [False, True], ids=["alone", "with-residual"])
def test_norm_and_activation_round_their_output_rows_as_quantize_rows_does(residual):
    """kernels.norm.rms_norm_rounded / activation.silu_and_mul_rounded: the same output as without,
    and its rows rounded to int8 in the same launch, byte for byte what triton_dp4a.quantize_rows
    makes of that output."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels.activation import silu_and_mul, silu_and_mul_rounded
    from lucebox.kernels.norm import rms_norm, rms_norm_residual, rms_norm_rounded
    g = torch.Generator().manual_seed(51)
    x, r = (torch.randn(3, 512, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.rand(512, generator=g).to(DEVICE, torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUCEBOX_TRITON", "1")
        h, total, rows = rms_norm_rounded(x, r if residual else None, weight, 1e-6)
        want_h, want_total = rms_norm_residual(x, r, weight, 1e-6) if residual else (rms_norm(x, weight, 1e-6), None)
        assert torch.equal(h, want_h) and (total is None) == (not residual)
        assert total is None or torch.equal(total, want_total)
        assert torch.equal(rows, tdp.quantize_rows(h))
        gate, up = (torch.randn(2, 1280, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
        act, act_rows = silu_and_mul_rounded(gate, up)  # 1280: blocks over two programs of 1024
        assert torch.equal(act, silu_and_mul(gate, up)) and torch.equal(act_rows, tdp.quantize_rows(act))
        with pytest.raises(ValueError, match="multiple of 256"):
            silu_and_mul_rounded(gate[:, :96], up[:, :96])
        mp.setenv("LUCEBOX_TRITON", "0")  # the references: no rounded rows (their products take floats)
        assert rms_norm_rounded(x, None, weight, 1e-6)[2] is None and silu_and_mul_rounded(gate, up)[1] is None


def test_a_quantised_layer_rounds_its_inputs_where_they_are_made(monkeypatch):
    """With q/k in Q4_K, v in Q6_K and down in Q4_K: the norm before q/k/v and silu * up before down
    write the int8 rows their products take (no quantising launch of their own), and the results
    equal the unfused computation's."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels import triton_quant_int8 as tqi
    from lucebox.kernels.activation import silu_and_mul
    from lucebox.model.config import ModelConfig
    from lucebox.model.transformer import MLP, Attention, RMSNorm
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    cfg = ModelConfig(family="qwen3", vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
    attn, mlp, norm = Attention(cfg, 0).to(DEVICE), MLP(cfg).to(DEVICE), RMSNorm(256, 1e-6).to(DEVICE)
    for module, name, qtype, seed in ((attn, "q_proj", Q.Q4_K, 61), (attn, "k_proj", Q.Q4_K, 62),
                                      (attn, "v_proj", Q.Q6_K, 63), (mlp, "down_proj", Q.Q4_K, 64)):
        n, k = getattr(module, name).out_features, getattr(module, name).in_features
        setattr(module, name, QuantLinear(QuantTensor(quant_rows(qtype, n, k, seed=seed), qtype, (n, k))))
    attn.fuse()
    g = torch.Generator().manual_seed(65)
    x, residual = (torch.randn(1, 256, generator=g).to(DEVICE) for _ in range(2))
    gate_up = torch.randn(1, 1024, generator=g).to(DEVICE)
    h, total = norm(x, residual)
    want = (*attn._project(h), total), mlp.down_proj(silu_and_mul(*gate_up.chunk(2, dim=-1)))
    rounds, real = [], tdp.quantize_rows
    for module in (tdp, tqi):
        monkeypatch.setattr(module, "quantize_rows", lambda x: rounds.append(1) or real(x))
    with torch.no_grad():  # as the engine runs (the kernels have no backward)
        got = attn.project(norm, x, residual), mlp.down(gate_up)
    assert not rounds
    for g_, w in zip((*got[0], got[1]), (*want[0], want[1])):
        assert rel_err(g_, w) <= 1e-5


def test_the_attention_output_gate_rounds_the_rows_a_quantised_o_proj_takes(monkeypatch):
    """Gated attention's sigmoid(gate) * o before a Q4_K o_proj: one launch gates and rounds (no
    quantising launch of the product's own), and the result is the unfused computation's."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels import triton_quant_int8 as tqi
    from lucebox.kernels.activation import output_gate_reference
    from lucebox.kernels.linear import output_gate_linear
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    o_proj = QuantLinear(QuantTensor(quant_rows(Q.Q4_K, 32, 256, seed=66), Q.Q4_K, (32, 256)))
    g = torch.Generator().manual_seed(67)
    gate = torch.randn(1, 4, 128, generator=g).to(DEVICE)[..., 64:]
    o = torch.randn(1, 256, generator=g).to(DEVICE)
    want = o_proj(output_gate_reference(gate, o, "sigmoid"))
    rounds, real = [], tdp.quantize_rows
    for module in (tdp, tqi):
        monkeypatch.setattr(module, "quantize_rows", lambda x: rounds.append(1) or real(x))
    with torch.no_grad():
        got = output_gate_linear(gate, o, o_proj, "sigmoid")
    assert not rounds
    assert rel_err(got, want) <= 1e-5
