"""A MoE layer's shared expert run as one more routed pair (decode rows): after SparseMoE.fuse(), the
router kernel appends route k + 1 (expert id E, weight sigmoid(the shared gate's logit), or 1 where
ungated; the routed weights times the routed scaling factor) and the pairs kernels read the shared
expert's own weights for it, so the shared expert takes no launches of its own. The same output as
the unfused layer on the torch reference; verify-sized batches keep the separate shared expert;
a shared expert in other formats than its experts is not paired, and is then combined by the
launch that sums the routed experts (its int8 rows rounded by the norm before it). Without a GPU
the kernels run under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucebox.model.moe import Routing, SparseMoE, shared_expert_stacks
from lucebox.weights.quant import QuantLinear, QuantTensor
from tests.kernels.test_triton_kernels import DEVICE, quant_rows, rel_err
from tests.model.test_moe import block_config

# after the import above has set TRITON_INTERPRET=1 (these import Triton)
from lucebox.kernels import routing  # noqa: I001
from lucebox.kernels import triton_moe
from lucebox.kernels.triton_moe_route import route


def test_the_router_kernel_appends_the_shared_expert_as_route_k_plus_one():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 9, generator=g).to(DEVICE)  # 8 experts, then the shared gate's logit
    ids, weights = route(logits[:, :8], 2, norm=True)
    gated_ids, gated = route(logits, 2, norm=True, shared="gated", routed_scale=2.5)
    assert torch.equal(gated_ids[:, :2], ids) and (gated_ids[:, 2] == 8).all()
    assert rel_err(gated[:, :2], 2.5 * weights) <= 1e-6
    assert rel_err(gated[:, 2], torch.sigmoid(logits[:, 8])) <= 1e-6
    plain_ids, plain = route(logits[:, :8], 2, norm=True, shared="ungated")
    assert torch.equal(plain_ids[:, :2], ids) and (plain_ids[:, 2] == 8).all() and (plain[:, 2] == 1).all()
    with pytest.raises(KeyError):
        route(logits, 2, shared="sometimes")


def quantised_block(down_type=Q.Q6_K, seed=1) -> SparseMoE:
    """A Qwen 3.5-like MoE block (gated shared expert) of 256 hidden, 6 experts of 256: Q4_K gate | up and
    `down_type` down, experts and shared expert alike (the shared down in `down_type` too)."""
    cfg = block_config(True, 256)
    cfg = type(cfg)(**{**vars(cfg), "hidden_size": 256, "moe_intermediate_size": 256})
    torch.manual_seed(seed)
    block = SparseMoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    experts = block.experts
    stacks = [QuantTensor(quant_rows(Q.Q4_K, 6 * 512, 256, seed=seed + 10), Q.Q4_K, (6, 512, 256)),
              QuantTensor(quant_rows(down_type, 6 * 256, 256, seed=seed + 11), down_type, (6, 256, 256))]
    del experts.gate_up_proj, experts.down_proj
    experts.gate_up_proj, experts.down_proj = stacks
    mlp = block.shared_expert
    for name, qtype, seed_ in (("gate_proj", Q.Q4_K, 21), ("up_proj", Q.Q4_K, 22), ("down_proj", Q.Q6_K, 23)):
        setattr(mlp, name, QuantLinear(QuantTensor(quant_rows(qtype, 256, 256, seed=seed + seed_), qtype, (256, 256))))
    return block.to(DEVICE)


def run_fused(block: SparseMoE, x: torch.Tensor, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(the unfused block on the torch reference, the fused block on the kernels, the shared_pair
    argument of each pairs-kernel call)."""
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.no_grad():
        want = block(x)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls, real = [], triton_moe.pairs_experts
    monkeypatch.setattr(triton_moe, "pairs_experts", lambda *a, **k: calls.append(k.get("shared_pair")) or real(*a, **k))
    with torch.no_grad():
        block.fuse()
        got = block(x)
    return want, got, calls


@pytest.mark.parametrize("tokens", [1, 2], ids=["decode", "two-rows"])
def test_a_quantised_gated_shared_expert_runs_as_one_more_pair(tokens, monkeypatch):
    block = quantised_block()
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    monkeypatch.setattr(type(block.shared_expert), "down", lambda *a: pytest.fail("the shared expert launched alone"))
    want, got, calls = run_fused(block, x, monkeypatch)
    assert block.shared_pair is not None and len(calls) == 1 and calls[0] is not None
    assert rel_err(got, want) <= 1e-4
    routed_only = block.routed(x)
    assert rel_err(got, routed_only) > 0.1  # the shared expert is in the sum


