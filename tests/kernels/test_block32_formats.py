"""The 32-value block formats llama.cpp's quantizer falls back to where a row length is not a multiple
of 256 (Q4_1, Q5_0, Q5_1, IQ4_NL: e.g. Gemma 4 26B-A4B's 704-column expert down projections in a
"Q4_K_M" GGUF) go through the fused Triton kernels: the dequantiser bit for bit, the dense products
(one row elementwise, several through tl.dot), the MoE expert kernels, and the routing sends them there.

Weights are real quantisations: gguf-py's quantizer where it has one, else (IQ4_NL) the nearest
codebook entries under one scale a block, checked against gguf-py's dequantiser. Without a GPU the
kernels run under Triton's interpreter (set up by tests/kernels/test_triton_kernels.py, imported
first) on tiny shapes; the last tests run Gemma's real widths on a GPU only.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from lucebox.kernels import dequant, routing
from lucebox.kernels import moe as kmoe
from lucebox.model.moe import Experts
from lucebox.weights.quant import QuantLinear, QuantTensor
from tests.kernels.test_triton_kernels import DEVICE, FALLBACK_TYPES, ON_GPU, rel_err

# after the import above has set TRITON_INTERPRET=1 (these import Triton)
from lucebox.kernels import triton_moe as tm  # noqa: I001
from lucebox.kernels import triton_quant_matmul as tqm
from tests.kernels.test_triton_moe import quant_experts, reference, routes, with_stacks

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def iq4_nl_blocks(values: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of float32 values [..., 32k]: d makes the largest magnitude the codebook's -127
    end (as llama.cpp starts), each value the codebook entry nearest to value / d (gguf-py has no
    IQ4_NL quantizer)."""
    blocks = values.reshape(-1, 32)
    extreme = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    d = (extreme / -127.0).astype(np.float16)
    book = np.array(dequant.IQ4_KVALUES, dtype=np.float32)  # ascending
    scaled = blocks / np.where(d == 0, 1, d).astype(np.float32)[:, None]
    codes = np.searchsorted((book[1:] + book[:-1]) / 2, scaled).astype(np.uint8)
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), packed], axis=1).reshape(*values.shape[:-1], -1)


def quantised(qtype, rows: int, cols: int, seed: int, std: float = 0.02) -> torch.Tensor:
    """Raw GGUF rows [rows, bytes a row] of normal weights, checked to decode (gguf-py) near them."""
    values = (np.random.default_rng(seed).standard_normal((rows, cols)) * std).astype(np.float32)
    raw = iq4_nl_blocks(values) if qtype == Q.IQ4_NL else gguf_quantize(values, qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8)
    assert np.abs(gguf_dequantize(raw, qtype) - values).max() <= 0.2 * np.abs(values).max()
    return torch.from_numpy(raw).to(DEVICE)


