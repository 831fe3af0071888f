#!/usr/bin/env python
"""HostKVStore on the GPU: exact round trips on the side streams, stream ordering, copy/compute overlap.

    python scripts/check_kv_host_store_gpu.py                  # every CUDA device in one store
    python scripts/check_kv_host_store_gpu.py --device cpu     # checks the script runs

1. Every cache type (rotate on/off): write, save, overwrite, load into other device blocks: values,
   scales and gather() are bit-identical; the host mirrors are page-locked.
2. Ordering: K/V produced by a long matmul chain and saved at once (the save must wait for them);
   saved blocks overwritten right after fence() (the overwrite must wait for the save); loaded blocks
   gathered right after load (the gather must wait for the load). All exact.
3. Overlap: a save of many layers' blocks issued beside a big matmul; prints the share of the copy
   hidden behind compute and the copy bandwidth (reported, not asserted), and checks the bytes.
Caches alternate over the CUDA devices when there are several (a split model). Exit status 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import time

import torch

from lucebox.model.kv_cache import PagedKVCache
from lucebox.model.kv_pool.host_store import HostKVStore

TYPES = ("f32", "f16", "bf16", "fp8", "q8_0", "q4_0")


def block_bytes(t, blocks):
    return None if t is None else t.view(t.shape[0], -1).view(torch.uint8)[torch.tensor(blocks, device=t.device)].cpu()


def snapshot(caches, blocks, block_size):
    out = []
    for c in caches:
        slots = torch.tensor([b * block_size + o for b in blocks for o in range(block_size)], device=c.values.device)
        out.append((block_bytes(c.values, blocks), block_bytes(c.scales, blocks), c.gather(slots, torch.float32).cpu()))
    return out


def same(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def produced(c: PagedKVCache, tokens: int, weight: torch.Tensor, steps: int) -> torch.Tensor:
    """K/V rows at the end of a long matmul chain on the current stream (a save must wait for them)."""
    x = torch.randn(tokens, weight.shape[0], device=weight.device)  # weight: at least H * D wide
    for _ in range(steps):
        x = torch.nn.functional.normalize(x @ weight, dim=-1) * 8
    return x[:, :c.num_kv_heads * c.head_dim].reshape(tokens, c.num_kv_heads, c.head_dim).to(c.values.device)


def make_caches(devices, layers, blocks, block_size, cache_type, rotate):
    return [PagedKVCache(blocks, block_size, 8, 128, cache_type, torch.bfloat16, devices[i % len(devices)],
                         rotate=rotate and i % 2 == 0) for i in range(2 * layers)]


def sync(devices):
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def check_type(devices, cache_type, rotate, steps, block_size=16, blocks=64) -> bool:
    caches = make_caches(devices, 4, blocks, block_size, cache_type, rotate)
    twins = make_caches(devices, 4, blocks, block_size, cache_type, rotate)  # never overwritten: the reference
    weight = torch.randn(1024, 1024, device=devices[0]) / 32
    slots = torch.arange(blocks * block_size, device=devices[0])
    for c, twin in zip(caches, twins):
        x = produced(c, blocks * block_size, weight, steps)
        twin.write(x, slots.to(c.values.device))
        c.write(x, slots.to(c.values.device))
    saved, into = list(range(3, 40, 2)), list(range(40, 59))
    store = HostKVStore(caches, num_host_blocks=32)
    host = store.allocate(len(saved))
    store.save(saved, host)  # no sync: the save must wait for the writes above
    store.fence()
    for c in caches:  # overwrite at once: must not race the save
        c.write(torch.randn(blocks * block_size, 8, 128, device=c.values.device), slots.to(c.values.device))
    store.load(host, into)
    loaded = snapshot(caches, into, block_size)  # read at once on the current stream: must wait for the load
    want = snapshot(twins, saved, block_size)
    store.synchronize()
    mirrors = [(block_bytes(store.mirror(c)[0], host), block_bytes(store.mirror(c)[1], host)) for c in caches]
    exact = same(want, loaded) and all(same([m], [w[:2]]) for m, w in zip(mirrors, want))
    changed = not same(want, snapshot(caches, saved, block_size))  # the overwrite really replaced the blocks
    pinned = all(store.mirror(c)[0].is_pinned() for c in caches if c.values.is_cuda)
    print(f"{cache_type:5s} rotate={rotate!s:5s}  exact={exact}  overwritten={changed}  pinned={pinned}")
    return exact and changed and pinned


def check_exact_reference(devices, block_size=16, blocks=32) -> bool:
    """Bytes known before saving (host-side reference) come back exactly after an overwrite."""
    caches = make_caches(devices, 2, blocks, block_size, "q4_0", True)
    slots = torch.arange(blocks * block_size)
    for i, c in enumerate(caches):
        x = torch.randn(blocks * block_size, 8, 128, generator=torch.Generator().manual_seed(i))
        c.write(x.to(c.values.device), slots.to(c.values.device))
    want = snapshot(caches, [1, 2, 3], block_size)
    store = HostKVStore(caches, 8)
    host = store.allocate(3)
    store.save([1, 2, 3], host)
    store.fence()
    for c in caches:
        c.write(torch.zeros(blocks * block_size, 8, 128, device=c.values.device), slots.to(c.values.device))
    store.load(host, [9, 7, 5])
    ok = same(want, snapshot(caches, [9, 7, 5], block_size))
    print(f"reference round trip exact={ok}")
    return ok


def check_overlap(devices, layers, size, block_size=16, blocks=320) -> bool:
    caches = make_caches(devices, layers, blocks, block_size, "bf16", False)
    slots = torch.arange(blocks * block_size)
    for c in caches:
        c.write(torch.randn(blocks * block_size, 8, 128, device=c.values.device), slots.to(c.values.device))
    saved = list(range(256))
    store = HostKVStore(caches, len(saved))
    host = store.allocate(len(saved))
    a = torch.randn(size, size, device=devices[0], dtype=torch.bfloat16) / size**0.5

    def timed(fn) -> float:
        sync(devices)
        started = time.perf_counter()
        fn()
        store.synchronize()
        sync(devices)
        return time.perf_counter() - started

    def matmuls():
        for _ in range(20):
            a @ a

    timed(lambda: store.save(saved, host))  # warm
    t_mm, t_save = timed(matmuls), timed(lambda: store.save(saved, host))
    t_both = timed(lambda: (store.save(saved, host), matmuls()))
    hidden = (t_mm + t_save - t_both) / min(t_mm, t_save)
    gbytes = len(saved) * store.block_bytes / 1e9
    got = [(block_bytes(store.mirror(c)[0], host),) for c in caches]
    ok = same(got, [(block_bytes(c.values, saved),) for c in caches])
    t_load = timed(lambda: store.load(host, saved))
    print(f"overlap: matmul {t_mm * 1e3:.1f} ms, save {t_save * 1e3:.1f} ms ({gbytes / t_save:.1f} GB/s), "
          f"both {t_both * 1e3:.1f} ms: {hidden:.0%} of the shorter hidden; load {gbytes / t_load:.1f} GB/s; "
          f"bytes exact={ok}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (every visible GPU) or cpu")
    args = parser.parse_args()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if args.device == "cuda" else [args.device]
    if not devices:
        raise SystemExit("no CUDA device visible (pass --device cpu to check the script runs)")
    print(f"devices: {devices}")
    gpu = args.device == "cuda"
    results = [check_type(devices, t, r, steps=20 if gpu else 1) for t in TYPES for r in (False, True)]
    ok = all(results)
    ok = check_exact_reference(devices) and ok
    ok = check_overlap(devices, layers=32 if gpu else 2, size=8192 if gpu else 256) and ok
    print("ALL EXACT" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