def test_verify_sized_batches_keep_the_separate_shared_expert(monkeypatch):
    block = quantised_block(seed=2)
    x = torch.randn(routing.MOE_PAIRS_MAX_TOKENS + 1, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want, got, calls = run_fused(block, x, monkeypatch)
    assert block.shared_pair is not None and calls == []  # the grouped kernel, the shared expert on its own
    assert rel_err(got, want) <= 1e-4


def test_a_shared_expert_in_other_formats_than_its_experts_is_not_paired(monkeypatch):
    block = quantised_block(down_type=Q.Q8_0, seed=3)  # experts' down Q8_0, the shared down Q6_K
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want, got, calls = run_fused(block, x, monkeypatch)
    assert block.shared_pair is None and calls == [None]
    assert rel_err(got, want) <= 2e-2  # its own shared expert's product reads int8-rounded rows


def test_an_ungated_float_shared_expert_with_a_routed_scale_runs_as_one_more_pair(monkeypatch):
    """Laguna-like routing (ungated shared expert, routed_scaling_factor 2.5), float32 weights: the
    shared stacks are views of the shared expert's fused weights."""
    torch.manual_seed(2)
    cfg = block_config(True, 20)  # the shared expert as wide as the experts
    block = SparseMoE(cfg, Routing(2, True, routed_scaling_factor=2.5), shared_expert_gated=False)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    block = block.to(DEVICE)
    x = torch.randn(1, 24, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want, got, calls = run_fused(block, x, monkeypatch)
    assert len(calls) == 1 and calls[0] is not None
    assert block.shared_pair[0].data_ptr() == block.shared_expert.gate_up.weight.data_ptr()  # no copy
    assert rel_err(got, want) <= 1e-5


def test_weights_on_the_input_keep_the_separate_shared_expert():
    cfg = block_config(True, 20)
    block = SparseMoE(cfg, Routing(2, True, weights_on_input=True), shared_expert_gated=False)
    block.fuse()
    assert block.shared_fused and block.shared_pair is None
    assert shared_expert_stacks(block.shared_expert, block.experts) is not None  # it would fit otherwise


# ----------------------------------------------------------------------------- the shared expert apart

@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "verify"])
def test_an_ungated_shared_expert_and_a_routed_scale_combine_in_the_experts_sum(tokens, monkeypatch):
    """Laguna's MoE (an ungated shared expert, routed_scaling_factor 2.5) after fuse(): the launch that
    sums the routed experts applies the scale and adds the shared expert; equal to the unfused
    block, and the scale is not applied to the shared expert."""
    torch.manual_seed(2)
    block = SparseMoE(block_config(True, 16), Routing(2, True, routed_scaling_factor=2.5), shared_expert_gated=False)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    block = block.to(DEVICE)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        want = block(x)
        routed, shared = block.routed(x), block.shared_expert(x)
        assert (want - (routed + shared)).abs().max().item() <= 1e-5
        block.fuse()
        got = block(x)
    assert block.shared_fused and block.router is None
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - 2.5 * (routed + shared)).abs().max().item() > 1e-2


def test_a_fused_moe_layer_rounds_its_input_once_in_the_norm(monkeypatch):
    """After fuse(), a MoE layer behind its norm (after_norm): the router and the shared expert's gate
    one product, the shared expert's Q4_K gate | up on int8 rows the norm's launch rounded (no
    quantising launch of its own), the gated shared expert added by the routed experts' sum; equal
    to the unfused layer on the torch reference."""
    from lucebox.kernels import triton_dp4a as tdp
    from lucebox.kernels import triton_quant_int8 as tqi
    from lucebox.model.transformer import RMSNorm
    from lucebox.weights.quant import QuantLinear
    from tests.kernels.test_triton_kernels import quant_rows
    cfg = block_config(True, 256)
    cfg = type(cfg)(**{**vars(cfg), "hidden_size": 256})
    torch.manual_seed(1)
    block, norm = SparseMoE(cfg), RMSNorm(256, 1e-6)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    mlp = block.shared_expert
    for name, seed in (("gate_proj", 71), ("up_proj", 72)):
        setattr(mlp, name, QuantLinear(QuantTensor(quant_rows(Q.Q4_K, 256, 256, seed=seed), Q.Q4_K, (256, 256))))
    block, norm = block.to(DEVICE), norm.to(DEVICE)
    g = torch.Generator().manual_seed(73)
    x, residual = (torch.randn(1, 256, generator=g).to(DEVICE) for _ in range(2))
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        want, want_stream = block.after_norm(norm, x, residual)  # unfused: the norm, then each product
        block.fuse()
        assert block.router is not None and mlp.gate_up is not None
        rounds, real = [], tdp.quantize_rows
        for module in (tdp, tqi):
            monkeypatch.setattr(module, "quantize_rows", lambda t: rounds.append(1) or real(t))
        got, stream = block.after_norm(norm, x, residual)
    assert not rounds
    assert torch.equal(stream, want_stream) and rel_err(got, want) <= 1e-5
