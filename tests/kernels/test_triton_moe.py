"""The MoE expert kernels (kernels/triton_moe.py, triton_moe_align.py, dispatched by kernels/moe.py)
compute what Experts' torch reference computes, reading only the routed experts.

Without a GPU they run under Triton's interpreter (set up by tests/kernels/test_triton_kernels.py,
imported first) on small shapes: odd sizes for float weights, one or two super-blocks for GGUF rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from lucebox.kernels import moe as kmoe
from lucebox.kernels import routing
from lucebox.model.moe import Experts, SparseMoE
from lucebox.weights.quant import QuantTensor
from tests.kernels.test_triton_kernels import DEVICE, QUANT_TYPES, rel_err
from tests.model.test_moe import block_config, naive_moe
from tests.weights.test_quant import random_rows

# after the import above has set TRITON_INTERPRET=1 (these import Triton)
from lucebox.kernels import triton_moe as tm  # noqa: I001
from lucebox.kernels.triton_moe_align import align_by_expert, max_blocks

# silu of a very negative gate: exp overflows to inf in the interpreter, and silu is then -0.0 as on GPUs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def routes(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as top-k gives) and positive routing weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.long)
    return ids.to(DEVICE), torch.rand(tokens, top_k, generator=g).to(DEVICE)


def float_experts(experts: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    module = Experts(experts, hidden, inter)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module.to(DEVICE, dtype)


def reference(module: Experts, x, ids, weights, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.no_grad():
        return module(x, ids, weights)


# ----------------------------------------------------------------------------- grouping by expert

@pytest.mark.parametrize("pairs, experts, block_m", [(1, 4, 16), (7, 4, 16), (40, 6, 16), (300, 5, 16),
                                                      (1000, 128, 64), (9, 256, 16)])
def test_pairs_are_grouped_by_expert_in_padded_blocks_in_their_order(pairs, experts, block_m):
    ids = torch.randint(0, experts, (pairs,), generator=torch.Generator().manual_seed(pairs)).to(DEVICE)
    slots, block_expert = align_by_expert(ids, experts, block_m)
    blocks = max_blocks(pairs, experts, block_m)
    assert slots.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    slots, block_expert, ids = slots.cpu().view(blocks, block_m), block_expert.cpu(), ids.cpu()
    seen = {}
    for block, expert in zip(slots.tolist(), block_expert.tolist()):
        if expert < 0:
            continue
        real = [s for s in block if s != pairs]
        assert real and all(ids[s] == expert for s in real) and block[:len(real)] == real  # padding at the end
        seen.setdefault(expert, []).extend(real)
    for e in range(experts):
        want = [r for r in range(pairs) if ids[r] == e]
        assert seen.get(e, []) == want  # every pair once, in order (a stable sort)
        assert sum(1 for b in block_expert.tolist() if b == e) == -(-len(want) // block_m)
    used = int((block_expert >= 0).sum())
    assert (block_expert[:used] >= 0).all() and (block_expert[used:] == -1).all()
    assert (block_expert[:used].diff() >= 0).all()


# ----------------------------------------------------------------------------- float weights

@pytest.mark.parametrize("tokens", [0, 1, 3, 7])
@pytest.mark.parametrize("top_k", [2, 3])
def test_float_kernels_match_the_reference_at_odd_sizes(tokens, top_k, monkeypatch):
    module = float_experts(5, 40, 24)
    x = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids, weights = routes(tokens, 5, top_k, seed=tokens)
    want = reference(module, x, ids, weights, monkeypatch)
    gate_up, down = tm.float_stack(module.gate_up_proj.data), tm.float_stack(module.down_proj.data)
    runs = [tm.pairs_experts(x, ids, weights, gate_up, down, split_k=1, groups=1, plane=16),
            tm.pairs_experts(x, ids, weights, gate_up, down, split_k=2, groups=top_k, plane=16),  # both splits
            tm.grouped_experts(x, ids, weights, gate_up, down, block_n=16, plane=16),
            tm.grouped_experts(x, ids, weights, gate_up, down, block_m=32, block_n=16, plane=32)]
    for got in runs:
        assert got.shape == (tokens, 40) and got.dtype == torch.float32
        assert (got - want).abs().max().item() <= 1e-5 if tokens else got.numel() == 0


@pytest.mark.parametrize("kernel", ["pairs", "grouped"])
@pytest.mark.parametrize("weights_type", ["bf16", "Q4_K+Q6_K"])
def test_bfloat16_activations_round_like_the_reference(kernel, weights_type, monkeypatch):
    if weights_type == "bf16":
        module = float_experts(4, 256, 256, torch.bfloat16)
    else:
        module = with_stacks(Experts(4, 256, 256), quant_experts(Q.Q4_K, 4, 512, 256, seed=1),
                             quant_experts(Q.Q6_K, 4, 256, 256, seed=2))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    ids, weights = routes(3, 4, 2, seed=3)
    weights = weights.to(torch.bfloat16)
    want = reference(module, x, ids, weights, monkeypatch)
    stacks = kmoe.stacked(module.gate_up_proj), kmoe.stacked(module.down_proj)
    run = tm.pairs_experts if kernel == "pairs" else tm.grouped_experts
    got = run(x, ids, weights, *stacks, block_n=64)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 2e-2


# ----------------------------------------------------------------------------- quantised weights

def quant_experts(qtype, experts: int, out: int, inner: int, seed: int) -> QuantTensor:
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_rows(qtype, experts * out, inner // block, np.random.default_rng(seed), small_scales=True)
    return QuantTensor(torch.from_numpy(raw).to(DEVICE), qtype, (experts, out, inner))


def with_stacks(module: Experts, gate_up, down) -> Experts:
    """module holding these stacked experts (QuantTensors in place of its parameters)."""
    del module.gate_up_proj, module.down_proj
    module.gate_up_proj, module.down_proj = gate_up, down
    return module


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_quantised_experts_are_dequantised_inside_the_product(qtype, monkeypatch):
    experts, hidden, inter = 3, 256, 256
    gate_up = quant_experts(qtype, experts, 2 * inter, hidden, seed=qtype.value)
    down = quant_experts(Q.Q6_K if qtype == Q.Q4_K else qtype, experts, hidden, inter, seed=100 + qtype.value)
    module = with_stacks(Experts(experts, hidden, inter), gate_up, down)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ids, weights = routes(3, experts, 2, seed=6)
    want = reference(module, x, ids, weights, monkeypatch)
    # the reference dequantises through expert_weights; against the dequantised float experts too
    floats = float_experts(experts, hidden, inter)
    with torch.no_grad():
        floats.gate_up_proj.copy_(gate_up.dequantize())
        floats.down_proj.copy_(down.dequantize())
    assert rel_err(want, reference(floats, x, ids, weights, monkeypatch)) <= 1e-6
    stacks = tm.quant_stack(gate_up.data, gate_up.qtype, gate_up.shape), tm.quant_stack(down.data, down.qtype,
                                                                                         down.shape)
    for got in (tm.pairs_experts(x, ids, weights, *stacks, block_n=64),
                tm.grouped_experts(x, ids, weights, *stacks, block_m=16)):
        assert rel_err(got, want) <= 1e-5


# ----------------------------------------------------------------------------- Experts and SparseMoE

def test_routing_picks_pairs_for_decode_grouped_beyond_and_torch_where_triton_cannot(monkeypatch):
    module = float_experts(4, 32, 16)
    tokens = routing.MOE_PAIRS_MAX_TOKENS + 1
    x = torch.randn(tokens, 32).to(DEVICE)
    ids, _ = routes(tokens, 4, 2, seed=0)
    w = module.gate_up_proj, module.down_proj
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    assert kmoe.expert_kernel(x, ids, *w) == routing.TORCH  # autograd records: the kernels have no backward
    torch.set_grad_enabled(False)
    try:
        assert kmoe.expert_kernel(x[:1], ids[:1], *w) == routing.MOE_PAIRS
        most = routing.MOE_PAIRS_MAX_TOKENS
        assert kmoe.expert_kernel(x[:most], ids[:most], *w) == routing.MOE_PAIRS
        assert kmoe.expert_kernel(x, ids, *w) == routing.MOE_GROUPED
        assert kmoe.expert_kernel(x.double(), ids, *w) == routing.TORCH  # weights of another dtype
        split = module.gate_up_proj.data[:, ::2]  # not contiguous
        assert kmoe.expert_kernel(x, ids, split, module.down_proj) == routing.TORCH
        monkeypatch.setenv("LUCEBOX_TRITON", "0")
        assert kmoe.expert_kernel(x, ids, *w) == routing.TORCH
    finally:
        torch.set_grad_enabled(True)


@pytest.mark.parametrize("tokens", [1, 5, 20])
def test_experts_forward_takes_the_kernels_and_agrees_with_the_reference(tokens, monkeypatch):
    module = float_experts(6, 24, 20)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    ids, weights = routes(tokens, 6, 2, seed=8)
    want = reference(module, x, ids, weights, monkeypatch)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls = []
    for name in ("pairs_experts", "grouped_experts"):
        real = getattr(tm, name)
        monkeypatch.setattr(tm, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    with torch.no_grad():
        got = module(x, ids, weights)
    assert calls == ["pairs_experts" if tokens <= routing.MOE_PAIRS_MAX_TOKENS else "grouped_experts"]
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
def test_a_moe_block_on_the_kernels_reads_only_routed_experts(tokens, fused, monkeypatch):
    """SparseMoE (router, experts, gated shared expert) against the per-token definition; experts that
    no token routes to are poisoned with NaN, which an unrouted read would carry into the output.
    fused: the router and the shared expert's gate as one product, the shared expert added by the
    launch that sums the routed experts (decode)."""
    torch.manual_seed(0)
    block = SparseMoE(block_config(True, 16))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        block.gate.weight[4:] = -1.0  # positive inputs never route to experts 4 and 5
    block = block.to(DEVICE)
    if fused:
        block.fuse()
        assert block.router is not None
    x = (torch.randn(tokens, 24).abs() + 0.1).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        want = naive_moe(block.cpu(), x.cpu()).to(DEVICE)
        block.to(DEVICE)
        block.experts.gate_up_proj[4:] = float("nan")
        block.experts.down_proj[4:] = float("nan")
        got = block(x)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tokens", [1, 5])
def test_quantised_experts_forward_takes_the_kernels_and_reads_only_routed_experts(tokens, monkeypatch):
    experts, hidden, inter = 4, 256, 256
    gate_up = quant_experts(Q.Q4_K, experts, 2 * inter, hidden, seed=1)
    down = quant_experts(Q.Q8_0, experts, hidden, inter, seed=2)
    module = with_stacks(Experts(experts, hidden, inter), gate_up, down)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids, weights = routes(tokens, 3, 2, seed=4)  # experts 0..2 only
    want = reference(module, x, ids, weights, monkeypatch)
    for stack in (gate_up, down):  # expert 3's rows: fp16 NaN scales in every block
        rows = stack.data.view(experts, stack.shape[1], -1)[3].view(-1, GGML_QUANT_SIZES[stack.qtype][1])
        rows[:, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        got = module(x, ids, weights)
    assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("tokens", [1, 16, 300], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("weights_type", ["bf16", "Q4_K"])
def test_the_kernels_replay_from_a_cuda_graph_with_new_routes(tokens, weights_type, monkeypatch):
    """Fixed shapes, no host sync: captured once, replayed with other tokens and routes copied into
    the graph's inputs, it computes what the reference computes for those."""
    experts, hidden, inter = 16, 256, 256
    if weights_type == "bf16":
        module = float_experts(experts, hidden, inter, torch.bfloat16)
    else:
        module = with_stacks(Experts(experts, hidden, inter), quant_experts(Q.Q4_K, experts, 2 * inter, hidden, 1),
                             quant_experts(Q.Q4_K, experts, hidden, inter, 2))
    x = torch.zeros(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, weights = routes(tokens, experts, 4, seed=0)
    weights = weights.to(torch.bfloat16)
    monkeypatch.delenv("LUCEBOX_TRITON", raising=False)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module(x, ids, weights)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(x, ids, weights)
        for seed in (1, 2):
            new_ids, new_weights = routes(tokens, experts, 4, seed=seed)
            x.copy_(torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(x))
            ids.copy_(new_ids)
            weights.copy_(new_weights)
            graph.replay()
            want = reference(module, x, ids, weights, monkeypatch)
            monkeypatch.delenv("LUCEBOX_TRITON")
            assert rel_err(out, want) <= 2e-2


@pytest.mark.parametrize("experts, top_k, scoring, softcap, biased, norm", [
    (256, 8, "softmax", 0.0, False, True),  # Qwen 3.5 / 3.6 MoE
    (60, 4, "softmax", 0.0, False, False),  # no renormalisation, E not a power of two
    (33, 3, "sigmoid", 30.0, True, True),  # Laguna-style: soft-capped sigmoid scores, a selection bias
    (16, 1, "softmax", 0.0, False, True)])
def test_the_router_kernel_chooses_what_routing_choose_does(experts, top_k, scoring, softcap, biased, norm):
    """kernels/triton_moe_route.py against model/moe.Routing.choose: the same experts in the same order
    and their weights, in the output dtype, for float32 and bfloat16 logits (bfloat16 logits tie often:
    there, experts of equal score may be chosen in either order, as torch.topk's own order is unspecified)."""
    from lucebox.kernels import triton_moe_route
    from lucebox.model.moe import Routing
    g = torch.Generator().manual_seed(experts)
    logits = (3 * torch.randn(5, experts, generator=g)).to(DEVICE)
    bias = (0.1 * torch.randn(experts, generator=g)).to(DEVICE) if biased else None
    reference = Routing(top_k, norm, scoring, softcap, biased)
    for dtype in (torch.float32, torch.bfloat16):
        want_ids, want_weights = reference.choose(logits.to(dtype).float(), bias)
        ids, weights = triton_moe_route.route(logits.to(dtype), top_k, softmax=scoring == "softmax", softcap=softcap,
                                              bias=bias, norm=norm, dtype=dtype)
        if dtype == torch.float32:
            assert torch.equal(ids, want_ids)
        else:  # the chosen experts' keys (score + bias) are the reference's, highest first; weights: their scores
            scores = torch.softmax(logits.to(dtype).float(), -1) if scoring == "softmax" else None
            if scores is None:
                capped = logits.to(dtype).float()
                capped = softcap * torch.tanh(capped / softcap) if softcap else capped
                scores = torch.sigmoid(capped)
            keys = scores + bias if biased else scores
            assert torch.equal(keys.gather(1, ids), keys.gather(1, want_ids))
            chosen = scores.gather(1, ids)
            want_weights = chosen / chosen.sum(-1, keepdim=True) if norm else chosen
        assert weights.dtype == dtype
        torch.testing.assert_close(weights, want_weights.to(dtype), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6)
    with pytest.raises(ValueError, match="top-3 of 2"):
        triton_moe_route.route(logits[:, :2], 3)


def test_the_router_kernel_scales_each_chosen_weight_by_its_expert():
    """Gemma 4's router: softmax top-k renormalised, then times the chosen experts' per-expert scale."""
    from lucebox.kernels import triton_moe_route
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 12, generator=g).to(DEVICE)
    scale = (torch.rand(12, generator=g) + 0.5).to(DEVICE)
    ids, weights = triton_moe_route.route(logits, 3, expert_scale=scale)
    probs = torch.softmax(logits, dim=-1)
    want_w, want_ids = torch.topk(probs, 3, dim=-1)
    want_w = want_w / want_w.sum(dim=-1, keepdim=True) * scale[want_ids]
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(triton_moe_route.route(logits, 3)[1], want_w, rtol=1e-3)  # the scale is applied


