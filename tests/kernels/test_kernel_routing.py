"""kernels/routing.py: which kernel runs each product, pinned (decisions only: nothing launches).

The GPU is faked by routing's use_triton answering yes for CPU tensors, so the choices the H200
makes for (weights, rows) are checked on any machine.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import nn

from lucebox.kernels import routing
from lucebox.kernels.linear import FusedProjection, kernel_for, takes_int8
from lucebox.weights.quant import QuantLinear, QuantTensor

# (ggml type, split rows) -> ((decode, verify) with int8 activations allowed, (decode, verify) without)
PINNED = {
    (Q.Q4_K, False): (("int8_gemv", "quant_tiles"), ("quant_gemv", "quant_tiles")),
    (Q.Q6_K, True): (("int8_gemv", "quant_tiles"), ("split_gemv", "quant_tiles")),
    (Q.Q8_0, True): (("split_gemv", "int8_tiles"), ("split_gemv", "quant_tiles")),
    (Q.Q8_0, False): (("quant_gemv", "quant_tiles"),) * 2,
    (Q.Q6_K, False): (("quant_gemv", "quant_tiles"),) * 2,
    (Q.Q5_K, False): (("int8_gemv", "quant_tiles"), ("quant_gemv", "quant_tiles")),  # a runs kernel
    (Q.Q4_0, False): (("quant_gemv", "quant_tiles"),) * 2,
    (Q.IQ4_XS, False): (("int8_gemv", "quant_tiles"), ("quant_gemv", "quant_tiles")),  # a runs kernel
    **{(qtype, False): (("quant_gemv", "quant_tiles"),) * 2 for qtype in (Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL)},
}


@pytest.fixture(autouse=True)
def default_routes(monkeypatch):
    monkeypatch.delenv("LUCEBOX_DP4A_RUNS", raising=False)  # the opt-in runs kernels: their own test below


@pytest.mark.parametrize("key", list(PINNED), ids=lambda k: f"{k[0].name}{'-split' if k[1] else ''}")
def test_the_quantised_table_picks_todays_kernels(key):
    qtype, split = key
    for int8, (decode, verify) in zip((True, False), PINNED[key]):
        for rows, want in ((1, decode), (2, verify), (16, verify), (64, verify), (65, "dequant_matmul")):
            assert routing.quant_kernel(qtype, split, rows, fused=True, int8=int8) == want, (rows, int8)
        for rows in (1, 16, 65):  # where Triton cannot read the rows in place (the CPU, odd layouts)
            assert routing.quant_kernel(qtype, split, rows, fused=False, int8=int8) == "dequant_matmul"


def test_the_runs_switch_sends_their_formats_decode_to_int8_activations(monkeypatch):
    """LUCEBOX_DP4A_RUNS=1: one row of every format triton_dp4a_runs reads takes int8 activations (where
    they are allowed); verify rows and every other format keep today's kernels."""
    monkeypatch.setenv("LUCEBOX_DP4A_RUNS", "1")
    assert routing.DP4A_RUNS_TYPES == {(Q.Q4_K, False), (Q.Q5_K, False), (Q.Q6_K, True), (Q.Q8_0, True),
                                       (Q.IQ4_XS, False)}
    for (qtype, split), (allowed, without) in PINNED.items():
        runs = (qtype, split) in routing.DP4A_RUNS_TYPES
        assert routing.quant_kernel(qtype, split, 1, fused=True, int8=True) == ("int8_gemv" if runs else allowed[0])
        assert routing.quant_kernel(qtype, split, 16, fused=True, int8=True) == allowed[1]
        assert routing.quant_kernel(qtype, split, 1, fused=True, int8=False) == without[0]


def test_every_int8_route_has_its_kernels():
    from lucebox.kernels import triton_dp4a, triton_dp4a_runs, triton_quant_int8
    for key, (decode, verify) in routing.QUANT_ROUTES.items():
        if decode in routing.INT8:  # the default one-row kernel, or a runs kernel where only one reads the rows
            assert key in triton_dp4a._KERNELS or (key in routing.RUNS_ONLY_TYPES
                                                   and key in triton_dp4a_runs.RUNS_KERNELS)
        if verify in routing.INT8:
            assert key in triton_quant_int8._KERNELS


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(routing, "use_triton", lambda *tensors: True)
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    return monkeypatch


