"""The gated delta rule's batched paths against the token-by-token specification
(recurrent_gated_delta_rule): the torch reference of gated_delta_steps, the Triton kernel (under
TRITON_INTERPRET=1 on the CPU), and the chunked prefill path, each with GVA, ragged sequences,
slots in any order, and states written back only where asked."""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Triton's interpreter must be on before Triton loads (see test_triton_kernels.py).
INTERPRETABLE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1" or "triton" not in sys.modules
if not ON_GPU and INTERPRETABLE:
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox.kernels import gated_delta as gd
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


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU"))])
def test_steps_normalise_raw_q_and_k_themselves(kernel, monkeypatch):
    """normalize=True: q/k straight from the conv (any length, strided views of one row) give what
    normalised, scaled q/k give."""
    if kernel == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("LUCEBOX_TRITON", "1" if kernel == "triton" else "0")
    q, k, v, decay, beta, state = case(LENS, seed=5)
    rows = torch.cat([q.flatten(1) * 3.0, k.flatten(1) * 0.5, v.flatten(1)], dim=1)  # one conv row: q | k | v
    raw_q = rows[:, :K_HEADS * DK].view(-1, K_HEADS, DK)
    raw_k = rows[:, K_HEADS * DK:2 * K_HEADS * DK].view(-1, K_HEADS, DK)
    raw_v = rows[:, 2 * K_HEADS * DK:].view(-1, V_HEADS, DV)
    starts, ends = torch.tensor([0, 3, 4, 8], device=DEVICE), torch.tensor([3, 4, 8, 10], device=DEVICE)
    idx = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    want_state = state.clone()
    want = gated_delta_steps_reference(q, k, v, decay, beta, want_state, idx(SLOTS), starts, ends, idx(ADVANCE), 4)
    got = gated_delta_steps(raw_q, raw_k, raw_v, decay, beta, state, idx(SLOTS), starts, ends, idx(ADVANCE), 4,
                            normalize=True, scale=DK ** -0.5)
    assert (got - want).abs().max() <= 1e-5 and (state - want_state).abs().max() <= 1e-5


def conv_case(seed=0):
    """4 sequences (the last a padding one on the scratch slot 5) of 3, 1, 2, 1 rows; windows of 3."""
    g = torch.Generator().manual_seed(seed)
    channels, kernel, slots_n = 40, 4, 6
    qkv = torch.randn(7, channels, generator=g)
    conv = torch.randn(slots_n, channels, kernel - 1, generator=g)
    weight = torch.randn(channels, kernel, generator=g)
    idx = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    rows = dict(slots=idx([2, 0, 4, 5]), starts=idx([0, 3, 4, 6]), advance=idx([3, 1, 0, 0]),
                seq=idx([0, 0, 0, 1, 2, 2, 3]), local=idx([0, 1, 2, 0, 0, 1, 0]))
    return qkv.to(DEVICE), conv.to(DEVICE), weight.to(DEVICE), rows


