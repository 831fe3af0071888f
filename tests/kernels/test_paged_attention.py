"""The Triton paged attention (kernels/triton_paged_attention.py) computes what the torch reference
(kernels/attention.paged_attention_reference) computes, over every KV cache format, split-K, sliding
windows, GQA groups, wide heads and rotated caches; the dispatcher sends work to it when switched on.
Without a GPU it runs under Triton's interpreter (tests/kernels/test_triton_kernels.py, imported
first, sets it up). `paged_case` builds the caches and batch the other attention tests use too."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_kernels import DEVICE  # noqa: I001  (sets TRITON_INTERPRET=1 first)
from lucebox.kernels import triton_paged_attention as tpa  # noqa: E402
from lucebox.kernels.attention import paged_attention  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402
from lucebox.model.kv_cache import PagedKVCache  # noqa: E402


def paged_case(cache_type, dtype, q_lens, cached, heads=4, kv_heads=2, head_dim=32, block_size=4,
               rotate=False, seed=0):
    """Caches holding `cached[i]` context tokens plus this step's `q_lens[i]` new ones for each
    sequence, on shuffled blocks; returns (q, k_cache, v_cache, batch)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, q_lens)) + 3
    caches = [PagedKVCache(num_blocks, block_size, kv_heads, head_dim, cache_type, dtype, DEVICE, rotate=rotate)
              for _ in range(2)]
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for c, n in zip(cached, q_lens):
        need = -(-(c + n) // block_size)
        tables.append(free[:need])
        free = free[need:]
        slots = ForwardBatch.build([list(range(c + n))], [0], [tables[-1]], block_size, DEVICE).slot_mapping
        for cache in caches:
            cache.write(torch.randn(c + n, kv_heads, head_dim, generator=g).to(DEVICE, dtype), slots)
    batch = ForwardBatch.build([[0] * n for n in q_lens], list(cached), tables, block_size, DEVICE)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(DEVICE, dtype)
    return q, caches[0], caches[1], batch


ATTENTION_CASES = {
    # name: (cache type, dtype, q_lens, cached, extra paged_case kwargs, kernel kwargs, tolerance)
    "decode-f32": ("f32", torch.float32, [1, 1], [13, 6], {}, {}, 1e-5),
    "verify-mixed-f32": ("f32", torch.float32, [1, 3, 5, 0], [10, 0, 17, 4], {}, {}, 1e-5),
    "split-k-f32": ("f32", torch.float32, [1, 4], [37, 20], {}, {"num_splits": 3, "block_kv": 16}, 1e-5),
    "sliding-window-f32": ("f32", torch.float32, [2, 4], [30, 20], {},
                           {"sliding_window": 7, "num_splits": 2, "block_kv": 16}, 1e-5),
    "verify-32-group3-f32": ("f32", torch.float32, [32], [9], {"heads": 6, "kv_heads": 2}, {}, 1e-5),
    "head-dim-48-f32": ("f32", torch.float32, [1, 2], [9, 5], {"head_dim": 48, "block_size": 16}, {}, 1e-5),
    "bf16": ("bf16", torch.bfloat16, [1, 3], [40, 9], {}, {}, 2e-2),
    "f16-split": ("f16", torch.float16, [1, 3], [40, 9], {}, {"num_splits": 2, "block_kv": 16}, 2e-3),
    "fp8-bf16": ("fp8", torch.bfloat16, [1, 3], [40, 9], {}, {}, 2e-2),
    "fp8-f32-split": ("fp8", torch.float32, [2, 3], [40, 9], {}, {"num_splits": 2, "block_kv": 16}, 1e-5),
    "q8_0-bf16-split": ("q8_0", torch.bfloat16, [1, 3], [40, 9], {}, {"num_splits": 4, "block_kv": 16}, 2e-2),
    "q8_0-f32-rotated": ("q8_0", torch.float32, [2, 3], [40, 9], {"rotate": True}, {}, 1e-5),
    "q4_0-f32-window": ("q4_0", torch.float32, [1, 3], [40, 9], {}, {"sliding_window": 16}, 1e-5),
    # a prefill chunk on a cached context, in several query tiles of a sweep's launch
    "prefill-rows-64-f32": ("f32", torch.float32, [70], [50], {"heads": 8, "kv_heads": 2},
                            {"rows": 64, "num_stages": 2, "block_kv": 16}, 1e-5),
    "wide-heads-512-f32": ("f32", torch.float32, [1, 40], [9, 20], {"head_dim": 512, "block_size": 16}, {}, 1e-5),
    # Gemma 4's full-attention layers as launched: 512-wide heads, 16 query heads a K/V head, 16-bit
    "gemma4-global-bf16": ("bf16", torch.bfloat16, [1, 40], [9, 20],
                           {"head_dim": 512, "heads": 32, "kv_heads": 2, "block_size": 16}, {}, 2e-2),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_matches_the_torch_reference(case):
    cache_type, dtype, q_lens, cached, make_kw, run_kw, tol = ATTENTION_CASES[case]
    q, k_cache, v_cache, batch = paged_case(cache_type, dtype, q_lens, cached, **make_kw)
    window = run_kw.pop("sliding_window", None)
    head_dim = q.shape[-1]
    want = paged_attention(q, k_cache, v_cache, batch, head_dim ** -0.5, window)
    got = tpa.paged_attention(q, k_cache, v_cache, batch, head_dim ** -0.5, window, **run_kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_paged_attention_dispatches_to_triton_when_switched_on(monkeypatch):
    q, k_cache, v_cache, batch = paged_case("bf16", torch.bfloat16, [1, 2], [5, 3])
    monkeypatch.setenv("LUCEBOX_TRITON", "0")  # the torch reference, on any device
    want = paged_attention(q, k_cache, v_cache, batch, 0.2)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls = []
    real = tpa.paged_attention
    monkeypatch.setattr(tpa, "paged_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = paged_attention(q, k_cache, v_cache, batch, 0.2)
    assert calls == [1] and (got.float() - want.float()).abs().max().item() <= 2e-2


H100_SHARED, A100_SHARED, RTX3090_SHARED = 232_448, 166_912, 101_376


@pytest.mark.parametrize("block_r, block_d, kv_bytes, shared, want", [
    (16, 128, 2, H100_SHARED, 128),  # a bf16 decode tile on Hopper: the sweep's fastest
    (64, 128, 2, H100_SHARED, 128),  # a 16-token verify of 4 query heads a K/V head
    (64, 128, 2, A100_SHARED, 64),  # three 128-key K/V stages (192 KiB) do not fit
    (16, 128, 2, RTX3090_SHARED, 64),
    (16, 128, 4, H100_SHARED, 64),  # f32 cache
    (16, 128, 1, H100_SHARED, 64),  # fp8 / q8_0 / q4_0 / mixed K and V
    (128, 128, 2, H100_SHARED, 32),  # prefill-chunk tiles
    (16, 256, 2, H100_SHARED, 32),  # wide heads
])
def test_key_tile_takes_128_keys_only_where_its_stages_fit(block_r, block_d, kv_bytes, shared, want):
    assert tpa.key_tile(block_r, block_d, kv_bytes, shared) == want


def test_default_launch_of_a_bf16_verify_equals_narrow_key_tiles():
    """The heuristic's 128-key tiles (CPU: nominal Hopper shared memory) against 16-key ones."""
    q, k_cache, v_cache, batch = paged_case("bf16", torch.bfloat16, [16, 1], [300, 200], heads=8, head_dim=128,
                                            block_size=16)
    assert tpa.key_tile(64, 128, 2, 227 * 1024) == 128  # 16 tokens x 4 query heads a K/V head
    wide = tpa.paged_attention(q, k_cache, v_cache, batch, 0.1)
    narrow = tpa.paged_attention(q, k_cache, v_cache, batch, 0.1, block_kv=16)
    assert (wide.float() - narrow.float()).abs().max().item() <= 2e-2
