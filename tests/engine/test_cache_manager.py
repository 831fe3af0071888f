"""The cache seam: layer state specs and their byte figures, and the cache manager's grow, commit
(window release), rollback, free and the recurrent commit after a verify."""
from __future__ import annotations

import pytest
import torch

from lucebox.engine.cache_manager import CacheManager
from lucebox.engine.sequence import Sequence
from lucebox.kernels.gated_delta import recurrent_gated_delta_rule
from lucebox.model.cache_spec import (
    PagedKVSpec,
    RecurrentSpec,
    bytes_per_sequence,
    bytes_per_token,
    kv_bytes_per_token,
    release_window,
)
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
    assert bytes_per_sequence(specs, positions=4) == 0


def test_recurrent_state_costs_bytes_per_sequence_not_per_token():
    spec = RecurrentSpec((2, 4, 4), (8, 3), 1, torch.float16)
    assert bytes_per_token([spec, windowed()]) == 2 * H * D * 4
    assert spec.bytes_per_sequence() == (32 + 24) * 2
    # a stashed verify position: the conv's raw input and output (8 each), g and beta (2 each)
    assert bytes_per_sequence([spec, windowed()], positions=3) == (32 + 24 + 3 * (8 + 8 + 2 + 2)) * 2


def test_qwen36_27b_stash_is_far_smaller_than_state_snapshots():
    """The memory plan of the real shape: 1 + 15 stashed positions cost < 45% of one state more
    (16 state snapshots cost 16 states)."""
    spec = RecurrentSpec((48, 128, 128), (2 * 16 * 128 + 48 * 128, 3), 16, torch.float32)
    state = 48 * 128 * 128 * 4
    extra = spec.bytes_per_sequence(16) - spec.bytes_per_sequence(0)
    assert extra == 16 * (2 * 10240 + 2 * 48) * 4 and extra < 0.45 * state


def test_release_needs_every_paged_cache_bounded():
    assert release_window([windowed(8), windowed(12)]) == 12  # the widest window keeps what any layer reads
    assert release_window([windowed(8), windowed(None)]) is None  # mixed: a full layer reads everything
    assert release_window([windowed(None)]) is None
    assert release_window([RecurrentSpec((2, 1, 1), (2, 1), 1, torch.float32)]) is None
    # a proposer's unbounded cache on the target's tables keeps everything too
    assert CacheManager([windowed(8), windowed(None)], 16, BLOCK).release_window is None  # the primary group's


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


def test_mixed_windows_keep_every_full_block_and_a_window_of_sliding_ones():
    cache = CacheManager([windowed(8), windowed(None)], 32, BLOCK)
    seq = seq_of(30)
    cache.admit(seq, [])
    computed(cache, seq, 30)
    # the full layer's group keeps all 8 blocks; the window group keeps blocks 5..7 (keys 23..29)
    assert cache.held_by_group(seq) == [8, 3] and cache.blocks.released not in seq.block_table
    assert seq.window_tables[0][:5] == [cache.window_pools[0].released] * 5


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


