"""The RMSNorm kernels (kernels/norm.py, kernels/triton_norm.py) compute what their torch references
compute, rounded as the torch ops round: the norm fused with the residual add before it (every
decoder layer), a post-norm added to the stream with the layer's scale after it (Gemma's sandwich
norms), several weights over one normalised stream, and two branches' post-norms summed, normalised
and added (Gemma 4's MoE FFN output). Without a GPU the kernels run under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from lucebox.kernels import norm, triton_norm  # noqa: E402

from tests.kernels.test_triton_kernels import DEVICE, rel_err  # noqa: I001  (sets TRITON_INTERPRET=1 first)

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def stream_case(dtype, rows=5, hidden=48, weights=1, seed=7):
    """(x, stream, weights [weights, hidden]) with weights away from 1."""
    g = torch.Generator().manual_seed(seed)
    x, stream = (torch.randn(rows, hidden, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(weights, hidden, generator=g)).to(DEVICE, dtype)
    return x, stream, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_post_norm_adds_to_the_stream_in_one_kernel(dtype):
    """rms_norm_add (Gemma's sandwich norms): stream + rms_norm(y), rounded as the two torch ops."""
    g = torch.Generator().manual_seed(7)
    y, stream = (torch.randn(5, 48, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    got = triton_norm.rms_norm_add_triton(y, weight, 1e-6, stream)
    want = stream + norm.rms_norm_reference(y, weight, 1e-6)
    assert got.dtype == want.dtype and rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(got, norm.rms_norm_reference(y, weight, 1e-6)) > 0.1  # the stream is added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_norm_module_adds_the_residual_and_normalises_in_one_kernel(monkeypatch, dtype):
    from lucebox.model.transformer import RMSNorm

    g = torch.Generator().manual_seed(1)
    module = RMSNorm(48, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(48, generator=g))
    x, residual = (torch.randn(5, 48, generator=g).to(DEVICE, dtype) for _ in range(2))
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.inference_mode():
        want_h, want_sum = module(x, residual)
        assert torch.equal(want_h, module(x + residual)) and torch.equal(want_sum, x + residual)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls = []
    real = triton_norm.rms_norm_residual_triton
    monkeypatch.setattr(triton_norm, "rms_norm_residual_triton", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        h, total = module(x, residual)
    assert calls == [1] and torch.equal(total, want_sum)
    assert rel_err(h, want_h) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_training_keeps_the_differentiable_reference(monkeypatch):
    # The Triton kernels have no backward; train/lm.py trains through the same modules.
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.setattr(triton_norm, "rms_norm_triton", lambda *a: pytest.fail("Triton under autograd"))
    weight = torch.ones(16, device=DEVICE, requires_grad=True)
    norm.rms_norm(torch.randn(3, 16, device=DEVICE), weight, 1e-6).sum().backward()
    assert weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_post_norm_add_takes_the_layer_scale_in_its_launch(dtype):
    y, stream, w = stream_case(dtype)
    scale = torch.tensor([0.75], dtype=dtype, device=DEVICE)
    got = triton_norm.rms_norm_add_triton(y, w[0], 1e-6, stream, scale)
    want = (stream + norm.rms_norm_reference(y, w[0], 1e-6)) * scale
    assert rel_err(got, want) <= TOL[dtype]
    assert rel_err(got, stream + norm.rms_norm_reference(y, w[0], 1e-6)) > 0.1  # the scale is applied
    with pytest.raises(ValueError, match="one value"):
        triton_norm.rms_norm_add_triton(y, w[0], 1e-6, stream, torch.ones(2, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_several_weights_over_one_stream_take_one_launch(dtype):
    x, _, w = stream_case(dtype, weights=3)
    got, rows = triton_norm.rms_norm_many_triton(x, w, 1e-6)
    assert got.shape == (3, *x.shape) and rows is None
    for i in range(3):
        assert rel_err(got[i], norm.rms_norm_reference(x, w[i], 1e-6)) <= TOL[dtype]
    reference, reference_rows = norm.rms_norm_many(x.cpu(), w.cpu(), 1e-6)  # the dispatcher's CPU path
    assert reference_rows is None and rel_err(reference, got.cpu()) <= TOL[dtype]
    with pytest.raises(ValueError, match=r"\[outputs, 48\]"):
        triton_norm.rms_norm_many_triton(x, w[:, :40], 1e-6)


def test_the_first_of_several_norms_rounds_its_rows_as_the_single_norm_does():
    x, _, w = stream_case(torch.bfloat16, rows=3, hidden=256, weights=2)
    got, rows = triton_norm.rms_norm_many_triton(x, w, 1e-6, rounded=True)
    want, _, want_rows = triton_norm.rms_norm_rounded_triton(x, None, w[0], 1e-6)
    assert torch.equal(got[0], want) and torch.equal(rows, want_rows)
    assert torch.equal(got[1], triton_norm.rms_norm_triton(x, w[1], 1e-6))


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_branches_post_norms_sum_normalise_and_add_in_one_launch(dtype, scaled):
    a, stream, w = stream_case(dtype, weights=3)
    b = 3 * torch.randn(a.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    scale = torch.tensor([1.25], dtype=dtype, device=DEVICE) if scaled else None
    got = triton_norm.rms_norm_pair_add_triton(a, b, w, 1e-6, stream, scale)
    h = norm.rms_norm_reference(a, w[0], 1e-6) + norm.rms_norm_reference(b, w[1], 1e-6)
    want = stream + norm.rms_norm_reference(h, w[2], 1e-6)
    want = want * scale if scaled else want
    assert got.dtype == dtype and rel_err(got, want) <= TOL[dtype]
    cpu = [t.cpu() if t is not None else None for t in (a, b, w, stream, scale)]
    reference = norm.rms_norm_pair_add(*cpu[:3], 1e-6, *cpu[3:])  # the dispatcher's CPU path
    assert rel_err(reference, want.cpu()) <= TOL[dtype]
    with pytest.raises(ValueError, match="one dtype"):
        triton_norm.rms_norm_pair_add_triton(a, b.double(), w, 1e-6, stream)
    with pytest.raises(ValueError, match="must match"):
        triton_norm.rms_norm_pair_add_triton(a[:2], b, w, 1e-6, stream)
