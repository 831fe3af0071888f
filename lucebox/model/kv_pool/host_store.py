"""HostKVStore: host copies of whole KV blocks, for every cache sharing one block table.

A block's bytes on every cache tensor (values and scales of K and V of every layer, whatever the cache
type, rotated or not) are copied as bytes, never requantised, so a round trip is exact. Per device,
the host holds one row of `width` bytes per host block: each cache tensor's block at its own offset
(widest element type first, so every mirror view keeps its dtype's alignment). A batch of blocks
moves with one index_select (or index_copy_) per tensor into a device staging buffer and one copy
per run of consecutive host ids (allocate hands out the lowest free ids, so runs are long).

On CUDA the host rows are page-locked with cudaHostRegister (pinned tensors from torch's caching
host allocator round up to a power of two: a 20 GiB store would pin 32 GiB) and every copy runs on
a side stream per device: save waits for the current stream (the blocks were just written), load
waits for it too and makes the current stream wait for the copies (or hands back a Loading to join
later: the copies overlap the steps launched meanwhile), and `fence` makes the current stream wait
for pending saves before saved device blocks are overwritten. On CPU all is synchronous.
"""
from __future__ import annotations

import contextlib
import heapq
import weakref
from dataclasses import dataclass

import torch

from ...errors import HostKVFullError, LuceboxError
from ...util import host_to_device
from ..kv_cache import PagedKVCache

_ROW_ALIGN = 16  # bytes; a multiple of every cache element size


@dataclass(frozen=True)
class _Segment:
    source: torch.Tensor  # a cache's values or scales, [num_blocks, block_size, ...]
    rows: torch.Tensor  # the same as bytes, [num_blocks, block bytes]
    offset: int  # bytes into the host row


@dataclass(frozen=True)
class _Group:
    device: torch.device
    segments: tuple[_Segment, ...]
    width: int  # host bytes per block on this device