def test_growth_of_several_sequences_is_checked_against_the_pools_together():
    """A decode step launched ahead grows every row at once: each fitting alone is not enough."""
    cache = CacheManager([windowed(None), windowed(6)], [3, 6], BLOCK)
    a, b = seq_of(4), seq_of(4, start=50)
    for seq in (a, b):
        cache.admit(seq, [])
        computed(cache, seq, 4)  # one full block of the primary pool each: one left
    assert cache.can_grow(a, 5) and cache.can_grow(b, 5)
    assert not cache.can_grow_together([(a, 5), (b, 5)])
    assert cache.can_grow_together([(a, 5), (b, 4)])
    cache.grow(a, 5)
    assert not cache.can_grow_together([(b, 5)])


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


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_recurrent_rollback_advances_over_the_accepted_stashed_tokens(accepted):
    """A verify of 5 tokens stashed its inputs; the rollback with `accepted` advances the state over
    the first accepted + 1 of them (the reference rule) and slides the conv window to end there."""
    v_heads, k_heads, dk, dv, width = 4, 2, 3, 5, 3
    channels = 2 * k_heads * dk + v_heads * dv
    spec = RecurrentSpec((v_heads, dk, dv), (channels, width), k_heads, torch.float32)
    cache = CacheManager([spec, windowed(None)], 32, BLOCK, num_slots=2, verify_positions=5)
    (state,) = cache.build_recurrent("cpu")
    assert state.state.shape == (3, v_heads, dk, dv) and state.scratch == 2  # 2 slots and the scratch slot
    a, b = seq_of(6), seq_of(6, start=100)
    cache.admit(a, [])
    cache.admit(b, [])
    assert cache.slot(a) != cache.slot(b) and not cache.can_admit([], 4)
    slot, other = cache.slot(a), cache.slot(b)
    g = torch.Generator().manual_seed(accepted)
    start_state = torch.randn(v_heads, dk, dv, generator=g)
    start_window = torch.randn(channels, width, generator=g)
    state.state[slot], state.conv[slot] = start_state, start_window
    state.state[other], state.conv[other] = 7.0, 7.0
    raw = torch.randn(5, channels, generator=g)
    key_dim = k_heads * dk
    mixed = torch.randn(5, 2 * key_dim + v_heads * dv, generator=g)  # the conv's output: q | k | v
    gate, beta = -torch.rand(5, v_heads, generator=g), torch.rand(5, v_heads, generator=g)
    rows = slot * 5 + torch.arange(5)
    state.stash_raw[rows], state.stash_mixed[rows] = raw, mixed
    state.stash_g[rows], state.stash_beta[rows] = gate, beta
    k = torch.nn.functional.normalize(mixed[:, key_dim:2 * key_dim].view(5, k_heads, dk), dim=-1, eps=1e-12)
    v = mixed[:, 2 * key_dim:].view(5, v_heads, dv)
    cache.grow(a, 6 + 5)
    a.num_computed = 6 + 1 + accepted
    cache.rollback(a, a.num_computed + 1, accepted=accepted)
    n = accepted + 1
    heads_k = k[:n].repeat_interleave(v_heads // k_heads, dim=1).transpose(0, 1)
    _, want = recurrent_gated_delta_rule(heads_k, heads_k, v[:n].transpose(0, 1), gate[:n].t(), beta[:n].t(),
                                         start_state)
    assert torch.allclose(state.state[slot], want, atol=1e-5)
    assert torch.equal(state.conv[slot], torch.cat([start_window, raw[:n].t()], dim=1)[:, -width:])
    assert torch.all(state.state[other] == 7.0) and torch.all(state.conv[other] == 7.0)  # others untouched
    cache.free(a)
    c = seq_of(6, start=200)
    assert cache.can_admit([], 6)
    cache.admit(c, [])
    assert cache.slot(c) == slot
    assert torch.all(state.state[slot] == 0) and torch.all(state.conv[slot] == 0)  # a new sequence starts clean


def test_recurrent_state_disables_prefix_sharing():
    cache = CacheManager([RecurrentSpec((2, 1, 1), (2, 1), 1, torch.float32), windowed(None)], 32, BLOCK, num_slots=1)
    seq = seq_of(30)
    cache.admit(seq, [])
    computed(cache, seq, 30)
    assert cache.match_prefix(seq_of(30).token_ids) == []


def test_recurrent_state_copies_slots():
    state = RecurrentState(3, 2, (2, 1, 1), (3, 1), 1, torch.float32, "cpu")
    state.state[0], state.conv[0] = 1.0, 2.0
    state.copy(torch.tensor([0]), torch.tensor([2]))
    assert torch.all(state.state[2] == 1.0) and torch.all(state.conv[2] == 2.0)
    state.reset(torch.tensor([2]))
    assert torch.all(state.state[2] == 0) and torch.all(state.state[0] == 1.0)


def test_rollbacks_of_a_step_commit_recurrent_state_together_at_the_end():
    """commits_batched: each verify's rollback is applied when the block ends, all slots at once,
    with what one rollback at a time gives."""
    spec = RecurrentSpec((2, 3, 4), (2 * 3 + 2 * 4, 2), 1, torch.float32)

    def run(batched: bool):
        cache = CacheManager([spec, windowed(None)], 32, BLOCK, num_slots=3, verify_positions=3)
        (state,) = cache.build_recurrent("cpu")
        g = torch.Generator().manual_seed(0)
        for name in ("state", "conv", "stash_raw", "stash_mixed", "stash_beta"):
            getattr(state, name).copy_(torch.randn(getattr(state, name).shape, generator=g))
        state.stash_g.copy_(-torch.rand(state.stash_g.shape, generator=g))
        seqs = [seq_of(6, start=100 * i) for i in range(3)]
        for seq in seqs:
            cache.admit(seq, [])
            cache.grow(seq, 9)
        before = state.state.clone()
        if batched:
            with cache.commits_batched():
                cache.rollback(seqs[0], 8, accepted=1)
                cache.rollback(seqs[2], 7, accepted=0)
                assert torch.equal(state.state, before)  # nothing applied inside the block
        else:
            cache.rollback(seqs[0], 8, accepted=1)
            cache.rollback(seqs[2], 7, accepted=0)
        return state, [cache.slot(s) for s in seqs], before

    one_by_one, slots, before = run(False)
    together, _, _ = run(True)
    assert torch.equal(together.state, one_by_one.state) and torch.equal(together.conv, one_by_one.conv)
    changed = [not torch.equal(together.state[s], before[s]) for s in slots]
    assert changed == [True, False, True]  # the verified sequences advanced, the other did not


def test_layers_of_one_shape_share_a_pool_and_commit_together():
    """The cache manager keeps same-shaped recurrent layers in one pool (per-layer views); a commit
    over the pool equals each layer's own commit, and the layers stay apart."""
    spec = RecurrentSpec((2, 3, 4), (2 * 3 + 2 * 4, 2), 1, torch.float32)
    cache = CacheManager([spec, windowed(None), spec], 32, BLOCK, num_slots=2, verify_positions=3)
    states = cache.build_recurrent("cpu")
    assert len(states) == 2 and len(cache.pools) == 1 and cache.pools[0].layers == 2
    alone = [spec.build(2, 3, "cpu") for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    for pooled, single in zip(states, alone):
        for name in ("state", "conv", "stash_raw", "stash_mixed", "stash_beta", "stash_g"):
            value = torch.randn(getattr(single, name).shape, generator=g)
            value = -value.abs() if name == "stash_g" else value
            getattr(pooled, name).copy_(value)
            getattr(single, name).copy_(value)
    assert not torch.equal(states[0].state, states[1].state)
    slots, accepted = torch.tensor([1, 0]), torch.tensor([2, 0])
    cache.pools[0].commit(slots, accepted)
    for pooled, single in zip(states, alone):
        single.commit(slots, accepted)
        assert torch.equal(pooled.state, single.state) and torch.equal(pooled.conv, single.conv)
    seq = seq_of(4)
    cache.admit(seq, [])  # a new sequence's slot is zeroed in every layer's view of the pool
    assert all(torch.all(s.state[cache.slot(seq)] == 0) for s in states)
