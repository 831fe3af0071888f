"""Attention in the padded static batches a graph replays: the device-only torch reference equals the
ragged one, and the graph-safe Triton attention (TRITON_INTERPRET=1 on the CPU) equals the reference,
alone and in a padded model step.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.engine.test_cuda_graphs import (  # noqa: I001  (sets TRITON_INTERPRET=1 first)
    BLOCK, ON_GPU, GraphSettings, prefilled, rel_err, step_tokens, tiny_model)

from lucebox.engine.graph_io import StaticInputs
from lucebox.engine.step_plan import StepPlan
from lucebox.kernels.attention import paged_attention
from lucebox.kernels.forward_batch import ForwardBatch
from lucebox.model.kv_cache import PagedKVCache

def test_the_device_only_reference_attention_matches_the_ragged_one():
    """The torch attention of a device-only batch (masks over the whole table) equals the per-sequence one."""
    q_lens, cached = [1, 3, 2], [13, 6, 0]
    q, k_cache, v_cache, batch, static, real = attention_case(q_lens, cached, query_len=3, num_seqs=4)
    for window in (None, 5):
        want = paged_attention(q, k_cache, v_cache, batch, 0.25, window)
        got = paged_attention(padded_queries(q, real, static), k_cache, v_cache, static, 0.25, window)
        assert rel_err(got[real], want) <= 1e-5


def attention_case(q_lens, cached, query_len, num_seqs, cache_type="f32", dtype=torch.float32,
                   device="cpu", width=8):
    """Caches with each sequence's context and new tokens written, plus the ragged batch and the
    padded device-only batch of the same step; returns (q, k, v, ragged, static, real rows)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, num_blocks = 4, 2, 32, 24
    caches = [PagedKVCache(num_blocks + 1, BLOCK, kv_heads, head_dim, cache_type, dtype, device) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for c, n in zip(cached, q_lens):
        need = -(-(c + n) // BLOCK)
        tables.append(order[:need])
        order = order[need:]
        slots = ForwardBatch.build([list(range(c + n))], [0], [tables[-1]], BLOCK, device).slot_mapping
        for cache in caches:
            cache.write(torch.randn(c + n, kv_heads, head_dim, generator=g).to(device, dtype), slots)
    ragged = ForwardBatch.build([[0] * n for n in q_lens], list(cached), tables, BLOCK, device)
    inputs = StaticInputs(num_seqs * query_len, num_seqs, width, torch.device(device))
    real = inputs.fill([[0] * n for n in q_lens], list(cached), tables, num_seqs, query_len, BLOCK, num_blocks)
    inputs.upload(num_seqs)
    tokens = num_seqs * query_len
    static = ForwardBatch.from_device(inputs.view("ids", tokens), inputs.view("positions", tokens),
                                      inputs.view("seq_lens", num_seqs), inputs.tables[:num_seqs],
                                      inputs.view("slots", tokens), BLOCK, query_len)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(device, dtype)
    return q, caches[0], caches[1], ragged, static, real


def padded_queries(q: torch.Tensor, real: list[int], static: ForwardBatch) -> torch.Tensor:
    out = torch.randn(static.num_tokens, *q.shape[1:], dtype=q.dtype, device=q.device)  # padding: anything
    out[real] = q
    return out


# ----------------------------------------------------------------------------- graph-safe Triton attention

TRITON_CASES = {  # name: (q_lens, cached, query_len, num_seqs, kernel kwargs)
    "decode": ([1, 1, 1], [13, 6, 30], 1, 4, {}),
    "verify-ragged": ([4, 2], [9, 0], 4, 2, {}),
    "empty-splits": ([1, 2], [2, 5], 2, 2, {"num_splits": 8, "block_kv": 16}),  # most splits see no keys
    "window-splits": ([3, 1], [25, 17], 3, 2, {"sliding_window": 6, "num_splits": 3, "block_kv": 16}),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_graph_safe_triton_attention_matches_the_torch_reference(case, monkeypatch):
    pytest.importorskip("triton")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    from lucebox.kernels import triton_paged_attention as tpa
    q_lens, cached, query_len, num_seqs, kwargs = TRITON_CASES[case]
    device = "cuda" if ON_GPU else "cpu"
    q, k_cache, v_cache, ragged, static, real = attention_case(q_lens, cached, query_len, num_seqs, device=device)
    window = kwargs.pop("sliding_window", None)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")  # the ragged torch reference, on any device
    want = paged_attention(q, k_cache, v_cache, ragged, 0.25, window)
    got = tpa.paged_attention(padded_queries(q, real, static), k_cache, v_cache, static, 0.25, window, **kwargs)
    assert rel_err(got[real], want) <= 1e-5


def test_a_padded_model_step_through_triton_kernels_matches_the_eager_reference(monkeypatch):
    """The whole model on a device-only batch with Triton kernels (interpreted on the CPU)."""
    pytest.importorskip("triton")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    device = "cuda" if ON_GPU else "cpu"
    settings = GraphSettings(64, max_batch=4, query_lens=(1, 4), capture=False)
    runner, tables, lens = prefilled(tiny_model(device), settings, 3)
    args = (step_tokens([2, 4, 3]), lens, tables)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want = runner.run_eager(StepPlan.forward(*args, all_logits=True)).logits
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got = runner.forward(*args, all_logits=True)
    assert runner.graphs.replays[(4, 4)] == 1 and rel_err(got, want) <= 1e-4
