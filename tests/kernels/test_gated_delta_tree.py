"""The gated delta rule and its causal conv over tree verify rows: every node's output equals a chain
verify of its root-to-node path (the specification, recurrent_gated_delta_rule, and conv_steps over
that path as a chain), in a batch beside chain verify rows and decodes; the Triton kernels (under
TRITON_INTERPRET=1 on the CPU) equal the torch references."""
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

from lucebox.kernels.forward_batch import tree_mask_bits
from lucebox.kernels.gated_delta import (
    conv_steps,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from lucebox.kernels.gated_delta_tree import gated_delta_tree, tree_links
from tests.tree_paths import path_of

DEVICE = "cuda" if ON_GPU else "cpu"
K_HEADS, V_HEADS, DK, DV = 2, 6, 16, 24  # GVA; dv not a power of two
CHANNELS, KERNEL = 20, 4

# A tree row (pending token + 9 nodes in DFS order, two levels of branching), a chain verify row,
# a decode row (advances its slot) and a second, deeper tree.
TREE_A = [-1, 0, 1, 2, 1, 0, 5, 6, 6, 0]
TREE_B = [-1, 0, 1, 2, 3, 4, 2, 6]
ROWS = [TREE_A, [-1, 0, 1, 2], [-1], TREE_B]  # parents; a chain's are t - 1
SLOTS = [3, 0, 5, 1]
ADVANCE = [0, 0, 1, 0]


def layout(device=DEVICE):
    """(starts, ends, seq, local, masks) of ROWS as a batch's step rows."""
    starts, seq, local, masks = [0], [], [], []
    for b, parents in enumerate(ROWS):
        starts.append(starts[-1] + len(parents))
        seq += [b] * len(parents)
        local += list(range(len(parents)))
        masks += tree_mask_bits(parents) if b in (0, 3) else [-1] * len(parents)
    as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return as_t(starts[:-1]), as_t(starts[1:]), as_t(seq), as_t(local), as_t(masks)


def recurrence_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(map(len, ROWS))
    q = torch.randn(t, K_HEADS, DK, generator=g)
    k = torch.randn(t, K_HEADS, DK, generator=g)
    v = torch.randn(t, V_HEADS, DV, generator=g)
    decay = -torch.rand(t, V_HEADS, generator=g) * 0.5
    beta = torch.rand(t, V_HEADS, generator=g)
    state = torch.randn(6, V_HEADS, DK, DV, generator=g) * 0.3
    return [x.to(DEVICE) for x in (q, k, v, decay, beta, state)]


def run_tree(case, scale=DK ** -0.5):
    q, k, v, decay, beta, state = case
    starts, _, seq, local, masks = layout()
    state = state.clone()
    runs = tree_links(masks, starts, seq, local).run_end
    out = gated_delta_tree(q, k, v, decay, beta, state, torch.tensor(SLOTS, device=DEVICE), starts, seq, local,
                           masks, torch.tensor(ADVANCE, device=DEVICE), max(map(len, ROWS)), runs, normalize=True,
                           scale=scale)
    return out, state


def test_tree_links_follow_the_parents():
    """Parents and depths per row; runs (rows each the child of the one before) start at roots and
    at rows whose parent is not the row before, and end at leaves: one per leaf, a chain one run."""
    starts, _, seq, local, masks = layout("cpu")
    parent, depth, run_end = tree_links(masks, starts, seq, local)
    want_parent, want_depth, want_runs, base = [], [], [], 0
    for parents in ROWS:
        want_parent += [p + base if p >= 0 else -1 for p in parents]
        want_depth += [len(path_of(parents, i)) - 1 for i in range(len(parents))]
        for i, p in enumerate(parents):
            end = i
            while end + 1 < len(parents) and parents[end + 1] == end:
                end += 1
            want_runs.append(end + base if p != i - 1 or i == 0 else -1)
        base += len(parents)
    assert parent.tolist() == want_parent and depth.tolist() == want_depth
    assert run_end.tolist() == want_runs
    assert run_end[:len(TREE_A)].tolist() == [3, -1, -1, -1, 4, 7, -1, -1, 8, 9]  # 5 leaves, 5 runs


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETABLE, reason="Triton already loaded without the interpreter"))])
def test_every_node_follows_its_root_to_node_path(kernel, monkeypatch):
    """o of each row = the specification over its path's tokens from its slot's state; verify slots
    keep their state, the decode's slot gets the state after its token."""
    monkeypatch.setenv("LUCEBOX_TRITON", "1" if kernel == "triton" else "0")
    case = recurrence_case()
    q, k, v, decay, beta, state = case
    out, after = run_tree(case)
    group, base = V_HEADS // K_HEADS, 0
    qn, kn = l2_normalize(q) * DK ** -0.5, l2_normalize(k)
    for b, parents in enumerate(ROWS):
        for i in range(len(parents)):
            rows = [base + j for j in path_of(parents, i)]
            qh, kh = (x[rows].repeat_interleave(group, dim=1).transpose(0, 1) for x in (qn, kn))
            o, final = recurrent_gated_delta_rule(qh, kh, v[rows].transpose(0, 1), decay[rows].t(), beta[rows].t(),
                                                  state[SLOTS[b]])
            assert (out[base + i] - o[:, -1]).abs().max().item() <= 1e-5, (b, i)
        want = final if ADVANCE[b] else state[SLOTS[b]]
        assert (after[SLOTS[b]] - want).abs().max().item() <= 1e-5, b
        base += len(parents)
    untouched = [s for s in range(state.shape[0]) if s not in SLOTS]
    assert torch.equal(after[untouched], state[untouched])


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton already loaded without the interpreter")
def test_triton_tree_kernel_matches_the_torch_reference(monkeypatch):
    case = recurrence_case(seed=3)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want, want_state = run_tree(case)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got, got_state = run_tree(case)
    assert (got - want).abs().max().item() <= 1e-5
    assert (got_state - want_state).abs().max().item() <= 1e-5


