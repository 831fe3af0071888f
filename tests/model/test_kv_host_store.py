"""HostKVStore: whole KV blocks round-trip device -> host -> device bit for bit, for every cache type."""
from __future__ import annotations

import pytest
import torch

from lucebox.errors import HostKVFullError, OverloadError
from lucebox.model.kv_cache import PagedKVCache
from lucebox.model.kv_pool.host_store import HostKVStore

NUM_BLOCKS, BLOCK = 8, 4
TYPES = ("f32", "f16", "bf16", "fp8", "q8_0", "q4_0")


def cache(cache_type: str, rotate: bool = False, heads: int = 2, head_dim: int = 64, device: str = "cpu"
          ) -> PagedKVCache:
    return PagedKVCache(NUM_BLOCKS, BLOCK, heads, head_dim, cache_type, torch.float32, device, rotate=rotate)


def fill(caches: list[PagedKVCache], seed: int) -> None:
    """Random keys written through every slot of every cache (with outlier channels, as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        x = torch.randn(NUM_BLOCKS * BLOCK, c.num_kv_heads, c.head_dim, generator=g)
        x[..., :3] *= 30
        c.write(x.to(c.values.device), torch.arange(NUM_BLOCKS * BLOCK, device=c.values.device))


def block_bytes(t: torch.Tensor | None, blocks: list[int]) -> torch.Tensor | None:
    return None if t is None else t.view(t.shape[0], -1).view(torch.uint8)[blocks].cpu()


def slots(blocks: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([b * BLOCK + o for b in blocks for o in range(BLOCK)], device=device)


def snapshot(c: PagedKVCache, blocks: list[int]) -> tuple:
    gathered = c.gather(slots(blocks, c.values.device), torch.float32).cpu()
    return block_bytes(c.values, blocks), block_bytes(c.scales, blocks), gathered


def assert_same(got: tuple, want: tuple) -> None:
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def round_trip(caches: list[PagedKVCache], saved: list[int], loaded_into: list[int]) -> HostKVStore:
    """Save `saved`, overwrite every block with other data, load back into `loaded_into`; assert exactness."""
    fill(caches, seed=1)
    want = [snapshot(c, saved) for c in caches]
    store = HostKVStore(caches, num_host_blocks=6)
    host = store.allocate(len(saved))
    store.save(saved, host)
    store.fence()
    store.synchronize()
    for c, (values, scales, _) in zip(caches, want):  # the host mirrors hold the blocks as they were
        mirror_values, mirror_scales = store.mirror(c)
        assert_same((block_bytes(mirror_values, host), block_bytes(mirror_scales, host)), (values, scales))
    fill(caches, seed=2)
    untouched = [b for b in range(NUM_BLOCKS) if b not in loaded_into]
    others = [snapshot(c, untouched) for c in caches]
    assert not torch.equal(snapshot(caches[0], saved)[0], want[0][0])  # the overwrite changed the blocks
    store.load(host, loaded_into)
    store.synchronize()
    for c, w, other in zip(caches, want, others):
        assert_same(snapshot(c, loaded_into), w)
        assert_same(snapshot(c, untouched), other)  # nothing else was written
    return store


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("cache_type", TYPES)
def test_round_trip_is_bit_exact_for_every_cache_type(cache_type: str, rotate: bool) -> None:
    k, v = cache(cache_type, rotate=rotate), cache(cache_type)
    round_trip([k, v], saved=[1, 3, 4], loaded_into=[6, 0, 2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream path needs CUDA")
@pytest.mark.parametrize("cache_type", TYPES)
def test_round_trip_on_cuda_side_streams(cache_type: str) -> None:
    k, v = cache(cache_type, rotate=True, device="cuda"), cache(cache_type, device="cuda")
    store = round_trip([k, v], saved=[1, 3, 4], loaded_into=[6, 0, 2])
    assert store.mirror(k)[0].is_pinned()


def test_mixed_cache_types_in_one_store_round_trip() -> None:
    k, v = cache("q4_0", rotate=True), cache("fp8")
    drafter_k, drafter_v = cache("bf16", heads=1, head_dim=32), cache("q8_0", heads=3, head_dim=32)
    caches = [k, v, drafter_k, drafter_v, k]  # a cache listed twice (shared KV) is stored once
    store = round_trip(caches, saved=[7, 2, 5, 0], loaded_into=[1, 3, 6, 4])
    stored = BLOCK * sum(c.bytes_per_token for c in caches[:4])  # 1496: rows are padded to 16 bytes
    assert store.block_bytes == HostKVStore.bytes_per_block(caches) == -(-stored // 16) * 16


def test_host_blocks_out_of_order_and_fragmented() -> None:
    caches = [cache("q8_0", rotate=True), cache("f16")]
    fill(caches, seed=3)
    store = HostKVStore(caches, num_host_blocks=6)
    first = store.allocate(4)
    store.free([first[1]])
    host = [first[3], first[0], first[2]]  # runs split and reversed: [3], [0], [2]
    want = [snapshot(c, [5, 6, 7]) for c in caches]
    store.save([5, 6, 7], host)
    fill(caches, seed=4)
    store.load(list(reversed(host)), [2, 1, 0])
    for c, (values, scales, gathered) in zip(caches, want):
        got = snapshot(c, [0, 1, 2])
        assert_same(got, (values, scales, gathered))


def test_bytes_per_block_equals_the_mirror_sizes() -> None:
    caches = [cache(t, rotate=t == "q4_0") for t in TYPES]
    store = HostKVStore(caches, num_host_blocks=3)
    mirrors = [m for c in caches for m in store.mirror(c) if m is not None]
    assert all(m.shape[0] == 3 for m in mirrors)
    per_block = sum(m[0].numel() * m.element_size() for m in mirrors)
    assert store.block_bytes == HostKVStore.bytes_per_block(caches) == per_block
    assert per_block == BLOCK * sum(c.bytes_per_token for c in caches)
    for c in caches:
        values, scales = store.mirror(c)
        assert values.dtype == c.values.dtype and values.shape[1:] == c.values.shape[1:]
        assert scales is None if c.scales is None else scales.dtype == c.scales.dtype


def test_rows_padded_for_alignment_still_round_trip() -> None:
    odd = PagedKVCache(NUM_BLOCKS, 1, 1, 7, "fp8", torch.float32, "cpu")  # 7 + 4 bytes a block
    store = HostKVStore([odd], num_host_blocks=2)
    assert store.block_bytes == 16 and store.mirror(odd)[1].dtype == torch.float32
    odd.write(torch.randn(NUM_BLOCKS, 1, 7), torch.arange(NUM_BLOCKS))
    want = (block_bytes(odd.values, [3]), block_bytes(odd.scales, [3]))
    host = store.allocate(1)
    store.save([3], host)
    store.load(host, [5])
    assert_same((block_bytes(odd.values, [5]), block_bytes(odd.scales, [5])), want)


def test_allocate_lowest_first_free_and_full_capacity_error() -> None:
    store = HostKVStore([cache("q8_0")], num_host_blocks=4)
    assert store.allocate(3) == [0, 1, 2] and store.num_free == 1
    store.free([1])
    assert store.allocate(2) == [1, 3] and store.num_free == 0
    with pytest.raises(HostKVFullError, match=r"host KV capacity .*GiB.*4 free|0 of 4 free.*host KV capacity"):
        store.allocate(1)
    assert issubclass(HostKVFullError, OverloadError)  # the server answers 503: retry once others finish
    store.free([0, 2])
    with pytest.raises(ValueError, match="not allocated"):
        store.free([0])


def test_bad_block_ids_are_refused_before_any_copy() -> None:
    store = HostKVStore([cache("f16")], num_host_blocks=4)
    host = store.allocate(2)
    with pytest.raises(ValueError, match="2 device blocks but 1 host blocks"):
        store.save([0, 1], host[:1])
    with pytest.raises(ValueError, match=r"device blocks \[8\] out of range"):
        store.save([8], host[:1])
    with pytest.raises(ValueError, match=r"host blocks \[3\] not allocated"):
        store.load([3], [0])
    with pytest.raises(ValueError, match="repeated destinations"):
        store.load(host, [2, 2])