def test_a_fused_gemma_router_chooses_as_the_unfused_one(monkeypatch):
    """Gemma4Router after fuse(): one norm launch (weight scale / sqrt(hidden)), the product and the
    router kernel, against its torch expression."""
    from types import SimpleNamespace

    from lucebox.model.gemma4 import Gemma4Router
    cfg = SimpleNamespace(num_experts_per_tok=2, rms_norm_eps=1e-6, hidden_size=32, num_experts=8)
    torch.manual_seed(3)
    router = Gemma4Router(cfg)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(1.0, 0.3)
    router = router.to(DEVICE)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        want_ids, want_w = router(x)
        router.fuse()
        ids, weights = router(x)
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w, rtol=1e-5, atol=1e-6)


def test_a_moe_block_routes_with_one_kernel_where_triton_runs(monkeypatch):
    """SparseMoE.route takes the router kernel under Triton (LUCEBOX_TRITON=1) and agrees with its
    torch reference; without Triton it keeps the reference."""
    from lucebox.kernels import triton_moe_route
    cfg = block_config(True, 0)
    moe = SparseMoE(cfg).to(DEVICE)
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.no_grad():  # inference, as the engine runs it (a product needing grad stays on torch)
        want = moe.route(x)
    calls = []
    monkeypatch.setattr(triton_moe_route, "route", lambda *a, _real=triton_moe_route.route, **kw:
                        calls.append(1) or _real(*a, **kw))
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        ids, weights = moe.route(x)
    assert calls and torch.equal(ids, want[0]) and torch.allclose(weights, want[1], rtol=1e-5, atol=1e-6)
