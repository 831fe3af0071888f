"""Routed (token, expert) pairs grouped by expert on the device, for the grouped expert products
(triton_moe): no host sync, shapes fixed by the batch size alone (CUDA-graph safe).

The R = tokens x top_k pairs are numbered r = t * top_k + j. `align_by_expert` lays them out in
blocks of BLOCK_M slots that each hold pairs of one expert: expert e's pairs, in order of r, fill
ceil(count_e / BLOCK_M) blocks, the last one padded with the sentinel R. Three launches:
  1. count:   each chunk of CHUNK pairs counts its pairs per expert ([chunks, E]);
  2. offsets: one program sums the counts, pads each expert's to whole blocks, writes every
              chunk's first slot per expert, each block's expert (-1: unused) and the sentinels;
  3. scatter: each chunk puts its pairs at their slots (rank among the chunk's pairs of the same
              expert, by comparison), so the order is stable and the result deterministic.
The number of blocks is bounded by R / BLOCK_M + min(R, E) (each touched expert wastes under one
block); the grouped products launch that many programs and the unused ones return at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2, pdl_launch
from .triton_pdl import wait_for_previous_kernel


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, R, CHUNK: tl.constexpr, E_P2: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + i, mask=i < R, other=E_P2)  # past the end: no expert's column
    experts = tl.arange(0, E_P2)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + c * E_P2 + experts, tl.sum(hits, axis=0))


@triton.jit
def _offsets_kernel(counts_ptr, first_ptr, block_expert_ptr, slots_ptr, R, E, chunks, n_blocks, n_slots,
                    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                    FILL: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    experts = tl.arange(0, E_P2)
    rows = tl.arange(0, ROWS)
    total = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, chunks, ROWS):  # ROWS chunks' counts a tile
        ok = (c0 + rows)[:, None] < chunks
        total += tl.sum(tl.load(counts_ptr + (c0 + rows)[:, None] * E_P2 + experts[None, :], mask=ok, other=0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    running = end - padded  # each expert's first slot, then the next chunk's
    for c0 in range(0, chunks, ROWS):
        ok = (c0 + rows)[:, None] < chunks
        at = (c0 + rows)[:, None] * E_P2 + experts[None, :]
        tile = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(first_ptr + at, running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=ok)
        running += tl.sum(tile, axis=0)
    for b0 in range(0, n_blocks, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        # The expert holding slot b * BLOCK_M is the number of experts whose slots end at or before it
        # (empty experts before it included); past the last expert's slots, the block is unused.
        owner = tl.sum((end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < E, owner, -1), mask=b < n_blocks)
    for s0 in range(0, n_slots, FILL):
        s = s0 + tl.arange(0, FILL)
        tl.store(slots_ptr + s, tl.zeros([FILL], dtype=tl.int32) + R, mask=s < n_slots)


@triton.jit
def _scatter_kernel(ids_ptr, first_ptr, slots_ptr, R, CHUNK: tl.constexpr, E_P2: tl.constexpr,
                    PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    c = tl.program_id(0)
    j = tl.arange(0, CHUNK)
    i = c * CHUNK + j
    ok = i < R
    ids = tl.load(ids_ptr + i, mask=ok, other=0)
    earlier = (ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None]) & ok[None, :]
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    slot = tl.load(first_ptr + c * E_P2 + ids, mask=ok, other=0) + rank
    tl.store(slots_ptr + slot, i.to(tl.int32), mask=ok)


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Blocks the layout can need for `pairs` routed pairs (each touched expert pads under one)."""
    return triton.cdiv(pairs, block_m) + min(pairs, experts)


def align_by_expert(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [max_blocks * block_m] int32: the pair in each slot or R for padding, block_expert
    [max_blocks] int32: each block's expert or -1) for expert ids [R] (any integer dtype)."""
    pairs = flat_ids.numel()
    device = flat_ids.device
    n_blocks = max_blocks(pairs, num_experts, block_m)
    slots = torch.empty(n_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=device)
    if pairs == 0:
        return slots, block_expert
    e_p2 = next_pow2(num_experts)
    chunk = max(16, min(128, 8192 // e_p2))  # a [chunk, E] comparison a program
    chunks = triton.cdiv(pairs, chunk)
    counts = torch.empty(chunks, e_p2, dtype=torch.int32, device=device)
    first = torch.empty_like(counts)
    ids = flat_ids.reshape(-1)
    launch = pdl_launch(device)
    _count_kernel[(chunks,)](ids, counts, pairs, CHUNK=chunk, E_P2=e_p2, **launch)
    rows = max(1, min(64, 8192 // e_p2))
    _offsets_kernel[(1,)](counts, first, block_expert, slots, pairs, num_experts, chunks, n_blocks, slots.numel(),
                          BLOCK_M=block_m, E_P2=e_p2, ROWS=rows, BLOCK=max(16, min(256, 8192 // e_p2)), FILL=1024,
                          num_warps=8, **launch)
    _scatter_kernel[(chunks,)](ids, first, slots, pairs, CHUNK=chunk, E_P2=e_p2, **launch)
    return slots, block_expert
