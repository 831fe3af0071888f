"""The paged attention of a decode or verify step rounds its output rows to int8 for a quantised
o_proj in its last launch (kernels/attention.attention_output): the same bytes triton_dp4a.quantize_rows
would write, the same output, and the product unchanged. Without a GPU the kernels run under Triton's
interpreter."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.kernels.test_paged_attention import paged_case  # noqa: I001  (sets TRITON_INTERPRET=1 first)
from tests.kernels.test_triton_kernels import quant_rows  # noqa: E402
from lucebox.kernels import triton_dp4a as tdp  # noqa: E402
from lucebox.kernels import triton_paged_attention as tpa  # noqa: E402
from lucebox.kernels import triton_quant_int8 as tqi  # noqa: E402
from lucebox.kernels.attention import attention_output, paged_attention  # noqa: E402
from lucebox.weights.quant import QuantLinear, QuantTensor  # noqa: E402

CASES = {  # name: (cache type, dtype, q_lens, cached, paged_case kwargs, kernel kwargs)
    "decode-f32-one-split": ("f32", torch.float32, [1, 1], [13, 6], {"heads": 8}, {"num_splits": 1}),
    "decode-bf16-splits": ("bf16", torch.bfloat16, [1], [40], {"heads": 8}, {"num_splits": 3, "block_kv": 16}),
    "verify-f32-window": ("f32", torch.float32, [3, 5], [20, 9], {"heads": 8}, {"sliding_window": 7}),
    "head-dim-96-q8_0": ("q8_0", torch.float32, [1, 2], [9, 17], {"heads": 8, "head_dim": 96, "block_size": 16}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rounded_rows_are_the_bytes_quantize_rows_writes_of_the_same_output(case):
    cache_type, dtype, q_lens, cached, make_kw, run_kw = CASES[case]
    q, k_cache, v_cache, batch = paged_case(cache_type, dtype, q_lens, cached, **make_kw)
    window = run_kw.pop("sliding_window", None)
    scale = q.shape[-1] ** -0.5
    want = tpa.paged_attention(q, k_cache, v_cache, batch, scale, window, **run_kw)
    got, rows = tpa.paged_attention(q, k_cache, v_cache, batch, scale, window, rounded=True, **run_kw)
    assert torch.equal(got, want)
    assert torch.equal(rows, tdp.quantize_rows(got.view(got.shape[0], -1)))


def test_rows_are_refused_where_they_cannot_be_rounded():
    q, k_cache, v_cache, batch = paged_case("f32", torch.float32, [1], [9], heads=4, head_dim=48)
    assert not tpa.rounds_rows(q, v_cache)  # 4 x 48 values: not whole 256-value row blocks
    with pytest.raises(ValueError, match="heads \\* head_dim % 256"):
        tpa.paged_attention(q, k_cache, v_cache, batch, 0.1, rounded=True)


def o_proj_q4_k(k: int, seed: int = 71) -> QuantLinear:
    return QuantLinear(QuantTensor(quant_rows(Q.Q4_K, 32, k, seed=seed), Q.Q4_K, (32, k)))


def counting_quantize_rows(monkeypatch) -> list:
    rounds, real = [], tdp.quantize_rows
    for module in (tdp, tqi):
        monkeypatch.setattr(module, "quantize_rows", lambda x: rounds.append(1) or real(x))
    return rounds


@pytest.mark.parametrize("q_lens,cached", [([1, 1], [13, 6]), ([4], [20])], ids=["decode", "verify"])
def test_a_quantised_o_proj_takes_the_rows_attention_rounded(monkeypatch, q_lens, cached):
    """No quantising launch of the product's own, and the product's bytes are unchanged."""
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    q, k_cache, v_cache, batch = paged_case("f32", torch.float32, q_lens, cached, heads=8)
    o_proj = o_proj_q4_k(q.shape[1] * q.shape[2])
    with torch.no_grad():
        want = o_proj(paged_attention(q, k_cache, v_cache, batch, 0.2).reshape(q.shape[0], -1))
        rounds = counting_quantize_rows(monkeypatch)
        got = attention_output(q, k_cache, v_cache, batch, 0.2, None, o_proj)
    assert not rounds
    assert torch.equal(got, want)


def test_a_rotated_v_cache_keeps_the_products_own_rounding(monkeypatch):
    """The rotated cache's output is un-rotated after the kernels: rounded by the product, as before."""
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    monkeypatch.delenv("LUCEBOX_INT8_ACTIVATIONS", raising=False)
    q, k_cache, v_cache, batch = paged_case("q8_0", torch.float32, [1], [9], heads=8, rotate=True)
    o_proj = o_proj_q4_k(q.shape[1] * q.shape[2])
    with torch.no_grad():
        want = o_proj(paged_attention(q, k_cache, v_cache, batch, 0.2).reshape(1, -1))
        rounds = counting_quantize_rows(monkeypatch)
        got = attention_output(q, k_cache, v_cache, batch, 0.2, None, o_proj)
    assert rounds == [1]
    assert torch.equal(got, want)