def quant_linear(qtype, n: int, k: int, split: bool = False) -> QuantLinear:
    block, size = GGML_QUANT_SIZES[qtype]
    layer = QuantLinear(QuantTensor(torch.zeros(n, k // block * size, dtype=torch.uint8), qtype, (n, k)))
    layer.split_rows = split  # the layout flag alone: routing reads no bytes
    return layer


def test_quantised_products_route_by_rows_setting_and_vendor(fake_gpu):
    q4, q8 = quant_linear(Q.Q4_K, 8, 256), quant_linear(Q.Q8_0, 8, 256, split=True)
    one, four, many = (torch.zeros(rows, 256, dtype=torch.bfloat16) for rows in (1, 4, 65))
    assert [kernel_for("linear", x, q4) for x in (one, four, many)] == ["int8_gemv", "quant_tiles", "dequant_matmul"]
    assert [kernel_for("linear", x, q8) for x in (one, four, many)] == ["split_gemv", "int8_tiles", "dequant_matmul"]
    assert kernel_for("linear", one.half(), q4.forward) == "int8_gemv"  # a fused projection's bound forward
    assert kernel_for("linear", one.to(torch.int32), q4) == "dequant_matmul"  # no fused kernel for the dtype
    assert takes_int8((q8, q4), one) and takes_int8((q8,), four) and not takes_int8((q8,), one)
    fake_gpu.setenv("LUCEBOX_INT8_ACTIVATIONS", "0")
    assert kernel_for("linear", one, q4) == "quant_gemv" and kernel_for("linear", four, q8) == "quant_tiles"
    fake_gpu.setenv("LUCEBOX_INT8_ACTIVATIONS", "1")
    fake_gpu.setattr(torch.version, "hip", "6.2")  # AMD: no dp4a kernels, whatever the setting
    assert kernel_for("linear", one, q4) == "quant_gemv" and kernel_for("linear", four, q8) == "quant_tiles"


def test_float_products_take_the_gemv_for_one_row_of_one_projection(fake_gpu):
    weight = torch.zeros(8, 16)
    linear, fused = nn.Linear(16, 8), FusedProjection(weight, None)
    one, two = torch.zeros(1, 16), torch.zeros(2, 16)
    with torch.no_grad():
        assert kernel_for("linear", one, linear) == kernel_for("linear", one, fused) == "gemv"
        assert kernel_for("norm_linear", one, fused, None, torch.ones(16)) == "gemv+norm"
        assert kernel_for("silu_mul_linear", torch.zeros(1, 32), fused) == "gemv+silu_mul"
        assert kernel_for("linear", two, fused) == "torch"
        assert kernel_for("products", one, fused) == "torch"  # several projections of one input: F.linear each
        assert kernel_for("linear", one.half(), fused) == "torch"  # weights of another dtype
        assert kernel_for("norm_linear", one, fused, None, torch.ones(16).half()) == "torch"  # an operand too
        assert kernel_for("linear", one, FusedProjection(weight.t().contiguous().t(), None)) == "torch"
    with torch.enable_grad():
        assert kernel_for("linear", one, FusedProjection(weight.clone().requires_grad_(), None)) == "torch"

    class Scaled(nn.Linear):  # another module: called as it is
        pass
    assert kernel_for("linear", one, Scaled(16, 8)) == "torch"


def test_without_triton_every_product_takes_the_torch_reference(monkeypatch):
    monkeypatch.setattr(routing, "use_triton", lambda *tensors: False)
    q4 = quant_linear(Q.Q4_K, 8, 256)
    one = torch.zeros(1, 256)
    assert kernel_for("linear", one, q4) == "dequant_matmul"
    assert kernel_for("linear", one, FusedProjection(torch.zeros(8, 256), None)) == "torch"
    assert not takes_int8((q4,), one)


def test_a_projection_that_reorders_its_input_is_called_not_multiplied_by_its_rows(fake_gpu):
    """PermutedInputQuantLinear (GGUF DeltaNet ssm_out) multiplies x[..., order]: the shared int8
    rounding of x (linears, norm_rows) would give the unpermuted product, so its rows are not
    offered to the kernels and the module's own forward runs."""
    from lucebox.kernels.linear import quant_rows
    from lucebox.weights.quant import PermutedInputQuantLinear
    plain = quant_linear(Q.Q4_K, 8, 256)
    permuted = PermutedInputQuantLinear(plain.weight, torch.arange(255, -1, -1))
    x = torch.zeros(1, 256)
    assert quant_rows(plain) is plain and quant_rows(permuted) is None
    assert kernel_for("products", x, plain) == "int8_gemv" and kernel_for("products", x, permuted) == routing.TORCH
    assert takes_int8((plain,), x) and not takes_int8((permuted,), x)
