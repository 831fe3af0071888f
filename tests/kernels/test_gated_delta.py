"""The gated delta rule's batched paths against the token-by-token specification
(recurrent_gated_delta_rule): the torch reference of gated_delta_steps, the Triton kernel (under
TRITON_INTERPRET=1 on the CPU), and the chunked prefill path, each with GVA, ragged sequences,
slots in any order, and states written back only where asked."""
from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Triton's interpreter must be on before Triton loads (see test_triton_kernels.py).
INTERPRETABLE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1" or "triton" not in sys.modules
if not ON_GPU and INTERPRETABLE:
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox.kernels import routing
from lucebox.kernels.gated_delta import (
    gated_delta_chunk,
    gated_delta_steps,
    gated_delta_steps_reference,
    l2_normalize,
    recurrent_gated_delta_rule,
)

DEVICE = "cuda" if ON_GPU else "cpu"
K_HEADS, V_HEADS, DK, DV = 2, 6, 16, 24  # GVA: 3 value heads a key head; dv not a power of two


def case(lens, seed=0, slots=6):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = l2_normalize(torch.randn(t, K_HEADS, DK, generator=g)) * DK ** -0.5
    k = l2_normalize(torch.randn(t, K_HEADS, DK, generator=g))
    v = torch.randn(t, V_HEADS, DV, generator=g)
    decay = -torch.rand(t, V_HEADS, generator=g) * 0.5
    beta = torch.rand(t, V_HEADS, generator=g)
    state = torch.randn(slots, V_HEADS, DK, DV, generator=g) * 0.3
    return [x.to(DEVICE) for x in (q, k, v, decay, beta, state)]


def reference(q, k, v, decay, beta, start, rows):
    """The specification for one sequence's rows: (o [L, Hv, dv], state after each token)."""
    group = V_HEADS // K_HEADS
    qh, kh = (x[rows].repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))
    outs, states, s = [], [], start
    for t in range(qh.shape[1]):
        o, s = recurrent_gated_delta_rule(qh[:, t:t + 1], kh[:, t:t + 1], v[rows][t:t + 1].transpose(0, 1),
                                          decay[rows][t:t + 1].t(), beta[rows][t:t + 1].t(), s)
        outs.append(o.transpose(0, 1))
        states.append(s)
    return torch.cat(outs), states


LENS = [3, 1, 4, 2]
SLOTS = [4, 0, 2, 5]
ADVANCE = [3, 1, 0, 1]  # whole, decode, verify (read only), part of a row


def check_steps(run):
    q, k, v, decay, beta, state = case(LENS)
    before = state.clone()
    starts = torch.tensor([0, 3, 4, 8], device=DEVICE)
    ends = torch.tensor([3, 4, 8, 10], device=DEVICE)
    idx = lambda values: torch.tensor(values, device=DEVICE)
    out = run(q, k, v, decay, beta, state, idx(SLOTS), starts, ends, idx(ADVANCE), max(LENS))
    for i, (slot, advance) in enumerate(zip(SLOTS, ADVANCE)):
        rows = slice(int(starts[i]), int(ends[i]))
        want, states = reference(q, k, v, decay, beta, before[slot], rows)
        assert (out[rows] - want).abs().max() <= 1e-5, i
        expect = states[advance - 1] if advance else before[slot]
        assert (state[slot] - expect).abs().max() <= 1e-5, i
    untouched = [s for s in range(state.shape[0]) if s not in SLOTS]
    assert torch.equal(state[untouched], before[untouched])


def test_torch_reference_steps_follow_the_specification():
    check_steps(gated_delta_steps_reference)


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
def test_triton_steps_follow_the_specification(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    assert routing.gated_delta_route("steps", triton=True) == routing.TRITON_STEPS
    from lucebox.kernels.triton_gated_delta import gated_delta_steps_triton
    check_steps(lambda *a: gated_delta_steps_triton(*a[:-1]))
    check_steps(gated_delta_steps)  # the dispatch picks it


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
def test_triton_commit_writes_state_only(monkeypatch):
    """outputs=False (a verify's commit): no q, no outputs, the state after `advance` tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    q, k, v, decay, beta, state = case([4])
    before = state.clone()
    idx = lambda values: torch.tensor(values, device=DEVICE)
    assert gated_delta_steps(None, k, v, decay, beta, state, idx([3]), idx([0]), idx([3]), idx([3]), 4,
                             outputs=False) is None
    _, states = reference(q, k, v, decay, beta, before[3], slice(0, 4))
    assert (state[3] - states[2]).abs().max() <= 1e-5


def test_routes_name_a_kernel_per_op():
    assert routing.gated_delta_route("steps") == routing.TORCH_STEPS
    assert routing.gated_delta_route("chunk", fla=True) == routing.FLA_CHUNK
    assert routing.gated_delta_route("chunk", fla=False) == routing.TORCH_CHUNK


def test_chunk_path_matches_the_specification_per_sequence():
    """Prefill chunks of several sequences in one call (torch path on the CPU; fla on a GPU with fla-core)."""
    lens, slots = [70, 1, 5], [1, 3, 0]
    q, k, v, decay, beta, state = case(lens, seed=3)
    before = state.clone()
    starts = [0, 70, 71, 76]
    out = gated_delta_chunk(q, k, v, decay, beta, state, slots, starts)
    tol = 1e-4 if DEVICE == "cpu" else 2e-2  # fla computes in tf32 / bf16 tiles
    for i, slot in enumerate(slots):
        rows = slice(starts[i], starts[i + 1])
        want, states = reference(q, k, v, decay, beta, before[slot], rows)
        assert (out[rows].float() - want).abs().max() <= tol, i
        assert (state[slot] - states[-1]).abs().max() <= tol, i
