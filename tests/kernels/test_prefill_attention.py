"""The prefill attention path (kernels/prefill_attention.py) computes what the torch reference computes.

Random paged caches on shuffled blocks; every case compares against
kernels.attention.paged_attention_reference (whole context gathered, dense mask, SDPA). The
prefill path reads the chunk's own K/V back from the cache like the reference does, so it
matches it to float32 rounding for every cache type, quantised ones included. On a GPU the same
tests run there (bf16 then goes through FlashAttention).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from lucebox.kernels import prefill_attention as pa  # noqa: E402
from lucebox.kernels.attention import paged_attention, paged_attention_reference
from lucebox.kernels.forward_batch import ForwardBatch

from tests.kernels.test_paged_attention import paged_case  # noqa: I001  (sets TRITON_INTERPRET=1 before triton loads)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# Triton's interpreter must be on before Triton is first imported (see tests/test_triton_kernels.py).
TRITON_INTERPRETABLE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1" or "triton" not in sys.modules
if not ON_GPU and TRITON_INTERPRETABLE:
    os.environ["TRITON_INTERPRET"] = "1"

F32_TOL = 1e-5
BF16_TOL = 2e-2


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float().cpu() - want.float().cpu()).abs().max().item()


@pytest.fixture
def prefill_calls(monkeypatch):
    """Records the sequences each prefill_attention call handled."""
    calls = []
    real = pa.prefill_attention

    def spy(*args, **kwargs):
        calls.append(list(kwargs.get("seqs") or []))
        return real(*args, **kwargs)

    monkeypatch.setattr(pa, "prefill_attention", spy)
    return calls


CACHE_TYPES = {  # name: (cache type, rotate)
    "f32": ("f32", False), "bf16-cache": ("bf16", False), "fp8": ("fp8", False), "q8_0": ("q8_0", False),
    "q4_0": ("q4_0", False), "q8_0-rotated": ("q8_0", True),
}


@pytest.mark.parametrize("name", list(CACHE_TYPES))
def test_fresh_prefills_match_the_reference_for_every_cache_type(name, prefill_calls):
    cache_type, rotate = CACHE_TYPES[name]
    q, kc, vc, batch = paged_case(cache_type, torch.float32, [64, 100, 77], [0, 0, 0], rotate=rotate)
    got = paged_attention(q, kc, vc, batch, 0.2)
    assert prefill_calls == [[0, 1, 2]]
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.2)) <= F32_TOL


@pytest.mark.parametrize("cache_type", ["f32", "q4_0"])
def test_chunked_prefill_over_cached_context_matches_the_reference(cache_type, prefill_calls):
    q, kc, vc, batch = paged_case(cache_type, torch.float32, [64, 90], [37, 200])
    got = paged_attention(q, kc, vc, batch, 0.2)
    assert prefill_calls == [[0, 1]]
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.2)) <= F32_TOL


@pytest.mark.parametrize("q_len", [1, 2, 5, 64])
def test_prefix_cache_hit_shapes_match_the_reference(q_len):
    """A prefix hit leaves whole cached blocks and a remainder of any length, down to one token."""
    q, kc, vc, batch = paged_case("q8_0", torch.float32, [q_len, q_len], [64, 128], block_size=16)
    got = pa.prefill_attention(q, kc, vc, batch, 0.2)
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.2)) <= F32_TOL


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_grouped_query_heads_match_the_reference(heads, kv_heads):
    q, kc, vc, batch = paged_case("f32", torch.float32, [70, 65], [0, 30], heads=heads, kv_heads=kv_heads)
    got = pa.prefill_attention(q, kc, vc, batch, 0.2)
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.2)) <= F32_TOL


def test_heads_wider_than_fused_gqa_take_a_batch_entry_a_kv_head(monkeypatch):
    """Gemma 4's 512-wide full-attention heads with shared K/V heads: SDPA is never asked to broadcast
    K/V heads (no fused kernel does at that width; the math kernel would hold [heads, q, keys] scores),
    and the result is the reference's, fresh and on a cached context."""
    q, kc, vc, batch = paged_case("f32", torch.float32, [70, 65], [0, 30], heads=8, kv_heads=2, head_dim=512,
                                  block_size=16)
    asked = []
    real = pa.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        asked.append(kwargs.get("enable_gqa", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(pa.F, "scaled_dot_product_attention", spy)
    got = pa.prefill_attention(q, kc, vc, batch, 0.2)
    monkeypatch.undo()
    assert len(asked) == 2 * 4 and not any(asked)  # two sequences, four query heads a K/V head
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.2)) <= F32_TOL


@pytest.mark.parametrize("window", [1, 7, 64, 200, 1000])
def test_sliding_windows_match_the_reference(window):
    """Windows smaller than a query tile, spanning several tiles (300 queries), reaching into the
    cached context, and wider than the whole sequence."""
    q, kc, vc, batch = paged_case("q4_0", torch.float32, [300, 80], [0, 150])
    got = pa.prefill_attention(q, kc, vc, batch, 0.2, window)
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.2, window)) <= F32_TOL


def test_query_tiles_shorter_than_a_wide_window_match_the_reference():
    """A 600-position window over 1,300 queries after 400 cached: tiles of window / WINDOW_TILES queries."""
    assert 600 // pa.WINDOW_TILES > pa.MIN_WINDOW_TILE
    q, kc, vc, batch = paged_case("f32", torch.float32, [1300], [400], heads=4, kv_heads=2)
    got = pa.prefill_attention(q, kc, vc, batch, 0.2, 600)
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.2, 600)) <= F32_TOL


