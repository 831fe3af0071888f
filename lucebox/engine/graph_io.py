"""The buffers CUDA-graph steps read and write through: static inputs staged from the host, and
the host copies of steps launched ahead (overlapped decoding) that are read one step later."""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.forward_batch import tree_depths, tree_mask_bits
from ..util import StagedBuffer
from .step_plan import StepResult


class StaticInputs:
    """The device buffers every graph reads, sized for the largest bucket, and their host staging.

    One int64 buffer holds ids | positions | slots | seq_lens | selected rows | real rows | feature
    ring rows | top_k | greedy | drafts | noise seed | recurrent-state slots | state advance (tokens
    that advance each sequence's recurrent state: 0 for verifies) | tree masks (ForwardBatch.tree_mask:
    -1 for ordinary and padding rows) | the slots of KV cache groups 1.. (mixed windows), so a step
    costs two host-to-device copies (that and the block tables of every group, [seqs, groups, width])
    whatever its size (three when it samples in the graph: the float sampling parameters)."""

    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device, groups: int = 1):
        t, b = max_tokens, max_seqs
        self.offsets = {"ids": 0, "positions": t, "slots": 2 * t, "seq_lens": 3 * t, "select": 3 * t + b,
                        "real": 4 * t + b, "ring": 5 * t + b, "top_k": 6 * t + b, "greedy": 6 * t + 2 * b,
                        "draft": 6 * t + 3 * b, "seed": 7 * t + 3 * b, "state_slots": 7 * t + 3 * b + 1,
                        "state_advance": 7 * t + 4 * b + 1, "tree_mask": 7 * t + 5 * b + 1,
                        "group_slots": 8 * t + 5 * b + 1}
        self.max_tokens, self.groups = t, groups
        self._flat = StagedBuffer(8 * t + 5 * b + 1 + (groups - 1) * t, torch.int64, device)
        self._tables = StagedBuffer((max_seqs, groups, width), torch.int32, device)
        self.sampling = StagedBuffer((3, max_seqs), torch.float32, device)  # temperature, top_p, min_p
        self.flat, self.tables = self._flat.device, self._tables.device[:, 0]
        # KV cache groups 1..: their tables (views with the primary's row stride) and slots
        self.group_tables = [self._tables.device[:, g] for g in range(1, groups)]
        self._sampling_rows = None  # what the sampling buffers hold: a batch keeping its rows uploads nothing

    def set_sampling(self, rows: list[tuple[float, int, float, float, bool]], num_seqs: int) -> None:
        """Per-sequence sampling parameters (`sampling.graph_rows.graph_row`); padding rows are greedy."""
        if (rows, num_seqs) == self._sampling_rows:
            return
        self._sampling_rows = (rows, num_seqs)
        floats = self.sampling.staging()
        top_k, greedy = self.host("top_k", num_seqs), self.host("greedy", num_seqs)
        floats[:, :num_seqs] = [[1.0], [2.0], [0.0]]
        top_k[:], greedy[:] = 1, 1
        for i, (temperature, k, p, min_p, is_greedy) in enumerate(rows):
            floats[:, i] = temperature, p, min_p
            top_k[i], greedy[i] = k, is_greedy
        self.sampling.upload()

    def set_drafts(self, token_ids: list[list[int]], num_seqs: int, query_len: int) -> None:
        """The draft each padded row checks (`accept_in_graph`): a verifying sequence's tokens are
        [pending, d1..dk], so row j checks token j + 1; -1 on bonus and padding rows."""
        draft = self.host("draft", num_seqs * query_len)
        draft[:] = -1
        for i, toks in enumerate(token_ids):
            draft[i * query_len:i * query_len + len(toks) - 1] = toks[1:]

    def new_seed(self) -> None:
        """A fresh seed for the Triton sampler's counter-based noise, from torch's global generator
        (torch.manual_seed makes in-graph sampling reproducible)."""
        self.host("seed", 1)[0] = int(torch.randint(1 << 62, (1,)))

    def view(self, name: str, n: int) -> torch.Tensor:
        start = self.offsets[name]
        return self.flat[start:start + n]

    def host(self, name: str, n: int) -> np.ndarray:
        start = self.offsets[name]
        return self._flat.host.numpy()[start:start + n]

    def group_slots(self, g: int, n: int) -> torch.Tensor:
        """The device slots of KV cache group g >= 1 for n padded tokens."""
        start = self.offsets["group_slots"] + (g - 1) * self.max_tokens
        return self.flat[start:start + n]

    def scratch_all_slots(self, tokens: int, block_size: int, scratch_blocks: list[int]) -> None:
        """Every K/V write of the step's tokens goes to each group's scratch block (write_kv=False)."""
        for g, scratch in enumerate(scratch_blocks):
            self._slots_host(g, tokens)[:] = scratch * block_size + np.arange(tokens) % block_size

    def _slots_host(self, g: int, n: int) -> np.ndarray:
        if g == 0:
            return self.host("slots", n)
        start = self.offsets["group_slots"] + (g - 1) * self.max_tokens
        return self._flat.host.numpy()[start:start + n]

    def fill(self, token_ids: list[list[int]], start_positions: list[int], block_tables: list[list[int]],
             num_seqs: int, query_len: int, block_size: int, scratch_block: int,
             state_rows: tuple[list[int], list[int]] | None = None, scratch_slot: int = 0,
             group_tables: list[list[list[int]]] = (), group_scratch: list[int] = (),
             tree_parents: list[list[int] | None] | None = None, rope_shifts: list[int] | None = None) -> list[int]:
        """Write the padded layout of a step into the host staging; returns the padded row of each
        real token, in input order. state_rows: each sequence's recurrent slot and advance
        (models with recurrent layers); padding sequences use `scratch_slot` and advance nothing.
        group_tables[g - 1] / group_scratch[g - 1]: each sequence's table in KV cache group g and
        that group's scratch block (models mixing sliding-window and full attention).
        tree_parents[i] (not None): sequence i is a tree verify row (ForwardBatch.build's meaning): its
        tokens are stored at start + i as ever, rotated at start + depth, with their visibility masks
        in "tree_mask"; every other row, padding included, is -1 there (plain causal).
        rope_shifts[i]: added to sequence i's rotated positions (PlanRow.rope_shift), never to its
        storage (slots, seq_lens); padding rows are rotated at 0."""
        self._flat.staging()
        tokens = num_seqs * query_len
        ids, positions = self.host("ids", tokens), self.host("positions", tokens)
        seq_lens = self.host("seq_lens", num_seqs)
        tables = self._tables.staging()[:num_seqs]
        ids[:] = 0
        positions[:] = 0
        seq_lens[:] = query_len
        state_slots, advance = self.host("state_slots", num_seqs), self.host("state_advance", num_seqs)
        state_slots[:], advance[:] = scratch_slot, 0
        if state_rows is not None:
            state_slots[:len(state_rows[0])], advance[:len(state_rows[1])] = state_rows
        masks = self.host("tree_mask", tokens) if tree_parents is not None else None
        if masks is not None:
            masks[:] = -1
        real: list[int] = []
        for i, (toks, start) in enumerate(zip(token_ids, start_positions)):
            n, base = len(toks), i * query_len
            ids[base:base + n] = toks
            parents = tree_parents[i] if tree_parents is not None else None
            rotated = start + (rope_shifts[i] if rope_shifts is not None else 0)
            if parents is None:
                positions[base:base + n] = np.arange(rotated, rotated + n)
            else:
                if len(parents) != n:
                    raise ValueError(f"sequence {i}: {len(parents)} tree parents for {n} tokens")
                positions[base:base + n] = rotated + np.asarray(tree_depths(parents))
                masks[base:base + n] = tree_mask_bits(parents)
            seq_lens[i] = start + query_len
            real.extend(range(base, base + n))
        groups = [block_tables, *group_tables] + [[]] * (len(group_scratch) - len(group_tables))
        for g, (group, scratch) in enumerate(zip(groups, [scratch_block, *group_scratch])):
            slots = self._slots_host(g, tokens)
            slots[:] = scratch * block_size + np.arange(tokens) % query_len % block_size
            tables[:, g] = scratch
            for i, (toks, start, table) in enumerate(zip(token_ids, start_positions, group)):
                n, base = len(toks), i * query_len
                pos = np.arange(start, start + n)
                table = np.asarray(table, dtype=np.int64)
                slots[base:base + n] = table[pos // block_size] * block_size + pos % block_size
                tables[i, g, :len(table)] = table
        return real

    def set_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        self.host(name, len(rows))[:] = rows
        return self.view(name, len(rows))

    def upload(self, num_seqs: int) -> None:
        self._flat.upload()
        self._tables.upload(num_seqs)


class HostBuffers:
    """Two host buffers that deferred steps' results are copied into, in turn (at most one step is
    launched ahead of the one being read): pinned on CUDA, so each copy is asynchronous."""

    def __init__(self, size: int, device: torch.device):
        pinned = torch.device(device).type == "cuda"
        self.buffers = [torch.empty(size * 2, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.pinned = pinned
        self.turn = 0

    def next(self) -> torch.Tensor:
        self.turn ^= 1
        return self.buffers[self.turn]


class DeferredStep:
    """A launched argmax or sampling step whose results are not read yet. Its results are copied
    to the host in stream order at launch (before any later step overwrites the graph's outputs);
    `device_tokens` (each sequence's next token, on the device) is valid until the next replay."""

    def __init__(self, out: torch.Tensor, select: list[int] | None, features, host: HostBuffers):
        self.out, self.select, self.features, self.shape = out, select, features, out.shape
        buffer = host.next()[:out.numel()]
        buffer.copy_(out.reshape(-1), non_blocking=host.pinned)
        self.host = buffer
        self.done = torch.cuda.Event() if host.pinned else None
        if self.done is not None:
            self.done.record()

    @property
    def device_tokens(self) -> torch.Tensor:
        """Each sequence's next token on the device (a view while the rows are the leading ones)."""
        if self.select is None:
            return self.out[:, 1]
        n = len(self.select)
        return self.out[:n] if self.select == list(range(n)) else self.out[self.select]

    def result(self) -> StepResult:
        """The step's result: [accepted, token] per sequence, or the argmax of each selected row;
        and the features."""
        if self.done is not None:
            self.done.synchronize()
        values = self.host.tolist()
        if self.select is None:
            return StepResult(verdicts=[values[2 * i:2 * i + 2] for i in range(self.shape[0])], features=self.features)
        return StepResult(tokens=[values[r] for r in self.select], features=self.features)
