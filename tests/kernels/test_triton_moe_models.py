"""The expert kernels (kernels/triton_moe.py) with Gemma 4's GeGLU experts (gelu-tanh) and Laguna's
routing weights on the experts' input: against the torch reference (model/moe.Experts) and against
transformers' Gemma 4 MoE block (router: unit RMSNorm, scale, softmax top-k renormalised, per-expert
scale) and Laguna MoE block (sigmoid or softmax scores, selection bias, soft-capped logits, routed
scaling, shared expert), float32 and quantised, decode-sized (pairs kernels) and prefill-sized
(grouped kernels). Without a GPU they run under Triton's interpreter (set up by
tests/kernels/test_triton_kernels.py, imported first), on tiny shapes.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucebox.kernels import routing
from lucebox.model.config import ModelConfig
from lucebox.model.moe import Experts, Routing, SparseMoE
from tests.kernels.test_triton_kernels import DEVICE, rel_err
from tests.kernels.test_triton_moe import float_experts, quant_experts, routes, with_stacks

# after the import above has set TRITON_INTERPRET=1 (this imports Triton)
from lucebox.kernels import triton_moe as tm  # noqa: I001

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GELU = "gelu_pytorch_tanh"
VARIANTS = [(GELU, False), ("silu", True), (GELU, True)]
VARIANT_IDS = ["gelu", "silu-weights-on-input", "gelu-weights-on-input"]


def count_kernels(monkeypatch) -> list[tuple[str, tuple[int, ...]]]:
    """(kernel, ids' shape) of each triton_moe launch from now on."""
    calls = []
    for name in ("pairs_experts", "grouped_experts"):
        real = getattr(tm, name)
        monkeypatch.setattr(tm, name, lambda x, ids, *a, _real=real, _name=name, **kw:
                            calls.append((_name, tuple(ids.shape))) or _real(x, ids, *a, **kw))
    return calls


def with_activation(module: Experts, activation: str) -> Experts:
    from lucebox.model.moe import ACTIVATIONS
    module.activation, module.act = activation, ACTIVATIONS[activation]
    return module


def experts_reference(module: Experts, x, ids, weights, on_input: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.no_grad():
        return module(x, ids, weights, on_input)


# ----------------------------------------------------------------------------- the kernels themselves

@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("activation, on_input", VARIANTS, ids=VARIANT_IDS)
def test_float_kernels_take_the_activation_and_input_weights_as_the_reference(tokens, activation, on_input,
                                                                              monkeypatch):
    module = with_activation(float_experts(5, 40, 24, seed=tokens), activation)
    x = 3 * torch.randn(tokens, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # gates saturate too
    ids, weights = routes(tokens, 5, 3, seed=tokens)
    want = experts_reference(module, x, ids, weights, on_input, monkeypatch)
    silu_want = experts_reference(with_activation(float_experts(5, 40, 24, seed=tokens), "silu"), x, ids, weights,
                                  False, monkeypatch)
    assert rel_err(want, silu_want) > 1e-2  # the variant changes the result
    stacks = tm.float_stack(module.gate_up_proj.data), tm.float_stack(module.down_proj.data)
    options = {"activation": activation, "weights_on_input": on_input, "plane": 16}
    runs = [tm.pairs_experts(x, ids, weights, *stacks, split_k=1, groups=1, **options),
            tm.pairs_experts(x, ids, weights, *stacks, split_k=2, groups=3, **options),  # both splits
            tm.grouped_experts(x, ids, weights, *stacks, block_n=16, **options)]
    for got in runs:
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("kernel", ["pairs", "grouped"])
def test_quantised_gelu_experts_with_input_weights_match_the_reference(kernel, monkeypatch):
    experts, hidden, inter = 3, 256, 256
    module = with_activation(with_stacks(Experts(experts, hidden, inter), quant_experts(Q.Q4_K, experts, 2 * inter,
                                                                                       hidden, seed=1),
                                         quant_experts(Q.Q6_K, experts, hidden, inter, seed=2)), GELU)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ids, weights = routes(3, experts, 2, seed=6)
    want = experts_reference(module, x, ids, weights, True, monkeypatch)
    run = tm.pairs_experts if kernel == "pairs" else tm.grouped_experts
    got = run(x, ids, weights, tm.quant_stack(module.gate_up_proj.data, Q.Q4_K, (experts, 2 * inter, hidden)),
              tm.quant_stack(module.down_proj.data, Q.Q6_K, (experts, hidden, inter)), activation=GELU,
              weights_on_input=True)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("kernel", ["pairs", "grouped"])
@pytest.mark.parametrize("on_input", [False, True], ids=["weights-on-output", "weights-on-input"])
def test_bfloat16_gelu_rounds_like_the_reference(kernel, on_input, monkeypatch):
    module = with_activation(float_experts(4, 64, 48, torch.bfloat16), GELU)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    ids, weights = routes(3, 4, 2, seed=3)
    weights = weights.to(torch.bfloat16)
    want = experts_reference(module, x, ids, weights, on_input, monkeypatch)
    run = tm.pairs_experts if kernel == "pairs" else tm.grouped_experts
    got = run(x, ids, weights, tm.float_stack(module.gate_up_proj.data), tm.float_stack(module.down_proj.data),
              activation=GELU, weights_on_input=on_input, block_n=16)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 2e-2


def test_an_activation_the_kernels_lack_is_named():
    module = float_experts(2, 16, 16)
    x, (ids, weights) = torch.randn(1, 16).to(DEVICE), routes(1, 2, 1, seed=0)
    with pytest.raises(ValueError, match="no activation 'relu'"):
        tm.pairs_experts(x, ids, weights, tm.float_stack(module.gate_up_proj.data),
                         tm.float_stack(module.down_proj.data), activation="relu")


# ----------------------------------------------------------------------------- Gemma 4's MoE block

def gemma4_layers(quantised: bool):
    """(lucebox's Gemma4DecoderLayer, transformers' Gemma4TextDecoderLayer) of one tiny random 26B-A4B-
    like config, sharing weights; router scales away from 1. quantised: lucebox's experts Q8_0 / Q4_0,
    transformers' their dequantised values."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

    from lucebox.model.gemma4 import Gemma4DecoderLayer
    config = Gemma4TextConfig(vocab_size=32, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                              layer_types=["full_attention"], enable_moe_block=True, num_experts=6, top_k_experts=2,
                              moe_intermediate_size=32, hidden_size_per_layer_input=0)
    torch.manual_seed(0)
    theirs = Gemma4TextDecoderLayer(config, 0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith(("norm.weight", "_1.weight", "_2.weight", "router.scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    ours = Gemma4DecoderLayer(ModelConfig.from_hf_dict(config.to_dict()), 0)
    missing = ours.load_state_dict(theirs.state_dict(), strict=False).missing_keys
    assert not [k for k in missing if k.startswith(("router", "experts", "pre_feedforward", "post_feedforward"))]
    if quantised:
        experts = ours.experts
        gate_up = quant_experts(Q.Q4_0, 6, 64, 64, seed=3)
        down = quant_experts(Q.Q8_0, 6, 64, 32, seed=4)
        with_stacks(experts, gate_up, down)
        with torch.no_grad():
            theirs.experts.gate_up_proj.copy_(gate_up.dequantize().cpu())
            theirs.experts.down_proj.copy_(down.dequantize().cpu())
    return ours.to(DEVICE), theirs


def transformers_routed(layer, x: torch.Tensor) -> torch.Tensor:
    """The routed half of transformers' Gemma 4 FFN (Gemma4TextDecoderLayer.forward's MoE lines)."""
    with torch.no_grad():
        _, weights, ids = layer.router(x)
        return layer.post_feedforward_layernorm_2(layer.experts(layer.pre_feedforward_layernorm_2(x), ids, weights))


@pytest.mark.parametrize("tokens", [3, 20], ids=["decode-pairs", "prefill-grouped"])
@pytest.mark.parametrize("quantised", [False, True], ids=["float32", "Q4_0+Q8_0"])
def test_gemma4_moe_block_on_the_kernels_matches_transformers(tokens, quantised, monkeypatch):
    ours, theirs = gemma4_layers(quantised)
    x = 4 * torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    want = transformers_routed(theirs, x)
    x = x.to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.no_grad():
        reference_out = ours.routed(x)
    assert rel_err(reference_out.cpu(), want) <= 1e-5  # the torch reference, as the CPU runs it
    calls = count_kernels(monkeypatch)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        got = ours.routed(x)
    kernel = "pairs_experts" if tokens <= routing.MOE_PAIRS_MAX_TOKENS else "grouped_experts"
    assert calls == [(kernel, (tokens, 2))]
    assert rel_err(got.cpu(), want) <= 1e-5


def test_the_gemma4_router_takes_the_triton_gemv_at_decode(monkeypatch):
    """A decode row's float router product takes linear()'s measured GEMV route, not torch's kernel."""
    from lucebox.kernels import triton_gemv
    ours, _ = gemma4_layers(False)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.no_grad():
        want = ours.router(x)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls, real = [], triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        got = ours.router(x)
    assert calls == [1]
    assert torch.equal(got[0], want[0]) and rel_err(got[1], want[1]) <= 1e-5


# ----------------------------------------------------------------------------- Laguna's MoE block

def laguna_blocks(scoring: str, on_input: bool):
    """(lucebox's SparseMoE with Laguna's routing, transformers' LagunaSparseMoeBlock) sharing weights;
    a wide router (logits of a few units) so soft-capping and the selection bias matter."""
    from transformers import LagunaConfig
    from transformers.models.laguna.modeling_laguna import LagunaSparseMoeBlock
    config = LagunaConfig(hidden_size=64, intermediate_size=96, num_experts=8, num_experts_per_tok=3,
                          moe_intermediate_size=24, shared_expert_intermediate_size=40, moe_routed_scaling_factor=2.5,
                          moe_router_logit_softcapping=1.5)
    torch.manual_seed(1)
    theirs = LagunaSparseMoeBlock(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.normal_(0, 0.3 if name != "gate.weight" else 2.0)
    cfg = ModelConfig(family="laguna", vocab_size=16, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=24, shared_expert_intermediate_size=40, moe_layers=[True])
    ours = SparseMoE(cfg, Routing(3, True, scoring, 1.5, selection_bias=True, routed_scaling_factor=2.5,
                                  weights_on_input=on_input), shared_expert_gated=False)
    state = {name.replace("shared_experts.", "shared_expert.").replace("gate.e_score", "experts.e_score"): p
             for name, p in theirs.state_dict().items()}
    ours.load_state_dict(state)
    return ours.to(DEVICE), theirs


@pytest.mark.parametrize("tokens", [3, 20], ids=["decode-pairs", "prefill-grouped"])
@pytest.mark.parametrize("scoring, on_input", [("sigmoid", False), ("softmax", True)],
                         ids=["sigmoid", "softmax-weights-on-input"])
def test_laguna_moe_block_on_the_kernels_matches_transformers(tokens, scoring, on_input, monkeypatch):
    """Weights on the input and softmax scores are not in transformers' Laguna: there the reference
    is its block switched as test_laguna.softmax_on_input switches the model's."""
    from tests.model.test_laguna import _weights_on_input, _with_softmax_scores
    ours, theirs = laguna_blocks(scoring, on_input)
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        if scoring == "softmax":
            sigmoid_forward = theirs.gate.forward
            theirs.gate.forward = lambda h: _with_softmax_scores(sigmoid_forward, h)
        want = (_weights_on_input(theirs, x) if on_input else theirs(x))[0]
    x = x[0].to(DEVICE)
    calls = count_kernels(monkeypatch)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        got = ours(x)
    kernel = "pairs_experts" if tokens <= routing.MOE_PAIRS_MAX_TOKENS else "grouped_experts"
    assert calls == [(kernel, (tokens, 3))]  # weights on input: still one launch of [T, k] routes
    assert rel_err(got.cpu(), want) <= 1e-5
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with torch.no_grad():
        assert rel_err(ours(x).cpu(), want) <= 1e-5  # and the torch reference


# ----------------------------------------------------------------------------- GPU (compiled, CUDA graphs)

@gpu
@pytest.mark.parametrize("tokens", [1, 16, 300], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("weights_type", ["bf16", "Q4_K"])
@pytest.mark.parametrize("activation, on_input", VARIANTS, ids=VARIANT_IDS)
def test_the_variants_replay_from_a_cuda_graph_with_new_routes(tokens, weights_type, activation, on_input,
                                                               monkeypatch):
    experts, hidden, inter = 16, 512, 256
    if weights_type == "bf16":
        module = float_experts(experts, hidden, inter, torch.bfloat16)
    else:
        module = with_stacks(Experts(experts, hidden, inter), quant_experts(Q.Q4_K, experts, 2 * inter, hidden, 1),
                             quant_experts(Q.Q4_K, experts, hidden, inter, 2))
    with_activation(module, activation)
    x = torch.zeros(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, weights = routes(tokens, experts, 8, seed=0)
    weights = weights.to(torch.bfloat16)
    monkeypatch.delenv("LUCEBOX_TRITON", raising=False)
    calls = count_kernels(monkeypatch)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module(x, ids, weights, on_input)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(x, ids, weights, on_input)
        assert len(calls) == 2
        for seed in (1, 2):
            new_ids, new_weights = routes(tokens, experts, 8, seed=seed)
            x.copy_(torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(x))
            ids.copy_(new_ids)
            weights.copy_(new_weights)
            graph.replay()
            want = experts_reference(module, x, ids, weights, on_input, monkeypatch)
            monkeypatch.delenv("LUCEBOX_TRITON")
            assert rel_err(out, want) <= 2e-2


# ----------------------------------------------------------------------------- whole models

@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory, tokenizer_dir):
    from tests.model.test_gemma4 import MOE, build
    return build(tmp_path_factory, tokenizer_dir, "gemma4_moe", MOE)


@pytest.fixture(scope="module")
def laguna_on_input(tmp_path_factory, tokenizer_dir):
    """Laguna with softmax routing and weights on the experts' input, and transformers' model switched
    to them (its LagunaConfig refuses weights on input)."""
    from tests.model.test_laguna import SOFTMAX_ON_INPUT, build_laguna, softmax_on_input, transformers_model, with_config
    path = build_laguna(tmp_path_factory.mktemp("laguna_sigmoid"), tokenizer_dir, seed=5)
    return (with_config(path, tmp_path_factory.mktemp("laguna_on_input"), **SOFTMAX_ON_INPUT),
            softmax_on_input(transformers_model(path)))


@pytest.mark.parametrize("family", ["gemma4", "laguna"])
def test_moe_models_on_the_triton_kernels_match_transformers(family, request, monkeypatch):
    """A prefill of two sequences, then a decode step of both: every MoE layer's experts through the
    kernels (grouped, then pairs, [T, k] routes), with Triton's attention, norms and RoPE around them."""
    from lucebox.model.loader import load_model
    from tests.model.test_qwen3_5 import prompts, reference_logits, runner_for
    path, reference = request.getfixturevalue("gemma4_moe" if family == "gemma4" else "laguna_on_input")
    tolerance = 1e-3 if DEVICE == "cuda" else 1e-4  # as test_gemma4's CUDA test (TF32 off)
    if DEVICE == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    loaded = load_model(str(path), dtype="float32", device=DEVICE)
    cfg = loaded.config
    assert family == "gemma4" or (cfg.router_weights_on_input and not cfg.router_sigmoid)
    a, b = prompts(cfg.vocab_size, [12, 9], seed=5)
    runner, blocks = runner_for(loaded)
    tables = [[], []]
    blocks.allocate(tables[0], len(a))
    blocks.allocate(tables[1], len(b))
    calls = count_kernels(monkeypatch)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    prefill = runner.forward([a[:-1], b[:-1]], [0, 0], tables, all_logits=True)
    decode = runner.forward([a[-1:], b[-1:]], [len(a) - 1, len(b) - 1], tables, all_logits=True)
    moe_layers, k = sum(cfg.moe_layers), cfg.num_experts_per_tok
    assert calls == ([("grouped_experts", (len(a) + len(b) - 2, k))] * moe_layers
                     + [("pairs_experts", (2, k))] * moe_layers)
    got_a = torch.cat([prefill[:len(a) - 1], decode[:1]]).cpu()
    got_b = torch.cat([prefill[len(a) - 1:], decode[1:]]).cpu()
    assert (got_a - reference_logits(reference, a)).abs().max().item() <= tolerance
    assert (got_b - reference_logits(reference, b)).abs().max().item() <= tolerance
