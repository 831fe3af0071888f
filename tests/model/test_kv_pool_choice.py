"""KVFlash's pieces on their own: the compact view of resident blocks, the choice of resident chunks (protection,
budget, ranking, recency) and the chunk scores (against a brute-force cosine)."""
from __future__ import annotations

import pytest
import torch

from lucebox.model.kv_pool.choose import Protection, choose_chunks
from lucebox.model.kv_pool.score import ChunkSummaries, chunk_bounds
from lucebox.model.kv_pool.view import KVView


def test_the_view_lists_resident_entries_in_order_and_maps_positions_to_storage():
    view = KVView(selected=(0, 3, 4), tail_from=7, block_size=16)
    table = list(range(100, 110))
    assert view.table(table) == [100, 103, 104, 107, 108, 109]
    assert view.blocks(10) == [0, 3, 4, 7, 8, 9]
    assert view.storage(3 * 16 + 1) == 16 + 1  # block 3 is the view's second entry
    assert view.storage(7 * 16 + 5) == 3 * 16 + 5  # the tail starts after the three selected blocks
    assert view.shift == (7 - 3) * 16 and not view.is_identity
    with pytest.raises(ValueError, match="block 2"):
        view.storage(2 * 16)
    assert KVView.identity(16).storage(77) == 77 and KVView.identity(16).is_identity


def test_sinks_and_tail_are_kept_and_the_best_scores_fill_the_rest():
    protection = Protection(sink_chunks=1, tail_chunks=4)
    scores = torch.zeros(20)
    scores[[3, 9, 12]] = torch.tensor([0.9, 0.5, 0.7])
    chosen, tail = choose_chunks(20, 8, protection, scores)
    assert tail == 15  # the last chunk (partial) and the four before it
    assert chosen == [0, 3, 12]  # the sink, then the two best of 1..14
    assert len(chosen) + 20 - tail == 8


def test_without_scores_the_chunks_nearest_the_tail_stay():
    chosen, tail = choose_chunks(20, 8, Protection(1, 4))
    assert (chosen, tail) == ([0, 13, 14], 15)


def test_ties_keep_the_more_recent_chunk():
    chosen, _ = choose_chunks(20, 7, Protection(1, 4), torch.ones(20))
    assert chosen == [0, 14]


def test_a_short_sequence_keeps_everything():
    for n in range(1, 9):
        chosen, tail = choose_chunks(n, 8, Protection(1, 4), torch.rand(n))
        assert sorted(chosen + list(range(tail, n))) == list(range(n))


def test_a_pool_smaller_than_its_protections_is_refused():
    with pytest.raises(ValueError, match="smaller than the sinks, tail and one chosen chunk"):
        choose_chunks(20, 6, Protection(1, 4))


def test_scores_are_the_layer_mean_of_the_standardised_best_head_bound():
    torch.manual_seed(0)
    layers, kv_heads, group, dim, tokens = 3, 2, 2, 8, 64
    chunks = [[torch.randn(tokens, kv_heads, dim) for _ in range(layers)] for _ in range(5)]
    summaries = ChunkSummaries(dtype=torch.float32)
    summaries.extend([chunk_bounds(torch.stack([c[layer] for c in chunks[:2]])) for layer in range(layers)])
    for keys in chunks[2:]:  # batches of any size append alike
        summaries.extend([chunk_bounds(k[None]) for k in keys])
    q = torch.randn(layers, kv_heads * group, dim)  # per layer [heads, dim]
    per_layer = torch.zeros(layers, len(chunks))
    for c, keys in enumerate(chunks):
        for layer in range(layers):
            low, high = keys[layer].amin(0), keys[layer].amax(0)  # [kv_heads, dim]
            bounds = [torch.maximum(q[layer, h] * low[h // group], q[layer, h] * high[h // group]).sum()
                      for h in range(kv_heads * group)]
            per_layer[layer, c] = max(bounds)
            # the bound holds: no key of the chunk reaches past it
            assert (keys[layer][:, 0] @ q[layer, 0]).max() <= bounds[0] + 1e-5
    z = (per_layer - per_layer.mean(1, keepdim=True)) / per_layer.std(1, keepdim=True)
    assert summaries.scores(list(q)) == pytest.approx(z.mean(0), abs=1e-4)


def test_a_chunk_holding_a_key_aligned_with_the_query_ranks_first():
    torch.manual_seed(1)
    q = torch.randn(4, 16)
    summaries = ChunkSummaries(dtype=torch.float32)
    for c in range(8):
        keys = torch.randn(64, 2, 16) * 0.3
        if c == 5:
            keys[17, 0] = q[0] * 2  # one token matching query head 0 (KV head 0)
        summaries.extend([chunk_bounds(keys[None])])
    assert int(summaries.scores([q]).argmax()) == 5


def test_summaries_grow_past_their_first_buffer():
    summaries = ChunkSummaries()
    for i in range(40):
        summaries.extend([torch.full((1, 2, 1, 4), float(i)), torch.full((1, 2, 2, 8), -float(i))])
    summaries.extend([torch.arange(40, 140.).view(100, 1, 1, 1).expand(100, 2, 1, 4),
                      torch.zeros(100, 2, 2, 8)])  # one batch past twice the buffer
    assert summaries.count == 140 and summaries.buffers[0][39, 0, 0, 0] == 39 and summaries.buffers[1][39, 1, 1, 7] == -39
    assert summaries.buffers[0][:140, 1, 0, 3].tolist() == list(range(140))


def test_layers_of_different_head_shapes_are_scored_each_on_its_own():
    summaries = ChunkSummaries(dtype=torch.float32)
    for _ in range(3):
        summaries.extend([chunk_bounds(torch.randn(1, 64, 1, 8)), chunk_bounds(torch.randn(1, 64, 2, 16))])
    scores = summaries.scores([torch.randn(4, 8), torch.randn(6, 16)])
    assert scores.shape == (3,) and torch.isfinite(scores).all()