def test_conv_steps_reference_is_the_causal_conv_of_each_sequence():
    from lucebox.kernels.gated_delta import conv_steps_reference
    qkv, conv, weight, rows = conv_case()
    before = conv.clone()
    positions = 2
    stash = tuple(torch.zeros(6 * positions + 1, qkv.shape[1], device=DEVICE) for _ in range(2))
    out = conv_steps_reference(qkv, conv, weight, **rows, stash=stash, positions=positions)
    for b, (slot, start, n, advance) in enumerate(zip([2, 0, 4, 5], [0, 3, 4, 6], [3, 1, 2, 1], [3, 1, 0, 0])):
        window = torch.cat([before[slot], qkv[start:start + n].t()], dim=1)
        want = torch.nn.functional.silu(torch.nn.functional.conv1d(window[None], weight[:, None], groups=40)[0]).t()
        assert (out[start:start + n] - want).abs().max() <= 1e-5
        expect = window[:, advance:advance + 3] if advance else before[slot]
        assert torch.equal(conv[slot], expect)
        for j in range(min(n, positions)):
            assert torch.equal(stash[0][slot * positions + j], qkv[start + j])
            assert torch.equal(stash[1][slot * positions + j], out[start + j])


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
def test_triton_conv_steps_match_the_reference(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    from lucebox.kernels.gated_delta import conv_steps, conv_steps_reference
    qkv, conv, weight, rows = conv_case(seed=1)
    positions = 3
    stashes = [tuple(torch.zeros(6 * positions + 1, qkv.shape[1], device=DEVICE) for _ in range(2))
               for _ in range(2)]
    want_conv = conv.clone()
    want = conv_steps_reference(qkv, want_conv, weight, **rows, stash=stashes[0], positions=positions)
    got = conv_steps(qkv, conv, weight, **rows, stash=stashes[1], positions=positions)
    assert (got - want).abs().max() <= 1e-5
    assert torch.equal(conv, want_conv)
    for a, b in zip(*stashes):
        assert (a[:-1] - b[:-1]).abs().max() <= 1e-6  # the trash row aside


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_one_launch_conv_and_gates_match_the_torch_ops(tree, monkeypatch):
    """conv_gate_steps (decode / verify rows): the conv, its stash, the windows' move and the gates
    with their stash from one Triton launch, as conv_steps and gates compute them in torch."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from lucebox.kernels import triton_deltanet_conv
    from lucebox.kernels.gated_delta import conv_gate_steps
    qkv, conv, weight, rows = conv_case(seed=3)
    g = torch.Generator().manual_seed(4)
    a, b = ((torch.randn(7, V_HEADS, generator=g) * 4).to(DEVICE) for _ in range(2))
    a_log, dt_bias = (torch.randn(V_HEADS, generator=g).to(DEVICE) for _ in range(2))
    links = None
    if tree:  # sequence 0: a root and two children of it (depths 0, 1, 1)
        links = (torch.tensor([-1, 0, 0, -1, -1, 4, -1], device=DEVICE), torch.tensor([0, 1, 1, 0, 0, 1, 0], device=DEVICE))
    step_rows = SimpleNamespace(**rows, ends=torch.tensor([3, 4, 6, 7], device=DEVICE), max_len=3, tree=links)
    positions = 2
    stash_row = torch.where(rows["local"] < positions, rows["slots"][rows["seq"]] * positions + rows["local"], 12)
    results, calls = [], []
    real = triton_deltanet_conv.conv_gate_steps_triton
    monkeypatch.setattr(triton_deltanet_conv, "conv_gate_steps_triton", lambda *x: calls.append(1) or real(*x))
    for switch in ("0", "1"):
        monkeypatch.setenv("LUCEBOX_TRITON", switch)
        windows = conv.clone()
        stash = tuple(torch.zeros(6 * positions + 1, qkv.shape[1], device=DEVICE) for _ in range(2))
        gate_stash = (torch.zeros(13, V_HEADS, device=DEVICE), torch.zeros(13, V_HEADS, device=DEVICE), stash_row)
        calls.clear()
        out = conv_gate_steps(qkv, a, b, windows, weight, a_log, dt_bias, step_rows, stash, positions, gate_stash)
        assert calls == ([1] if switch == "1" else [])
        results.append((*out, windows, *stash, *gate_stash[:2]))
    for name, want, got in zip(["mixed", "g", "beta", "windows", "raw", "stash mixed", "stash g", "stash beta"],
                               *results):
        assert (got[:12] - want[:12]).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), name
    assert not torch.equal(results[0][3], conv)  # windows moved


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
@pytest.mark.parametrize("accepted", [[0, 3], [1, 2]])
def test_a_commit_through_triton_matches_the_torch_one(accepted, monkeypatch):
    """RecurrentState.commit (the steps kernel over stashed rows, then the windows) on both paths."""
    pytest.importorskip("triton")
    from lucebox.model.recurrent_state import RecurrentState
    g = torch.Generator().manual_seed(7)
    channels = 2 * K_HEADS * DK + V_HEADS * DV
    states = [RecurrentState(3, 4, (V_HEADS, DK, DV), (channels, 3), K_HEADS, torch.float32, DEVICE)
              for _ in range(2)]
    for name in ("state", "conv", "stash_raw", "stash_mixed", "stash_g", "stash_beta"):
        value = torch.randn(getattr(states[0], name).shape, generator=g).to(DEVICE)
        if name == "stash_g":
            value = -value.abs()
        for state in states:
            getattr(state, name).copy_(value)
    slots, counts = torch.tensor([2, 0], device=DEVICE), torch.tensor(accepted, device=DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    states[0].commit(slots, counts)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    states[1].commit(slots, counts)
    assert (states[0].state - states[1].state).abs().max() <= 1e-5
    assert torch.equal(states[0].conv, states[1].conv)


@pytest.mark.skipif(not ON_GPU, reason="the Qwen3.6-27B shape compiled on a GPU")
def test_triton_steps_at_the_qwen36_27b_shape():
    """Hk=16, Hv=48, dk=dv=128: a decode and a 16-token verify, raw q/k normalised in the kernel."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lens, k_heads, v_heads, d = [1, 16], 16, 48, 128
    t = sum(lens)
    q, k = (torch.randn(t, k_heads, d, generator=g, device="cuda") for _ in range(2))
    v = torch.randn(t, v_heads, d, generator=g, device="cuda")
    decay = -torch.rand(t, v_heads, generator=g, device="cuda") * 0.3
    beta = torch.rand(t, v_heads, generator=g, device="cuda")
    state = torch.randn(3, v_heads, d, d, generator=g, device="cuda") * 0.1
    args = (torch.tensor([2, 0], device="cuda"), torch.tensor([0, 1], device="cuda"),
            torch.tensor([1, 17], device="cuda"), torch.tensor([1, 0], device="cuda"), 16)
    want_state = state.clone()
    want = gated_delta_steps_reference(q, k, v, decay, beta, want_state, *args, normalize=True, scale=d ** -0.5)
    got = gated_delta_steps(q, k, v, decay, beta, state, *args, normalize=True, scale=d ** -0.5)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert (state - want_state).abs().max() <= 1e-3 * want_state.abs().max()


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
def test_triton_gates_match_the_reference(monkeypatch):
    """g = -exp(A_log) softplus(a + dt_bias) (both sides of softplus's threshold) and beta = sigmoid(b)."""
    pytest.importorskip("triton")
    from lucebox.kernels.gated_delta import gates
    g = torch.Generator().manual_seed(2)
    a = (torch.randn(5, V_HEADS, generator=g) * 15).to(DEVICE)
    b = torch.randn(5, V_HEADS, generator=g).to(DEVICE)
    a_log, dt_bias = torch.randn(V_HEADS, generator=g).to(DEVICE), torch.randn(V_HEADS, generator=g).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want = gates(a, b, a_log, dt_bias)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got = gates(a, b, a_log, dt_bias)
    for x, y in zip(got, want):
        assert (x - y).abs().max() <= 1e-5 * max(1.0, y.abs().max().item())
    # a verify's stash: each token's g and beta kept at its row too, the other rows untouched
    rows = torch.tensor([7, 2, 9, 0, 4], device=DEVICE)
    for switch in ("0", "1"):
        monkeypatch.setenv("LUCEBOX_TRITON", switch)
        g_store, beta_store = (torch.full((10, V_HEADS), 5.0, device=DEVICE) for _ in range(2))
        kept = gates(a, b, a_log, dt_bias, (g_store, beta_store, rows))
        for x, y, store in zip(kept, want, (g_store, beta_store)):
            assert (x - y).abs().max() <= 1e-5 * max(1.0, y.abs().max().item())
            assert torch.equal(store[rows], x)
            assert (store[[1, 3, 5, 6, 8]] == 5.0).all()


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gated_rms_norm_matches_the_reference(dtype, monkeypatch):
    """float32 rows from the recurrence, rounded to the model dtype as the reference does."""
    pytest.importorskip("triton")
    from lucebox.kernels.gated_delta import gated_rms_norm
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, V_HEADS, DV, generator=g).to(DEVICE)
    gate = torch.randn(3, V_HEADS, DV, generator=g).to(DEVICE, dtype)
    weight = (torch.rand(DV, generator=g) + 0.5).to(DEVICE, dtype)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want = gated_rms_norm(x, gate, weight, 1e-6, dtype)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got = gated_rms_norm(x, gate, weight, 1e-6, dtype)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
