"""A decode token's GEMV with the op before it in its prologue (kernels/linear.py,
kernels/triton_gemv.py) computes what the unfused torch ops compute: RMSNorm with the residual add,
silu(gate) * up, or nothing; and a fused model decodes through those GEMVs as the reference path.
Without a GPU the kernels run under Triton's interpreter (set up by tests/test_triton_kernels.py,
imported first), on small shapes."""
from __future__ import annotations

import pytest
import torch

from lucebox.kernels import linear, triton_gemv  # noqa: E402

from tests.kernels.test_triton_kernels import DEVICE, rel_err  # noqa: I001  (sets TRITON_INTERPRET=1 first)

GEMV_CASES = {  # name: (prologue, with a residual)
    "plain": (triton_gemv.IDENTITY, False),
    "norm": (triton_gemv.NORM, False),
    "norm+residual": (triton_gemv.NORM, True),
    "silu*up": (triton_gemv.SILU_MUL, False),
}


def gemv_case(prologue, with_residual, dtype, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 2 * k if prologue == triton_gemv.SILU_MUL else k
    x = (2 * torch.randn(1, width, generator=g)).to(DEVICE, dtype)
    residual = torch.randn(1, k, generator=g).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + 0.2 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, residual, norm_weight, weight, b


def gemv_reference(prologue, x, residual, norm_weight, weight, bias):
    if prologue == triton_gemv.NORM:
        return linear.norm_linear_reference(x, residual, norm_weight, 1e-6, weight, bias)
    if prologue == triton_gemv.SILU_MUL:
        return linear.silu_mul_linear_reference(x, weight, bias), None
    return torch.nn.functional.linear(x, weight, bias), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(GEMV_CASES))
@pytest.mark.parametrize("config", [None, (4, 64, 4, 0), (4, 256, 4, 3)], ids=["default-launch", "k-loop", "resident"])
def test_decode_gemv_with_its_prologue_matches_the_unfused_ops(case, dtype, config):
    """N and K not multiples of the blocks; (4, 64, 4, 0) makes every program loop over K, (4, 256,
    4, 3) has three programs walk the ten row blocks with the input kept in registers."""
    prologue, with_residual = GEMV_CASES[case]
    x, residual, norm_weight, weight, bias = gemv_case(prologue, with_residual, dtype, 37, 200, bias=True)
    got, total = triton_gemv.gemv(x, weight, bias, prologue, residual, norm_weight, 1e-6, config=config)
    want, want_total = gemv_reference(prologue, x, residual, norm_weight, weight, bias)
    assert got.dtype == want.dtype and got.shape == want.shape == (1, 37)
    assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)
    if with_residual:
        assert torch.equal(total, want_total)  # the next layer's residual stream, bit for bit
    if prologue != triton_gemv.IDENTITY:  # the prologue is applied, not skipped
        raw = torch.nn.functional.linear(x[:, :200], weight, bias)
        assert rel_err(got, raw) > 0.1


def test_decode_gemv_refuses_inputs_that_do_not_fit_its_weights():
    weight = torch.randn(8, 32).to(DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        triton_gemv.gemv(torch.randn(2, 32).to(DEVICE), weight)
    with pytest.raises(ValueError, match="does not fit"):
        triton_gemv.gemv(torch.randn(1, 32).to(DEVICE), weight, prologue=triton_gemv.SILU_MUL)


def test_fused_linears_take_the_gemv_for_one_float_row_only(monkeypatch):
    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, residual, norm_weight, weight, _ = gemv_case(triton_gemv.NORM, True, torch.float32, 16, 32, bias=False)
    projection = linear.FusedProjection(weight, None)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    (y,), total = linear.norm_linear(x, residual, norm_weight, 1e-6, (projection,))
    assert calls == [1] and torch.equal(total, x + residual)
    linear.norm_linear(x.repeat(2, 1), residual.repeat(2, 1), norm_weight, 1e-6, (projection,))  # two rows
    linear.linear(x, linear.FusedProjection(weight.t().contiguous().t(), None))  # rows not contiguous
    with torch.enable_grad():
        linear.linear(x, linear.FusedProjection(weight.clone().requires_grad_(), None))  # autograd: the reference
    linear.norm_linear(x, residual, norm_weight, 1e-6, (projection, projection))  # several: the norm, then each
    assert calls == [1]
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    linear.silu_mul_linear(torch.randn(1, 64).to(DEVICE), projection)
    assert calls == [1]
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    linear.silu_mul_linear(torch.randn(1, 64).to(DEVICE), projection)
    assert calls == [1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_fused_model_decodes_one_sequence_through_the_gemvs_as_the_reference_path(monkeypatch, dtype):
    """fuse_projections + a one-token step: every q/k/v, o, gate/up and down projection of every
    layer is one GEMV with its prologue; logits and DFlash taps match the unfused reference ops."""
    from lucebox.engine.block_manager import BlockManager
    from lucebox.engine.runner import ModelRunner
    from lucebox.engine.step_plan import StepPlan
    from lucebox.model.config import ModelConfig
    from lucebox.model.transformer import Transformer

    torch.manual_seed(1)
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True)
    model = Transformer(cfg).to(DEVICE, dtype)
    model.fuse_projections()
    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: calls.append(a[3] if len(a) > 3 else 0)
                        or real(*a, **kw))

    def run_steps():
        runner, blocks, table = ModelRunner(model, 8, 4), BlockManager(8, 4), []
        blocks.allocate(table, 9)
        prompt = runner.run(StepPlan.forward([[3, 1, 4, 1, 5, 9, 2]], [0], [table], capture_layers=(0, 2)))
        decode = runner.run(StepPlan.forward([[6]], [7], [table], capture_layers=(0, 2)))
        return torch.cat([prompt.logits, decode.logits]), torch.cat([prompt.features, decode.features])

    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want, want_taps = run_steps()
    assert calls == []
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got, taps = run_steps()
    assert sorted(calls) == sorted([triton_gemv.NORM, triton_gemv.IDENTITY, triton_gemv.NORM,
                                    triton_gemv.SILU_MUL] * cfg.num_layers)  # the decode step only
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert rel_err(got, want) <= tol and rel_err(taps, want_taps) <= tol