def _layout(caches: list[PagedKVCache]) -> list[_Group]:
    by_device: dict[torch.device, dict[int, torch.Tensor]] = {}
    for cache in caches:
        for t in (cache.values, cache.scales):
            if t is not None:  # a cache listed twice (shared KV) is stored once
                by_device.setdefault(t.device, {})[id(t)] = t
    groups = []
    for device, tensors in by_device.items():
        offset, segments = 0, []
        for t in sorted(tensors.values(), key=lambda t: -t.element_size()):
            if not t.is_contiguous():
                raise ValueError(f"HostKVStore: a {t.dtype} cache tensor of shape {tuple(t.shape)} is not contiguous")
            rows = t.view(t.shape[0], -1).view(torch.uint8)  # bytes: one copy path for every type (fp8 too)
            segments.append(_Segment(t, rows, offset))
            offset += rows.shape[1]
        groups.append(_Group(device, tuple(segments), -(-offset // _ROW_ALIGN) * _ROW_ALIGN))
    return groups


def _pin(rows: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(rows.data_ptr(), rows.numel(), 1))  # 1: portable
    if code:
        raise LuceboxError(f"pinning {rows.numel() / 2**30:.2f} GiB of host KV memory failed (cudaError {code}): "
                           "lower the host KV capacity (or the locked-memory limit, ulimit -l, is too low)")


def _unpin(rows: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(rows.data_ptr())  # at exit CUDA may be gone: nothing to report


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(start index in ids, first id, length) of each run of consecutive ids."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


@dataclass
class Loading:
    """Copies into device blocks running on side streams: an event a device (none on the CPU, where
    copies are done when load returns)."""
    events: list[tuple[torch.device, torch.cuda.Event]]

    def done(self) -> bool:
        """Whether every copy has finished (no wait)."""
        return all(event.query() for _, event in self.events)

    def join(self) -> None:
        """The current streams' later work sees the blocks (a device-side wait, no host sync)."""
        for device, event in self.events:
            torch.cuda.current_stream(device).wait_event(event)


class HostKVStore:
    def __init__(self, caches: list[PagedKVCache], num_host_blocks: int, pin: bool | None = None):
        if num_host_blocks < 0:
            raise ValueError(f"HostKVStore: num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_host_blocks = num_host_blocks
        self._groups = _layout(caches)
        self._num_device_blocks = min((s.rows.shape[0] for g in self._groups for s in g.segments), default=0)
        self._host = [torch.empty(num_host_blocks, g.width, dtype=torch.uint8) for g in self._groups]
        for group, rows in zip(self._groups, self._host):
            if group.device.type == "cuda" and pin is not False and rows.numel():
                _pin(rows)
                weakref.finalize(self, _unpin, rows)  # holds rows until unregistered
        self._mirrors = {id(s.source): self._view(host, s) for g, host in zip(self._groups, self._host)
                         for s in g.segments}
        self._streams = {g.device: torch.cuda.Stream(g.device) for g in self._groups if g.device.type == "cuda"}
        self._saved: dict[torch.device, torch.cuda.Event] = {}  # the latest save batch per device
        self._free = list(range(num_host_blocks))  # a heap: the lowest ids first, so batches form runs
        self._is_free = bytearray([1]) * num_host_blocks

    @staticmethod
    def bytes_per_block(caches: list[PagedKVCache]) -> int:
        """Host bytes one block takes over all caches (for planning capacity before building a store)."""
        return sum(g.width for g in _layout(caches))

    @property
    def block_bytes(self) -> int:
        return sum(g.width for g in self._groups)

    def mirror(self, cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The host copies of cache's (values, scales), [num_host_blocks, *block shape] in their dtypes."""
        if id(cache.values) not in self._mirrors:
            raise ValueError("HostKVStore.mirror: this cache is not one of the store's")
        return self._mirrors[id(cache.values)], None if cache.scales is None else self._mirrors[id(cache.scales)]

    @staticmethod
    def _view(host: torch.Tensor, s: _Segment) -> torch.Tensor:
        t = host[:, s.offset:s.offset + s.rows.shape[1]].view(s.source.dtype)
        return t.view(host.shape[0], *s.source.shape[1:])

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            gib = self.num_host_blocks * self.block_bytes / 2**30
            raise HostKVFullError(f"the host KV store is full: {n} blocks wanted, {len(self._free)} of "
                                  f"{self.num_host_blocks} free (host KV capacity {gib:.2f} GiB, "
                                  f"{self.block_bytes} bytes a block); raise the host KV capacity or wait")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for i in ids:
            self._is_free[i] = 0
        return ids

    def free(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.num_host_blocks or self._is_free[i]]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"HostKVStore.free: host blocks {bad or ids} are not allocated (or repeated)")
        for i in ids:
            self._is_free[i] = 1
            heapq.heappush(self._free, i)

    def save(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Copy whole device blocks to host blocks (asynchronous on CUDA: call fence() before the device
        blocks are overwritten, synchronize() before the host reads the mirrors)."""
        if not self._check(device_blocks, host_blocks, destinations=host_blocks):
            return
        for group, host in zip(self._groups, self._host):
            with self._side_stream(group.device) as side:
                ids = host_to_device(device_blocks, group.device, torch.long)
                parts = [s.rows.index_select(0, ids) for s in group.segments]
                pad = group.width - sum(p.shape[1] for p in parts)
                staging = torch.cat(parts + [parts[0].new_zeros(len(ids), pad)] * (pad > 0), dim=1)
                for at, first, n in _runs(host_blocks):
                    host[first:first + n].copy_(staging[at:at + n], non_blocking=True)
                if side is not None:
                    self._saved[group.device] = torch.cuda.Event()
                    self._saved[group.device].record(side)

    def load(self, host_blocks: list[int], device_blocks: list[int], wait: bool = True) -> Loading:
        """Copy host blocks into device blocks. wait: the current stream's later work sees them; else the
        copies run on beside it (after the work queued so far) until the returned Loading is joined."""
        loading = Loading([])
        if not self._check(device_blocks, host_blocks, destinations=device_blocks):
            return loading
        for group, host in zip(self._groups, self._host):
            with self._side_stream(group.device) as side:
                ids = host_to_device(device_blocks, group.device, torch.long)
                staging = torch.empty(len(host_blocks), group.width, dtype=torch.uint8, device=group.device)
                for at, first, n in _runs(host_blocks):
                    staging[at:at + n].copy_(host[first:first + n], non_blocking=True)
                for s in group.segments:
                    s.rows.index_copy_(0, ids, staging[:, s.offset:s.offset + s.rows.shape[1]])
                if side is not None:
                    loading.events.append((group.device, torch.cuda.Event()))
                    loading.events[-1][1].record(side)
        if wait:
            loading.join()
        return loading

    def fence(self) -> None:
        """The current stream waits for every pending save (no host sync)."""
        for device, event in self._saved.items():
            torch.cuda.current_stream(device).wait_event(event)
        self._saved.clear()

    def synchronize(self) -> None:
        """The host waits for every copy."""
        for stream in self._streams.values():
            stream.synchronize()

    @contextlib.contextmanager
    def _side_stream(self, device: torch.device):
        side = self._streams.get(device)
        if side is None:
            yield None
            return
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            yield side

    def _check(self, device_blocks: list[int], host_blocks: list[int], destinations: list[int]) -> bool:
        """Raise on bad block ids; False when there is nothing to copy."""
        if len(device_blocks) != len(host_blocks):
            raise ValueError(f"HostKVStore: {len(device_blocks)} device blocks but {len(host_blocks)} host blocks")
        bad_device = [b for b in device_blocks if not 0 <= b < self._num_device_blocks]
        bad_host = [b for b in host_blocks if not 0 <= b < self.num_host_blocks or self._is_free[b]]
        if bad_device or bad_host or len(set(destinations)) != len(destinations):
            raise ValueError(f"HostKVStore: device blocks {bad_device} out of range "
                             f"(0..{self._num_device_blocks - 1}), host blocks {bad_host} not allocated, "
                             f"or repeated destinations in {destinations}")
        return bool(device_blocks)