@pytest.mark.parametrize("cols", [96, 704], ids=["3-blocks", "gemma-704"])
@pytest.mark.parametrize("qtype", FALLBACK_TYPES, ids=lambda t: t.name)
def test_dequantiser_is_bit_exact_with_gguf_and_products_match_in_float32(qtype, cols):
    """Mode 2 (prefill's dequantiser) equals dequant.dequantize and gguf-py bit for bit; modes 0 (one
    row) and 1 (tl.dot) the dequantised product to float32 rounding, split-K and bias included."""
    n = 24  # with BLOCK_N 16: a partial tile of output features
    raw = quantised(qtype, n, cols, seed=cols + qtype.value)
    weight = dequant.dequantize(raw, qtype)
    assert torch.equal(weight.cpu(), torch.from_numpy(gguf_dequantize(raw.cpu().numpy(), qtype)))
    assert torch.equal(tqm.dequantize(raw, qtype, cols), weight)
    assert torch.equal(tqm.dequantize(raw, qtype, cols, torch.bfloat16), weight.to(torch.bfloat16))
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(5, cols, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    want = x @ weight.T
    for split_k in (1, 2):
        assert rel_err(tqm.quant_matmul(x[:1], raw, qtype, cols, split_k=split_k), want[:1]) <= 1e-5
        assert rel_err(tqm.quant_matmul(x, raw, qtype, cols, bias, split_k=split_k), want + bias) <= 1e-5
    got = tqm.quant_matmul(x[:3].to(torch.bfloat16), raw, qtype, cols, bias.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and rel_err(got, x[:3] @ weight.T + bias) <= 1e-2


@pytest.mark.parametrize("qtype", FALLBACK_TYPES, ids=lambda t: t.name)
def test_linears_and_embeddings_of_these_formats_take_the_triton_kernels(qtype, monkeypatch):
    """With Triton on (CUDA, or LUCEBOX_TRITON=1 here): one row and verify rows on the fused kernel,
    prefill rows and embedding lookups on the Triton dequantiser, each what the reference computes."""
    from lucebox.weights.quant import QuantEmbedding
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls = []
    for name in ("quant_matmul", "dequantize"):
        real = getattr(tqm, name)
        monkeypatch.setattr(tqm, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    raw = quantised(qtype, 16, 96, seed=qtype.value)
    layer = QuantLinear(QuantTensor(raw, qtype, (16, 96)))
    weight = dequant.dequantize(raw, qtype)
    for rows in (1, 3, tqm.MAX_FUSED_M + 1):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        assert rel_err(layer(x), x @ weight.T) <= 1e-5
    table = QuantEmbedding(QuantTensor(raw, qtype, (16, 96)))
    ids = torch.tensor([[3, 0, 15]], device=DEVICE)
    assert torch.equal(table(ids), weight[ids])  # bit for bit: the dequantiser
    assert calls == ["quant_matmul", "quant_matmul", "dequantize", "dequantize"]


@pytest.mark.parametrize("qtype", FALLBACK_TYPES, ids=lambda t: t.name)
def test_the_routing_table_sends_these_formats_to_the_fused_kernels(qtype, monkeypatch):
    monkeypatch.setattr(routing, "use_triton", lambda *tensors: True)  # the GPU's answer
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    layer = QuantLinear(QuantTensor(quantised(qtype, 8, 704, seed=1).cpu(), qtype, (8, 704)))
    kernels = [routing.quant_route(torch.zeros(rows, 704), layer.qweight, qtype, 704, False) for rows in (1, 16, 65)]
    assert kernels == [routing.QUANT_GEMV, routing.QUANT_TILES, routing.DEQUANT_MATMUL]


def gemma_like_experts(qtype, experts: int, hidden: int, inter: int, seed: int) -> Experts:
    """Gemma 4's GeGLU experts whose gate_up rows are Q4_K where hidden allows (as in its GGUFs), else
    qtype, and whose down rows (inter columns, not a multiple of 256) are qtype."""
    up_type = Q.Q4_K if hidden % 256 == 0 else qtype
    if up_type == Q.Q4_K:  # gguf-py cannot quantise Q4_K: valid random blocks
        gate_up = quant_experts(Q.Q4_K, experts, 2 * inter, hidden, seed)
    else:
        gate_up = QuantTensor(quantised(qtype, experts * 2 * inter, hidden, seed), qtype, (experts, 2 * inter, hidden))
    down = QuantTensor(quantised(qtype, experts * hidden, inter, seed + 1), qtype, (experts, hidden, inter))
    return with_stacks(Experts(experts, hidden, inter, "gelu_pytorch_tanh"), gate_up, down)


@pytest.mark.parametrize("qtype", FALLBACK_TYPES, ids=lambda t: t.name)
def test_moe_experts_of_these_formats_match_the_reference(qtype, monkeypatch):
    """Pairs (decode: split-K and expert groups too) and grouped (verify, prefill) expert kernels read
    experts of these formats in place, and Experts' forward takes them."""
    experts, hidden, inter = 3, 64, 96
    module = gemma_like_experts(qtype, experts, hidden, inter, seed=qtype.value)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ids, weights = routes(3, experts, 2, seed=6)
    want = reference(module, x, ids, weights, monkeypatch)
    stacks = kmoe.stacked(module.gate_up_proj), kmoe.stacked(module.down_proj)
    act = {"activation": module.activation}
    for got in (tm.pairs_experts(x, ids, weights, *stacks, split_k=1, groups=1, **act),
                tm.pairs_experts(x, ids, weights, *stacks, split_k=2, groups=2, **act),
                tm.grouped_experts(x, ids, weights, *stacks, block_m=16, block_n=32, **act)):
        assert rel_err(got, want) <= 1e-5
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    with torch.no_grad():
        assert kmoe.expert_kernel(x, ids, module.gate_up_proj, module.down_proj, module.activation) == routing.MOE_PAIRS
        assert rel_err(module(x, ids, weights), want) <= 1e-5


# ----------------------------------------------------------------------------- GPU: Gemma's real widths

@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (compiled kernels at Gemma 4 26B-A4B's sizes)")
@pytest.mark.parametrize("qtype", FALLBACK_TYPES, ids=lambda t: t.name)
def test_on_gpu_gemma_sized_products_and_experts_of_these_formats(qtype, monkeypatch):
    """Compiled for the GPU: the dense down projection (2816 x 2112), the dequantiser bit for bit, and
    experts of 704 (down) behind Q4_K gate_up rows, top 8 (32 experts of Gemma's 128: quantising
    them on the host is the slow part), bf16 activations at decode, verify and prefill token counts
    against the torch reference."""
    hidden, dense, experts, inter, top_k = 2816, 2112, 32, 704, 8
    raw = quantised(qtype, hidden, dense, seed=1)
    weight = dequant.dequantize(raw, qtype)
    assert torch.equal(tqm.dequantize(raw, qtype, dense), weight)
    assert torch.equal(tqm.dequantize(raw, qtype, dense, torch.bfloat16), weight.to(torch.bfloat16))
    for m in (1, 16, 64):
        x = torch.randn(m, dense, device="cuda", dtype=torch.bfloat16)
        assert rel_err(tqm.quant_matmul(x, raw, qtype, dense), x.float() @ weight.T) <= 1e-2
    module = gemma_like_experts(qtype, experts, hidden, inter, seed=2)
    stacks = kmoe.stacked(module.gate_up_proj), kmoe.stacked(module.down_proj)
    for tokens in (1, 16, 300):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids, weights = routes(tokens, experts, top_k, seed=tokens)
        weights = weights.to(torch.bfloat16)
        want = reference(module, x, ids, weights, monkeypatch)
        for run in (tm.pairs_experts, tm.grouped_experts):
            if run is tm.grouped_experts or tokens <= routing.MOE_PAIRS_MAX_TOKENS:
                assert rel_err(run(x, ids, weights, *stacks, activation=module.activation), want) <= 2e-2
