"""Recurrent state under tensor parallelism: every rank keeps its own DeltaNet heads' state, moved alike.

Rank 0's CacheManager decides what happens to the recurrent slots (a new sequence's reset or snapshot
load, a verify's commit over its accepted tokens, a tree path's stash compaction, prefix snapshots
saved). Its pools are wrapped (MirroredState): each such change is applied here and queued, and the
queue goes to the other ranks as one STATE message before the next step (ShardedRunner), where
RankStates applies it to that rank's pools -- the same slots, the same tokens, its own heads. Forwards
need nothing more: a step's slots and advances travel in its plan (tp_plan).

A message is one int64 tensor: [ops, per op: code, pool, layer (-1: the whole pool), lists, per list:
(length, *values)]. Snapshot storages are named by their index in the build (one per pool).
"""
from __future__ import annotations

import torch

from ..model.recurrent_state import RecurrentState

RESET, COMMIT, COMPACT_STASH, SAVE, LOAD, COPY = range(6)


def _ints(value) -> list[int]:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    return [int(value)]


class StateLog:
    """Rank 0's queue of state changes the other ranks have not applied yet."""

    def __init__(self, storages: list[tuple[torch.Tensor, torch.Tensor]]):
        self.ops: list[tuple[int, int, int, list[list[int]]]] = []
        self.storage_index = {id(storage): i for i, storage in enumerate(storages)}

    def add(self, code: int, pool: int, layer: int, *lists) -> None:
        self.ops.append((code, pool, layer, [_ints(v) for v in lists]))

    def storage(self, storage) -> int:
        if id(storage) not in self.storage_index:
            raise RuntimeError("tensor parallelism: a snapshot storage the other ranks never built")
        return self.storage_index[id(storage)]

    def take(self) -> torch.Tensor | None:
        """The queued changes as one message (None: nothing queued), the queue emptied."""
        if not self.ops:
            return None
        out = [len(self.ops)]
        for code, pool, layer, lists in self.ops:
            out += [code, pool, layer, len(lists)]
            for values in lists:
                out += [len(values), *values]
        self.ops.clear()
        return torch.tensor(out, dtype=torch.int64)


class MirroredState:
    """A RecurrentState of rank 0 (a pool, or one layer's view of it) whose changes are also queued."""

    def __init__(self, state: RecurrentState, log: StateLog, pool: int, layer: int = -1):
        self._state, self._log, self._pool, self._layer = state, log, pool, layer

    def __getattr__(self, name: str):
        return getattr(self._state, name)

    def reset(self, slots: torch.Tensor) -> None:
        self._log.add(RESET, self._pool, self._layer, slots)
        self._state.reset(slots)

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        self._log.add(COMMIT, self._pool, self._layer, slots, accepted, *(() if skip is None else (skip,)))
        self._state.commit(slots, accepted, skip)

    def compact_stash(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._log.add(COMPACT_STASH, self._pool, self._layer, src, dst)
        self._state.compact_stash(src, dst)

    def save(self, slot: int, storage, entry: int) -> None:
        self._log.add(SAVE, self._pool, self._layer, slot, self._log.storage(storage), entry)
        self._state.save(slot, storage, entry)

    def load(self, storage, entry: int, slot: int) -> None:
        self._log.add(LOAD, self._pool, self._layer, self._log.storage(storage), entry, slot)
        self._state.load(storage, entry, slot)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._log.add(COPY, self._pool, self._layer, src, dst)
        self._state.copy(src, dst)


def mirror_cache(cache) -> tuple[StateLog, list[int]]:
    """Wrap a CacheManager's recurrent pools, layer views and snapshot pool in place; returns the log and
    the build message for the other ranks: [slots, positions, snapshot entries, pools, per pool: its
    layers' count, *their indices among the recurrent layers]."""
    pools, states = cache.pools, cache.states
    if pools is states or all(p is s for p, s in zip(pools, states)):
        layout = [[i] for i in range(len(states))]  # one pool a layer (layers of different shapes)
    elif len(pools) == 1:
        layout = [list(range(len(states)))]
    else:
        raise RuntimeError("tensor parallelism keeps the recurrent pools on one device")
    snapshots = cache.snapshots
    log = StateLog(snapshots.storage if snapshots is not None else [])
    cache.pools = [MirroredState(pool, log, p) for p, pool in enumerate(pools)]
    cache.states = [MirroredState(states[i], log, p, j if len(layer_ids) > 1 else -1)
                    for p, layer_ids in enumerate(layout) for j, i in enumerate(layer_ids)]
    if snapshots is not None:
        snapshots.pools = cache.pools
    first = pools[0]
    build = [first.num_slots, first.positions, snapshots.capacity if snapshots is not None else 0, len(layout)]
    for layer_ids in layout:
        build += [len(layer_ids), *layer_ids]
    return log, build


class RankStates:
    """A rank's own recurrent pools (its heads), built as rank 0's and changed as its log says."""

    def __init__(self, build: list[int], specs: list, device: torch.device):
        """specs: this rank's RecurrentSpec of each recurrent layer, in order."""
        num_slots, positions, entries, count = build[:4]
        at, self.pools, self.states, self.storages = 4, [], [None] * len(specs), []
        for _ in range(count):
            n = build[at]
            layer_ids = build[at + 1:at + 1 + n]
            at += 1 + n
            pool = specs[layer_ids[0]].build(num_slots, positions, device, n)
            self.pools.append(pool)
            for j, i in enumerate(layer_ids):
                self.states[i] = pool.layer(j) if n > 1 else pool
            if entries:
                self.storages.append(pool.snapshot_storage(entries))
        self._views = {}

    def apply(self, message: torch.Tensor) -> None:
        values, at = message.tolist(), 1
        for _ in range(values[0]):
            code, pool, layer, count = values[at:at + 4]
            at += 4
            lists = []
            for _ in range(count):
                n = values[at]
                lists.append(values[at + 1:at + 1 + n])
                at += 1 + n
            self._apply(code, self._target(pool, layer), lists)

    def _target(self, pool: int, layer: int) -> RecurrentState:
        if layer < 0:
            return self.pools[pool]
        if (pool, layer) not in self._views:
            self._views[pool, layer] = self.pools[pool].layer(layer)
        return self._views[pool, layer]

    def _apply(self, code: int, state: RecurrentState, lists: list[list[int]]) -> None:
        device = state.state.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        if code == RESET:
            state.reset(tensor(lists[0]))
        elif code == COMMIT:
            state.commit(tensor(lists[0]), tensor(lists[1]), tensor(lists[2]) if len(lists) > 2 else None)
        elif code == COMPACT_STASH:
            state.compact_stash(tensor(lists[0]), tensor(lists[1]))
        elif code == SAVE:
            (slot,), (storage,), (entry,) = lists
            state.save(slot, self.storages[storage], entry)
        elif code == LOAD:
            (storage,), (entry,), (slot,) = lists
            state.load(self.storages[storage], entry, slot)
        elif code == COPY:
            state.copy(tensor(lists[0]), tensor(lists[1]))
        else:
            raise RuntimeError(f"unknown recurrent-state op {code}")
