"""Sliding-window attention never uses the K/V of positions behind the window: every path gives the
same output when those blocks are released (their table entries point at a scratch block holding
anything), so the cache manager may hand them to other sequences at once."""
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

from lucebox.kernels import prefill_attention  # noqa: E402
from lucebox.kernels.attention import paged_attention  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402
from lucebox.model.kv_cache import PagedKVCache  # noqa: E402

WINDOW, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 6, 4, 4, 2, 16


def windowed_case(ctx: int, q_len: int, poison: float, seed: int = 0, device: str = "cpu"):
    """One sequence of ctx cached + q_len new tokens on shuffled blocks, and the same table with the
    blocks wholly behind position ctx - WINDOW + 1 released to a scratch block filled with `poison`.
    Returns (q, k_cache, v_cache, full batch, released batch)."""
    g = torch.Generator().manual_seed(seed)
    need = -(-(ctx + q_len) // BLOCK)
    scratch = need
    caches = [PagedKVCache(need + 1, BLOCK, KV_HEADS, HEAD_DIM, "f32", torch.float32, device) for _ in range(2)]
    table = torch.randperm(need, generator=g).tolist()
    slots = ForwardBatch.build([[0] * (ctx + q_len)], [0], [table], BLOCK, device).slot_mapping
    for cache in caches:
        cache.write(torch.randn(ctx + q_len, KV_HEADS, HEAD_DIM, generator=g).to(device), slots)
        cache.values[scratch] = poison
    released = [scratch if i < (ctx - WINDOW + 1) // BLOCK else b for i, b in enumerate(table)]
    assert released.count(scratch) >= 2
    q = torch.randn(q_len, HEADS, HEAD_DIM, generator=g).to(device)
    batches = [ForwardBatch.build([[0] * q_len], [ctx], [t], BLOCK, device) for t in (table, released)]
    return (q, *caches, *batches)


@pytest.mark.parametrize("q_len", [1, 3, prefill_attention.MIN_QUERY_LEN + 5])
def test_torch_reference_and_prefill_paths_never_read_released_blocks(q_len, monkeypatch):
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    q, k, v, full, released = windowed_case(40, q_len, float("nan"))
    want = paged_attention(q, k, v, full, HEAD_DIM ** -0.5, WINDOW)
    got = paged_attention(q, k, v, released, HEAD_DIM ** -0.5, WINDOW)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("q_len", [1, 4])
def test_device_only_reference_masks_released_blocks_before_the_softmax(q_len, monkeypatch):
    """The graph path's torch reference reads the whole table width; the window mask gives the
    released (finite) values weight zero."""
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    q, k, v, full, released = windowed_case(40, q_len, 1e4)

    def device_only(b):
        return ForwardBatch.from_device(b.input_ids, b.positions, b.seq_lens, b.block_tables, b.slot_mapping,
                                        BLOCK, q_len)

    want = paged_attention(q, k, v, full, HEAD_DIM ** -0.5, WINDOW)
    got = paged_attention(q, k, v, device_only(released), HEAD_DIM ** -0.5, WINDOW)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter on a machine without a GPU")
@pytest.mark.parametrize("q_len,splits", [(1, 1), (3, 2)])
def test_triton_kernel_never_reads_released_blocks(q_len, splits):
    pytest.importorskip("triton")
    from lucebox.kernels import triton_paged_attention as tpa

    q, k, v, full, released = windowed_case(40, q_len, float("nan"), device="cuda" if ON_GPU else "cpu")
    want = tpa.paged_attention(q, k, v, full, HEAD_DIM ** -0.5, WINDOW, num_splits=splits, block_kv=16)
    got = tpa.paged_attention(q, k, v, released, HEAD_DIM ** -0.5, WINDOW, num_splits=splits, block_kv=16)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
