"""The cache seam: layer state specs and their byte figures, and the cache manager's grow, commit
(window release), rollback, free and recurrent snapshot/restore."""
from __future__ import annotations

import pytest
import torch

from lucebox.engine.cache_manager import CacheManager
from lucebox.engine.sequence import Sequence
from lucebox.model.cache_spec import (PagedKVSpec, RecurrentSpec, bytes_per_sequence, bytes_per_token,
                                      kv_bytes_per_token, release_window)
from lucebox.model.config import ModelConfig
from lucebox.model.kv_cache import bytes_per_value
from lucebox.model.recurrent_state import RecurrentState
from lucebox.model.transformer import Transformer
from lucebox.sampling import SamplingParams

BLOCK = 4
H, D = 2, 32


def windowed(window: int | None = 8) -> PagedKVSpec:
    return PagedKVSpec.of(H, D, torch.float32, window=window)


def seq_of(n: int, start: int = 0) -> Sequence:
    return Sequence("r", 0, list(range(start, start + n)), SamplingParams())


def computed(cache: CacheManager, seq: Sequence, n: int) -> None:
    """seq's K/V up to n tokens written, as a step would: room, then the commit."""
    cache.grow(seq, n)
    seq.num_computed = n
    cache.commit(seq)


@pytest.mark.parametrize("k_type,v_type", [("auto", "auto"), ("fp8", "q8_0"), ("q4_0", "f16"), ("bf16", "q4_0")])
def test_model_bytes_per_token_are_its_layers_k_and_v(k_type, v_type):
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=32, sliding_windows=[None, 5, None])
    model = Transformer(cfg)
    k = bytes_per_value("f32" if k_type == "auto" else k_type, 32)
    v = bytes_per_value("f32" if v_type == "auto" else v_type, 32)
    assert kv_bytes_per_token(model, k_type, v_type) == round(3 * 2 * 32 * (k + v))
    specs = model.cache_specs(k_type, v_type)
    assert [s.window for s in specs] == [None, 5, None]
    assert bytes_per_sequence(specs, snapshots=4) == 0


def test_recurrent_state_costs_bytes_per_sequence_not_per_token():
    spec = RecurrentSpec((2, 4, 4), (8, 3), torch.float16)
    assert bytes_per_token([spec, windowed()]) == 2 * H * D * 4
    assert spec.bytes_per_sequence() == (32 + 24) * 2
    assert bytes_per_sequence([spec, windowed()], snapshots=3) == (32 + 24) * 2 * 4


def test_release_needs_every_paged_cache_bounded():
    assert release_window([windowed(8), windowed(12)]) == 12  # the widest window keeps what any layer reads
    assert release_window([windowed(8), windowed(None)]) is None  # mixed: a full layer reads everything
    assert release_window([windowed(None)]) is None
    assert release_window([RecurrentSpec((2,), (2,), torch.float32)]) is None
    # a proposer's unbounded cache on the target's tables keeps everything too
    assert CacheManager([windowed(8), windowed(None)], 16, BLOCK).release_window is None


def test_commit_releases_blocks_behind_the_window_and_keeps_the_table_shape():
    cache = CacheManager([windowed(8)] * 2, 32, BLOCK)
    seq = seq_of(30)
    cache.admit(seq, [])
    computed(cache, seq, 30)
    # the next position (30) reads keys 23..30: blocks 0..4 (positions 0..19) are out of reach
    released = cache.blocks.released
    assert len(seq.block_table) == 8
    assert seq.block_table[:5] == [released] * 5 and released not in seq.block_table[5:]
    assert cache.held_blocks(seq) == 3 and cache.blocks.num_free_blocks == 32 - 3
    computed(cache, seq, 31)  # position 31 reads 24..31: block 5 goes too
    assert seq.block_table[5] == released and cache.held_blocks(seq) == 2