def conv_case(seed=1):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(map(len, ROWS)), CHANNELS, generator=g)
    conv = torch.randn(6, CHANNELS, KERNEL - 1, generator=g)
    weight = torch.randn(CHANNELS, KERNEL, generator=g)
    return [x.to(DEVICE) for x in (qkv, conv, weight)]


def run_conv(qkv, conv, weight, tree: bool, stash_positions: int = 0):
    starts, _, seq, local, masks = layout()
    conv = conv.clone()
    stash = None
    if stash_positions:
        stash = tuple(torch.zeros(6 * stash_positions + 1, CHANNELS, device=DEVICE) for _ in range(2))
    links = tree_links(masks, starts, seq, local) if tree else None
    mixed = conv_steps(qkv, conv, weight, torch.tensor(SLOTS, device=DEVICE), starts,
                       torch.tensor(ADVANCE, device=DEVICE), seq, local, stash, stash_positions, links)
    return mixed, conv, stash


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETABLE, reason="Triton already loaded without the interpreter"))])
def test_tree_conv_reads_each_nodes_ancestors(kernel, monkeypatch):
    """Each node's conv output equals conv_steps over its root-to-node path verified as a chain (the
    slot's window before the root); the decode's window moves, the stash keeps row i at i."""
    monkeypatch.setenv("LUCEBOX_TRITON", "1" if kernel == "triton" else "0")
    qkv, conv, weight = conv_case()
    mixed, windows, (raw, kept) = run_conv(qkv, conv, weight, tree=True, stash_positions=10)
    base = 0
    for b, parents in enumerate(ROWS):
        for i in range(len(parents)):
            rows = [base + j for j in path_of(parents, i)]
            n = len(rows)
            chain = conv_steps(qkv[rows], conv.clone(), weight, torch.tensor([SLOTS[b]], device=DEVICE),
                               torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE),
                               torch.zeros(n, dtype=torch.long, device=DEVICE), torch.arange(n, device=DEVICE))
            assert (mixed[base + i] - chain[-1]).abs().max().item() <= 1e-5, (b, i)
            at = SLOTS[b] * 10 + i
            assert torch.equal(raw[at], qkv[base + i]) and (kept[at] - mixed[base + i]).abs().max() <= 1e-6
        base += len(parents)
    decode = SLOTS[2]
    want_window = torch.cat([conv[decode], qkv[sum(map(len, ROWS[:2]))][:, None]], dim=1)[:, 1:]
    assert torch.equal(windows[decode], want_window)
    assert torch.equal(windows[[SLOTS[0], SLOTS[1], SLOTS[3]]], conv[[SLOTS[0], SLOTS[1], SLOTS[3]]])


def test_chain_rows_with_links_equal_the_plain_conv(monkeypatch):
    """tree_links of ordinary rows (mask -1) describe a chain: the same conv as without links."""
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    qkv, conv, weight = conv_case(seed=2)
    starts, _, seq, local, _ = layout()
    links = tree_links(torch.full_like(seq, -1), starts, seq, local)
    args = (qkv, conv.clone(), weight, torch.tensor(SLOTS, device=DEVICE), starts, torch.zeros(4, dtype=torch.long,
            device=DEVICE), seq, local)
    assert torch.equal(conv_steps(*args, tree=links), conv_steps(*args))


@pytest.mark.skipif(not ON_GPU, reason="the Qwen3.6-27B shape compiled on a GPU")
def test_triton_tree_at_the_qwen36_27b_shape():
    """Hk=16, Hv=48, dk=dv=128: a 32-node draft tree (DFS order, several branches) beside a decode;
    raw q/k normalised in the kernel; the verify's slot untouched, the decode's advanced."""
    from lucebox.kernels.gated_delta_tree import gated_delta_tree_reference
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 7] + [i // 3 for i in range(3, 27)]  # a spine, then bushes
    g = torch.Generator(device="cuda").manual_seed(0)
    k_heads, v_heads, d = 16, 48, 128
    t = 1 + len(parents)
    q, k = (torch.randn(t, k_heads, d, generator=g, device="cuda") for _ in range(2))
    v = torch.randn(t, v_heads, d, generator=g, device="cuda")
    decay = -torch.rand(t, v_heads, generator=g, device="cuda") * 0.3
    beta = torch.rand(t, v_heads, generator=g, device="cuda")
    state = torch.randn(3, v_heads, d, d, generator=g, device="cuda") * 0.1
    as_t = lambda x: torch.tensor(x, device="cuda")  # noqa: E731
    masks = as_t([-1] + tree_mask_bits(parents))
    starts, seq, local = as_t([0, 1]), as_t([0] + [1] * len(parents)), as_t([0] + list(range(len(parents))))
    runs = tree_links(masks, starts, seq, local).run_end
    args = (as_t([2, 0]), starts, seq, local, masks, as_t([1, 0]))
    want_state = state.clone()
    want = gated_delta_tree_reference(q, k, v, decay, beta, want_state, *args, len(parents), runs, normalize=True,
                                      scale=d ** -0.5)
    got = gated_delta_tree(q, k, v, decay, beta, state, *args, len(parents), runs, normalize=True,
                           scale=d ** -0.5)  # Triton on a GPU
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert (state - want_state).abs().max() <= 1e-3 * want_state.abs().max()
