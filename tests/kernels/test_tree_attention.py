"""Tree verification's attention layer (DDTree): tree-masked paged attention equals dense masked
SDPA on every path (torch reference, graph-path reference, Triton), -1 masks change nothing, and
KV compaction moves exactly the accepted rows.

On a machine without a GPU the Triton kernel runs under Triton's interpreter (tiny shapes); on a
GPU everything runs on the device (scripts/gpu/tests.sh check-new lists this file)."""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
# Triton's interpreter must be on before Triton loads (see test_triton_kernels.py).
INTERPRETABLE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1" or "triton" not in sys.modules
if not ON_GPU and INTERPRETABLE:
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox.kernels import prefill_attention  # noqa: E402
from lucebox.kernels.attention import paged_attention, paged_attention_reference  # noqa: E402
from lucebox.kernels.forward_batch import MAX_TREE_TOKENS, ForwardBatch, tree_depths, tree_mask_bits  # noqa: E402
from lucebox.kernels.kv_compact import compact_rows, compaction_slots  # noqa: E402
from lucebox.model.kv_cache import PagedKVCache  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
BLOCK, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 32
SCALE = HEAD_DIM ** -0.5
needs_triton = pytest.mark.skipif(not INTERPRETABLE, reason="Triton was imported without its interpreter "
                                                            "on a machine without a GPU")


def random_tree(n: int, rng: random.Random) -> list[int]:
    """Parents of a random tree of n tokens in DFS order (each parent before its children, each
    subtree contiguous): built by a random walk that opens a child of the current path's node."""
    parents, path = [-1], [0]
    for i in range(1, n):
        del path[rng.randint(1, len(path)):]  # climb to a random ancestor (never past the root)
        parents.append(path[-1])
        path.append(i)
    return parents


def ancestors(parents: list[int], i: int) -> set[int]:
    seen = {i}
    while parents[i] >= 0:
        i = parents[i]
        seen.add(i)
    return seen