def test_a_long_generation_holds_a_window_of_blocks():
    window = 10
    cache = CacheManager([windowed(window)], 64, BLOCK)
    seq = seq_of(5)
    cache.admit(seq, [])
    computed(cache, seq, 5)
    for n in range(6, 200):
        cache.grow(seq, n)  # the step's new token
        assert cache.held_blocks(seq) <= -(-window // BLOCK) + 1
        seq.num_computed = n
        cache.commit(seq)
    assert len(seq.block_table) == 50


def test_without_release_every_block_is_kept():
    cache = CacheManager([windowed(8), windowed(None)], 32, BLOCK)
    seq = seq_of(30)
    cache.admit(seq, [])
    computed(cache, seq, 30)
    assert cache.held_blocks(seq) == 8 and cache.blocks.released not in seq.block_table


def test_rollback_drops_rejected_tail_blocks_only():
    cache = CacheManager([windowed(8)], 32, BLOCK)
    seq = seq_of(30)
    cache.admit(seq, [])
    computed(cache, seq, 30)
    cache.grow(seq, 30 + 1 + 7)  # a verify of the pending token and 7 drafts: positions 30..37
    assert len(seq.block_table) == 10
    seq.num_computed = 30 + 1 + 1  # one draft accepted
    cache.commit(seq)
    cache.rollback(seq, seq.num_computed + 1, accepted=1)
    assert len(seq.block_table) == 9  # positions 0..32
    assert seq.block_table[:6] == [cache.blocks.released] * 6
    assert cache.held_blocks(seq) == 3 and cache.blocks.num_free_blocks == 32 - 3


def test_free_returns_every_held_block_once():
    cache = CacheManager([windowed(8)], 32, BLOCK)
    seq = seq_of(30)
    cache.admit(seq, [])
    computed(cache, seq, 30)
    cache.free(seq)
    assert seq.block_table == [] and cache.blocks.num_free_blocks == 32
    assert all(b.ref_count == 0 for b in cache.blocks.blocks)


def test_released_blocks_stay_in_the_prefix_cache_and_are_shared_again():
    cache = CacheManager([windowed(8)], 32, BLOCK)
    first = seq_of(30)
    cache.admit(first, [])
    cache.grow(first, 30)
    original = list(first.block_table)
    first.num_computed = 30
    cache.commit(first)
    assert first.block_table[0] == cache.blocks.released
    second = seq_of(30)
    found = cache.match_prefix(second.token_ids)
    assert found == original[:7]  # released blocks 0..4 still hold their K/V, findable
    assert cache.can_admit(found, 30)
    cache.admit(second, found)
    assert cache.held_blocks(second) == 7
    cache.free(first)
    cache.free(second)
    assert cache.blocks.num_free_blocks == 32


def test_recurrent_rollback_restores_the_state_after_the_last_accepted_draft():
    spec = RecurrentSpec((2, 3), (4, 2), torch.float32)
    cache = CacheManager([spec, windowed(None)], 32, BLOCK, num_slots=2, snapshots=5)
    (state,) = cache.build_recurrent("cpu")
    assert state.state.shape == (2, 2, 3) and state.snap_conv.shape == (2, 5, 4, 2)
    a, b = seq_of(6), seq_of(6, start=100)
    cache.admit(a, [])
    cache.admit(b, [])
    assert cache.slot(a) != cache.slot(b) and not cache.can_admit([], 4)
    slot = torch.tensor([cache.slot(a)])
    other = torch.tensor([cache.slot(b)])
    state.state[other], state.conv[other] = 7.0, 7.0
    for i in range(5):  # the state after each verified position: i + 1 everywhere
        state.state[slot], state.conv[slot] = float(i + 1), -float(i + 1)
        state.snapshot(slot, i)
    cache.grow(a, 6 + 5)
    a.num_computed = 6 + 1 + 2
    cache.rollback(a, a.num_computed + 1, accepted=2)
    assert torch.all(state.state[slot] == 3.0) and torch.all(state.conv[slot] == -3.0)
    assert torch.all(state.state[other] == 7.0)  # other sequences untouched
    cache.free(a)
    c = seq_of(6, start=200)
    assert cache.can_admit([], 6)
    cache.admit(c, [])
    assert cache.slot(c) == slot.item()
    assert torch.all(state.state[slot] == 0) and torch.all(state.conv[slot] == 0)  # a new sequence starts clean


def test_recurrent_state_disables_prefix_sharing():
    cache = CacheManager([RecurrentSpec((2,), (2,), torch.float32), windowed(None)], 32, BLOCK, num_slots=1)
    seq = seq_of(30)
    cache.admit(seq, [])
    computed(cache, seq, 30)
    assert cache.match_prefix(seq_of(30).token_ids) == []


def test_recurrent_state_copies_slots():
    state = RecurrentState(3, 2, (2,), (3,), torch.float32, "cpu")
    state.state[0], state.conv[0] = 1.0, 2.0
    state.copy(torch.tensor([0]), torch.tensor([2]))
    assert torch.all(state.state[2] == 1.0) and torch.all(state.conv[2] == 2.0)
    state.reset(torch.tensor([2]))
    assert torch.all(state.state[2] == 0) and torch.all(state.state[0] == 1.0)