def test_a_mixed_step_sends_only_its_long_chunks_to_the_prefill_path(prefill_calls):
    q_lens, cached = [1, 80, 0, 3, 64, 1], [20, 0, 9, 33, 100, 5]
    q, kc, vc, batch = paged_case("fp8", torch.float32, q_lens, cached)
    for window in (None, 9):
        got = paged_attention(q, kc, vc, batch, 0.2, window)
        want = paged_attention_reference(q, kc, vc, batch, 0.2, window)
        assert max_err(got, want) <= F32_TOL
        if DEVICE == "cpu":  # decodes and verifies still run the reference itself
            short = torch.cat([torch.arange(0, 1), torch.arange(81, 84), torch.arange(148, 149)])
            assert torch.equal(got[short], want[short])
    assert prefill_calls == [[1, 4], [1, 4]]


def test_steps_without_a_long_chunk_keep_their_path(prefill_calls):
    q, kc, vc, batch = paged_case("q8_0", torch.float32, [1, 3, 63, 0], [40, 9, 2, 4])
    got = paged_attention(q, kc, vc, batch, 0.2, 16)
    want = paged_attention_reference(q, kc, vc, batch, 0.2, 16)
    assert prefill_calls == []
    assert torch.equal(got, want) if DEVICE == "cpu" else max_err(got, want) <= F32_TOL


@pytest.mark.parametrize("window", [None, 24])
def test_bfloat16_matches_the_reference_to_bfloat16_rounding(window):
    q, kc, vc, batch = paged_case("bf16", torch.bfloat16, [96, 70], [0, 50], heads=8, kv_heads=2, head_dim=64)
    got = pa.prefill_attention(q, kc, vc, batch, 0.125, window)
    assert got.dtype == torch.bfloat16
    assert max_err(got, paged_attention_reference(q, kc, vc, batch, 0.125, window)) <= BF16_TOL


def test_a_chunk_attends_to_the_same_keys_whether_the_prompt_came_whole_or_in_chunks():
    """K/V come back from the (here q4_0) cache for the chunk's own positions too, so the last 96
    queries of a 160-token prompt see the same keys as a 96-token chunk after 64 cached tokens."""
    q, kc, vc, whole = paged_case("q4_0", torch.float32, [160], [0])
    chunk = ForwardBatch.build([[0] * 96], [64], [whole.block_tables[0].tolist()], whole.block_size, DEVICE)
    got_whole = pa.prefill_attention(q, kc, vc, whole, 0.2)
    got_chunk = pa.prefill_attention(q[64:].contiguous(), kc, vc, chunk, 0.2)
    assert max_err(got_chunk, got_whole[64:]) <= F32_TOL


def test_a_device_only_batch_is_refused():
    q, kc, vc, batch = paged_case("f32", torch.float32, [64], [0])
    static = ForwardBatch.from_device(batch.input_ids, batch.positions, batch.seq_lens, batch.block_tables,
                                      batch.slot_mapping, batch.block_size, query_len=64)
    with pytest.raises(ValueError, match="host-side lengths"):
        pa.prefill_attention(q, kc, vc, static, 0.2)


@pytest.mark.skipif(not TRITON_INTERPRETABLE, reason="triton was imported before TRITON_INTERPRET=1 could be set")
def test_with_triton_on_a_mixed_step_splits_into_triton_decodes_and_prefill_chunks(monkeypatch, prefill_calls):
    pytest.importorskip("triton")
    from lucebox.kernels import triton_paged_attention as tpa

    q, kc, vc, batch = paged_case("q8_0", torch.float32, [1, 70, 2], [9, 5, 6])
    want = paged_attention_reference(q, kc, vc, batch, 0.2)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    seen = []
    real = tpa.paged_attention
    monkeypatch.setattr(tpa, "paged_attention", lambda q, k, v, b, *a, **kw: seen.append(b.query_lens_host)
                        or real(q, k, v, b, *a, **kw))
    got = paged_attention(q, kc, vc, batch, 0.2)
    assert seen == [[1, 2]] and prefill_calls == [[1]]
    assert max_err(got, want) <= F32_TOL


# ----------------------------------------------------------------------------- through the model

LONG_PROMPTS = [70, 140]


def test_long_prompts_match_transformers_in_one_piece_and_in_chunks(hf_models, prefill_calls):
    """Every family (sliding-window layers included), batched prefill of prompts past MIN_QUERY_LEN,
    then one prompt again in two chunks of 64 and 76 tokens (the second over cached context)."""
    from lucebox.engine.block_manager import BlockManager
    from lucebox.engine.runner import ModelRunner
    from lucebox.model.loader import load_model

    from tests.model.test_model import reference_logits

    assert min(LONG_PROMPTS) >= pa.MIN_QUERY_LEN
    for family, path in hf_models.items():
        loaded = load_model(str(path), dtype="float32")
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in LONG_PROMPTS]
        runner, blocks = ModelRunner(loaded.model, 64, 8), BlockManager(64, 8)
        tables = [[] for _ in prompts]
        for table, prompt in zip(tables, prompts):
            blocks.allocate(table, len(prompt))
        whole = runner.forward(prompts, [0, 0], tables, all_logits=True)
        table: list[int] = []
        blocks.allocate(table, len(prompts[1]))
        chunks = torch.cat([runner.forward([prompts[1][:64]], [0], [table], all_logits=True),
                            runner.forward([prompts[1][64:]], [64], [table], all_logits=True)])
        want = [reference_logits(path, p) for p in prompts]
        assert max_err(whole, torch.cat(want)) <= 1e-4, family
        assert max_err(chunks, want[1]) <= 1e-4, family
    assert prefill_calls and all(prefill_calls)