def make_case(rows, cache_type="f32", seed=0, dtype=torch.float32, window=None, block=BLOCK, heads=HEADS,
              kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    """rows: (context length, q_len, parents or None) per sequence, on shuffled blocks. Every
    position's K/V is written; with `window`, the blocks wholly behind each sequence's window
    (before ctx - window + 1) are then released to a scratch block of NaNs, as the cache manager
    may. Returns (q, k_cache, v_cache, batch with tree masks)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + q) // block) for ctx, q, _ in rows]
    scratch = sum(need)
    perm = torch.randperm(scratch, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    caches = [PagedKVCache(scratch + 1, block, kv_heads, head_dim, cache_type, dtype, DEVICE) for _ in range(2)]
    whole = ForwardBatch.build([[0] * (ctx + q) for ctx, q, _ in rows], [0] * len(rows), tables, block, DEVICE)
    for cache in caches:
        cache.write(torch.randn(whole.num_tokens, kv_heads, head_dim, generator=g).to(DEVICE, dtype),
                    whole.slot_mapping)
    if window is not None:
        for t in (t for cache in caches for t in (cache.values, cache.scales) if t is not None):
            if t.dtype.is_floating_point:  # q8_0 / q4_0: their NaN scales poison the block
                t[scratch] = float("nan")
        tables = [[scratch if (i + 1) * block <= ctx - window + 1 else b for i, b in enumerate(t)]
                  for t, (ctx, _, _) in zip(tables, rows)]
        assert any(scratch in t for t in tables)
    batch = ForwardBatch.build([[0] * q for _, q, _ in rows], [ctx for ctx, _, _ in rows], tables, block, DEVICE,
                               tree_parents=[p for _, _, p in rows])
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=g).to(DEVICE, dtype)
    return q, caches[0], caches[1], batch


def dense_expected(q, k_cache, v_cache, batch, rows, window=None):
    """Each sequence's context (dequantised), a mask written from the parents, plain SDPA. With a
    window, a tree token at depth d sees committed keys k with ctx + d - k < window."""
    heads, head_dim = q.shape[1:]
    group = heads // k_cache.num_kv_heads
    out, start = [], 0
    for i, (ctx, q_len, parents) in enumerate(rows):
        depths = tree_depths(parents) if parents is not None else range(q_len)
        lo = max(0, ctx - window + 1) if window is not None else 0  # released before it
        slots = batch.context_slots(i)[lo:]
        k = k_cache.gather(slots, torch.float32).repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache.gather(slots, torch.float32).repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.zeros(q_len, ctx + q_len, dtype=torch.bool)
        for t in range(q_len):
            mask[t, :ctx] = True if window is None else ctx + depths[t] - torch.arange(ctx) < window
            seen = ancestors(parents, t) if parents is not None else range(t + 1)
            for j in seen:
                mask[t, ctx + j] = True
        qi = q[start:start + q_len].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask[:, lo:].to(q.device), scale=head_dim ** -0.5)
        out.append(o.transpose(0, 1))
        start += q_len
    return torch.cat(out).to(q.dtype)


def mixed_rows(rng: random.Random, tree_len: int = 9):
    """A tree row, a plain decode and a plain verify (contexts not multiples of BLOCK)."""
    return [(11, tree_len, random_tree(tree_len, rng)), (7, 1, None), (9, 5, None)]


def as_device_only(batch: ForwardBatch, q_len: int) -> ForwardBatch:
    return ForwardBatch.from_device(batch.input_ids, batch.positions, batch.seq_lens, batch.block_tables,
                                    batch.slot_mapping, batch.block_size, q_len, tree_mask=batch.tree_mask)


# ------------------------------------------------------------------ masks and the batch builder

def test_tree_mask_bits_and_depths_of_a_hand_built_tree():
    #      0
    #    1   4
    #   2 3   5
    parents = [-1, 0, 1, 1, 0, 4]
    assert tree_mask_bits(parents) == [0b1, 0b11, 0b111, 0b1011, 0b10001, 0b110001]
    assert tree_depths(parents) == [0, 1, 2, 2, 1, 2]
    chain = tree_mask_bits(list(range(-1, MAX_TREE_TOKENS - 1)))
    assert chain[-1] == -1 and chain[-2] == (1 << 63) - 1  # bit 63 is the int64 sign bit
    for bad in ([0, 0], [-1, 1], [-1, 0, 3], list(range(-1, MAX_TREE_TOKENS)), []):
        with pytest.raises(ValueError):
            tree_mask_bits(bad)


def test_build_stores_tree_rows_by_row_index_and_rotates_them_by_depth():
    parents = [-1, 0, 1, 0]
    batch = ForwardBatch.build([[5, 6], [1, 2, 3, 4]], [3, 6], [[0, 1], [2, 3, 4]], BLOCK,
                               tree_parents=[None, parents], group_tables=[[[5, 6], [7, 8, 9]]])
    assert batch.group(1).tree_mask is batch.tree_mask  # a window group's view keeps the masks
    assert batch.positions.tolist() == [3, 4, 6, 7, 8, 7]
    assert batch.slot_mapping.tolist() == [3, 4, 14, 15, 16, 17]  # storage: start + row index
    assert batch.seq_lens.tolist() == [5, 10]
    assert batch.tree_mask.tolist() == [-1, -1, *tree_mask_bits(parents)]
    sub, rows = batch.select([1])
    assert sub.tree_mask.tolist() == tree_mask_bits(parents) and rows.tolist() == [2, 3, 4, 5]
    assert ForwardBatch.build([[1]], [0], [[0]], BLOCK).tree_mask is None


# ------------------------------------------------------------------ torch paths

@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_torch_reference_matches_dense_masked_attention(cache_type, monkeypatch):
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    rows = mixed_rows(random.Random(1))
    q, k, v, batch = make_case(rows, cache_type)
    want = dense_expected(q, k, v, batch, rows)
    torch.testing.assert_close(paged_attention(q, k, v, batch, SCALE), want, rtol=1e-5, atol=1e-5)


def test_a_full_size_tree_row_stays_off_the_prefill_path(monkeypatch):
    """A 64-token tree row is long enough for the prefill path, which knows no tree masks; a long
    ordinary row next to it still takes that path, with its all-ones mask."""
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    rows = [(5, MAX_TREE_TOKENS, random_tree(MAX_TREE_TOKENS, random.Random(2))),
            (3, prefill_attention.MIN_QUERY_LEN + 6, None)]
    q, k, v, batch = make_case(rows)
    assert prefill_attention.prefill_sequences(batch) == [1]
    torch.testing.assert_close(paged_attention(q, k, v, batch, SCALE), dense_expected(q, k, v, batch, rows),
                               rtol=1e-5, atol=1e-5)


def test_device_only_reference_matches_dense_masked_attention(monkeypatch):
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    rng = random.Random(3)
    rows = [(10, 7, random_tree(7, rng)), (6, 7, None), (13, 7, random_tree(7, rng))]
    q, k, v, batch = make_case(rows, "fp8")
    got = paged_attention(q, k, v, as_device_only(batch, 7), SCALE)
    torch.testing.assert_close(got, dense_expected(q, k, v, batch, rows), rtol=1e-5, atol=1e-5)


def test_all_ones_masks_reproduce_plain_attention_bit_for_bit(monkeypatch):
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    rows = [(11, 6, None), (7, 1, None), (9, 5, None)]
    q, k, v, batch = make_case(rows)
    assert batch.tree_mask is None
    plain = paged_attention(q, k, v, batch, SCALE)
    batch.tree_mask = torch.full((batch.num_tokens,), -1, dtype=torch.long, device=DEVICE)
    torch.testing.assert_close(paged_attention_reference(q, k, v, batch, SCALE), plain, rtol=0, atol=0)
    same = [(6, 6, None), (6, 6, None)]
    q, k, v, batch = make_case(same)
    plain = paged_attention(q, k, v, as_device_only(batch, 6), SCALE)
    batch.tree_mask = torch.full((batch.num_tokens,), -1, dtype=torch.long, device=DEVICE)
    torch.testing.assert_close(paged_attention(q, k, v, as_device_only(batch, 6), SCALE), plain, rtol=0, atol=0)


WINDOW = MAX_TREE_TOKENS


def window_rows(rng: random.Random, q_len: int = 7):
    """Contexts past the window: a tree row, an ordinary verify row, another tree row."""
    return [(WINDOW + 13, q_len, random_tree(q_len, rng)), (WINDOW + 5, q_len, None),
            (WINDOW + 20, q_len, random_tree(q_len, rng))]


def test_sliding_windows_measure_a_tree_token_from_its_depth(monkeypatch):
    """A node at depth d sees the committed keys a chain token at position start + d would see;
    the blocks behind every window are released (NaN) and never read."""
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    rows = window_rows(random.Random(9))
    assert any(d < i for d, i in zip(tree_depths(rows[0][2]), range(7)))  # the window bites differently
    q, k, v, batch = make_case(rows, window=WINDOW)
    want = dense_expected(q, k, v, batch, rows, WINDOW)
    torch.testing.assert_close(paged_attention(q, k, v, batch, SCALE, WINDOW), want, rtol=1e-5, atol=1e-5)
    got = paged_attention(q, k, v, as_device_only(batch, 7), SCALE, WINDOW)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tree_masks_on_windows_shorter_than_a_tree_row_are_refused(monkeypatch):
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    rows = mixed_rows(random.Random(4))
    q, k, v, batch = make_case(rows)
    with pytest.raises(ValueError, match="window of at least"):
        paged_attention(q, k, v, batch, SCALE, sliding_window=MAX_TREE_TOKENS - 1)


# ------------------------------------------------------------------ KV compaction

@pytest.mark.parametrize("cache_type", ["f32", "bf16", "fp8", "q8_0", "q4_0"])
def test_compaction_moves_exactly_the_accepted_rows(cache_type):
    g = torch.Generator().manual_seed(5)
    tables, starts = [[3, 0, 5], [1, 4, 2]], [2, 5]
    accepted = [[0, 2, 3, 6], [0, 1, 4]]  # sequence 1's rows 0, 1 are already in place
    caches = [PagedKVCache(6, BLOCK, KV_HEADS, HEAD_DIM, cache_type, torch.float32, DEVICE) for _ in range(2)]
    for cache in caches:
        cache.write(torch.randn(6 * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(DEVICE),
                    torch.arange(6 * BLOCK, device=DEVICE))
    before = [(c.values.clone(), None if c.scales is None else c.scales.clone()) for c in caches]
    src, dst = compaction_slots(tables, BLOCK, starts, accepted, DEVICE)

    def slot(b, pos):
        return tables[b][pos // BLOCK] * BLOCK + pos % BLOCK

    moves = {slot(b, starts[b] + k): slot(b, starts[b] + row)
             for b in range(2) for k, row in enumerate(accepted[b]) if row != k}
    assert dict(zip(dst.tolist(), src.tolist())) == moves and len(moves) == 4
    compact_rows([*caches, caches[0]], src, dst)  # a cache listed twice moves once
    for cache, (values, scales) in zip(caches, before):
        for now, old in ((cache.values, values), (cache.scales, scales)):
            if old is None:
                continue
            flat_now, flat_old = now.flatten(0, 1), old.flatten(0, 1)
            for s in range(6 * BLOCK):
                want = flat_old[moves.get(s, s)]
                assert torch.equal(flat_now[s].view(torch.uint8), want.view(torch.uint8)), (cache_type, s)


def test_compaction_rejects_a_path_not_starting_at_the_pending_token():
    with pytest.raises(ValueError, match="row 0"):
        compaction_slots([[0, 1]], BLOCK, [0], [[1, 2]])
    with pytest.raises(ValueError, match="increase"):
        compaction_slots([[0, 1]], BLOCK, [0], [[0, 2, 1]])


def test_compacted_tree_attends_like_the_chain_of_its_accepted_path(monkeypatch):
    """After compaction the accepted path's K/V sit where a chain verify would have put them: a
    decode step after it sees the same keys as one after verifying that chain."""
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    parents = [-1, 0, 1, 0, 3, 4]  # accepted path 0 -> 3 -> 4
    rows = [(6, 6, parents)]
    _, k, v, batch = make_case(rows)
    table = batch.block_tables[0].tolist()
    want_k = k.gather(batch.context_slots(0)[[0, 1, 2, 3, 4, 5, 6, 9, 10]], torch.float32)
    src, dst = compaction_slots([table], BLOCK, [6], [[0, 3, 4]], DEVICE)
    compact_rows([k, v], src, dst)
    torch.testing.assert_close(k.gather(batch.context_slots(0)[:9], torch.float32), want_k, rtol=0, atol=0)


# ------------------------------------------------------------------ Triton kernel

@needs_triton
@pytest.mark.parametrize("cache_type,splits", [("f32", 1), ("q8_0", 2)])
def test_triton_kernel_matches_dense_masked_attention(cache_type, splits):
    pytest.importorskip("triton")
    from lucebox.kernels import triton_paged_attention as tpa

    rows = mixed_rows(random.Random(6), tree_len=7)
    q, k, v, batch = make_case(rows, cache_type)
    got = tpa.paged_attention(q, k, v, batch, SCALE, num_splits=splits, block_kv=16)
    torch.testing.assert_close(got, dense_expected(q, k, v, batch, rows), rtol=1e-4, atol=1e-4)


@needs_triton
def test_triton_kernel_graph_mode_tree_rows():
    pytest.importorskip("triton")
    from lucebox.kernels import triton_paged_attention as tpa

    rng = random.Random(7)
    rows = [(9, 6, random_tree(6, rng)), (5, 6, None)]
    q, k, v, batch = make_case(rows, "fp8")
    got = tpa.paged_attention(q, k, v, as_device_only(batch, 6), SCALE, block_kv=16)
    torch.testing.assert_close(got, dense_expected(q, k, v, batch, rows), rtol=1e-4, atol=1e-4)


@needs_triton
def test_triton_kernel_all_ones_masks_change_nothing():
    pytest.importorskip("triton")
    from lucebox.kernels import triton_paged_attention as tpa

    rows = [(11, 6, None), (7, 1, None)]
    q, k, v, batch = make_case(rows)
    plain = tpa.paged_attention(q, k, v, batch, SCALE, block_kv=16)
    batch.tree_mask = torch.full((batch.num_tokens,), -1, dtype=torch.long, device=DEVICE)
    torch.testing.assert_close(tpa.paged_attention(q, k, v, batch, SCALE, block_kv=16), plain, rtol=0, atol=0)


@needs_triton
def test_dispatch_splits_a_step_between_prefill_and_the_tree_masked_kernel(monkeypatch):
    """A full-size tree row goes to the Triton kernel (with its masks, through ForwardBatch.select)
    while the long ordinary row of the same step takes the prefill path."""
    pytest.importorskip("triton")
    from lucebox.kernels import triton_paged_attention as tpa

    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    calls = []
    kernel = tpa.paged_attention
    monkeypatch.setattr(tpa, "paged_attention", lambda q, *a, **kw: calls.append(q.shape[0]) or kernel(q, *a, **kw))
    rows = [(3, MAX_TREE_TOKENS, random_tree(MAX_TREE_TOKENS, random.Random(8))), (2, 1, None),
            (1, prefill_attention.MIN_QUERY_LEN + 2, None)]
    q, k, v, batch = make_case(rows)
    got = paged_attention(q, k, v, batch, SCALE)
    assert calls == [MAX_TREE_TOKENS + 1]
    torch.testing.assert_close(got, dense_expected(q, k, v, batch, rows), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("graph", [False, True])
def test_triton_kernel_sliding_window_tree_rows(graph):
    pytest.importorskip("triton")
    from lucebox.kernels import triton_paged_attention as tpa

    rows = window_rows(random.Random(10), q_len=5)
    q, k, v, batch = make_case(rows, window=WINDOW)
    run = as_device_only(batch, 5) if graph else batch
    got = tpa.paged_attention(q, k, v, run, SCALE, WINDOW, num_splits=2, block_kv=16)
    torch.testing.assert_close(got, dense_expected(q, k, v, batch, rows, WINDOW), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="model-sized shapes: compiled kernels on a GPU")
@pytest.mark.parametrize("cache_type", ["bf16", "fp8", "q4_0"])
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_tree_verify_at_model_sizes(cache_type, window):
    """qwen3-8b's attention geometry in bf16: 32- and 64-node trees next to a decode and a chain
    verify, long contexts (split-K), through the dispatcher (the Triton kernel on a GPU)."""
    rng = random.Random(11)
    rows = [(1500, 32, random_tree(32, rng)), (3000, 1, None), (2200, 16, None),
            (2900, MAX_TREE_TOKENS, random_tree(MAX_TREE_TOKENS, rng))]
    dims = {"block": 16, "heads": 32, "kv_heads": 8, "head_dim": 128}
    q, k, v, batch = make_case(rows, cache_type, dtype=torch.bfloat16, window=window, **dims)
    got = paged_attention(q, k, v, batch, 128 ** -0.5, window)
    torch.testing.assert_close(got, dense_expected(q, k, v, batch, rows, window), rtol=2e-2, atol=2e-2)
    same = [(1500, 32, random_tree(32, rng)), (2500, 32, None), (700, 32, random_tree(32, rng))]
    q, k, v, batch = make_case(same, cache_type, dtype=torch.bfloat16, window=window, **dims)
    got = paged_attention(q, k, v, as_device_only(batch, 32), 128 ** -0.5, window)
    torch.testing.assert_close(got, dense_expected(q, k, v, batch, same, window), rtol=2e-2, atol=2e-2)