def test_the_gated_norm_rounds_each_tokens_output_row_for_int8_products(monkeypatch):
    """gated_rms_norm_rounded: the same output as gated_rms_norm, and each token's row (its heads side
    by side) rounded to int8 by the same launch, byte for byte what quantize_rows makes of it; sizes
    that cannot round in one launch (and the reference) give None."""
    pytest.importorskip("triton")
    from lucebox.kernels import triton_dp4a
    from lucebox.kernels.gated_delta import gated_rms_norm, gated_rms_norm_rounded
    g = torch.Generator().manual_seed(5)
    heads, size = 4, 64  # 256 values a token
    x = torch.randn(3, heads, size, generator=g).to(DEVICE)
    gate = torch.randn(3, 2 * heads * size, generator=g).to(DEVICE, torch.float16)[:, :heads * size]  # a slice
    gate = gate.view(3, heads, size)
    weight = (torch.rand(size, generator=g) + 0.5).to(DEVICE, torch.float16)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    out, rows = gated_rms_norm_rounded(x, gate, weight, 1e-6, torch.float16)
    assert torch.equal(out, gated_rms_norm(x, gate, weight, 1e-6, torch.float16))
    assert torch.equal(rows, triton_dp4a.quantize_rows(out.reshape(3, -1)))
    assert gated_rms_norm_rounded(x[..., :48], gate[..., :48], weight[:48], 1e-6, torch.float16)[1] is None
    # a consumer's stored head order (GGUF ssm_out): head j of the output is head order[j] of the input
    order = torch.tensor([2, 0, 3, 1], device=DEVICE)
    moved, moved_rows = gated_rms_norm_rounded(x, gate, weight, 1e-6, torch.float16, order)
    assert torch.equal(moved, out[:, order]) and torch.equal(moved_rows, triton_dp4a.quantize_rows(moved.reshape(3, -1)))
    assert torch.equal(gated_rms_norm(x, gate, weight, 1e-6, torch.float16, order), moved)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    assert gated_rms_norm_rounded(x, gate, weight, 1e-6, torch.float16)[1] is None
    reference = gated_rms_norm(x, gate, weight, 1e-6, torch.float16, order)
    assert (reference.float() - moved.float()).abs().max() <= 2e-3 * reference.float().abs().max()


def test_a_gpu_without_fla_core_is_told_what_its_hybrid_prefill_costs(monkeypatch, caplog):
    """Nothing to compile without fla-core: the warm-up names the missing extra instead (and touches no device)."""
    monkeypatch.setattr(gd, "fla_chunk", lambda: None)
    with caplog.at_level(logging.WARNING, logger=gd.__name__):
        gd.warm_up_chunk(2, 4, 16, 16, torch.bfloat16, torch.device("cuda"))
    assert "pip install 'lucebox[gpu]'" in caplog.text
    caplog.clear()
    gd.warm_up_chunk(2, 4, 16, 16, torch.float32, torch.device("cpu"))  # a CPU run needs no kernels: silent
    assert caplog.text == ""
