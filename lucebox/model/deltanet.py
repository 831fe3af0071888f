"""Gated DeltaNet (Qwen 3.5 "linear_attention" layers).

One layer, one sequence of L new tokens x [L, hidden]:
  qkv = in_proj_qkv(x)                 conv channels: [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]
  qkv = silu(causal depthwise conv)    over the last `conv_kernel` inputs; the K-1 inputs before
                                       this chunk come from the sequence's conv window
  q, k = l2norm(q), l2norm(k); q *= dk^-0.5; value head h reads q/k head h // (Hv/Hk)
  beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   (per head)
  per token: S = S * exp(g); S += k (beta (v - k^T S))^T; o = q^T S       S [Hv, dk, dv]
  out = out_proj(rms_norm(o) * weight * silu(in_proj_z(x)))            (per value head)
The state S and the conv window live in RecurrentState slots (model/recurrent_state.py).

Rows take one of two paths (the recurrence itself is kernels/gated_delta.py):
  steps    decode and verify rows (and every row of a CUDA-graph batch): all sequences at once,
           the conv as gathers over the batch's rows and the slots' windows, the recurrence token
           by token from each slot (Triton kernels on GPUs: the conv, the rule with q/k
           normalised in it, the gates and the output norm); slots, lengths and `state_advance`
           are device tensors, so nothing syncs with the host. A decode row advances its slot in
           place; a verify row (advance 0) leaves state and window alone and stashes its inputs
           for the commit (model/recurrent_state.py). In a batch with tree verify rows
           (ForwardBatch.tree_mask), each row's conv reads its ancestors and its recurrence
           runs along its root-to-node path (kernels/gated_delta_tree.py).
  chunks   prefill chunks (eager): the conv per sequence, the chunked rule over all of them,
           each chunk's final state written back, so the next chunk continues where it stopped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import routing
from ..kernels.forward_batch import ForwardBatch
from ..kernels.gated_delta import (  # noqa: F401  (the references, re-exported for tests)
    chunked_gated_delta_rule,
    conv_gate_steps,
    conv_steps,
    conv_windows,
    gated_delta_chunk,
    gated_delta_chunk_slot,
    gated_delta_steps,
    gated_rms_norm,
    gated_rms_norm_rounded,
    gates,
    l2_normalize,
    recurrent_gated_delta_rule,
    stash_rows,
)
from ..kernels.gated_delta_tree import TreeLinks, gated_delta_tree, tree_links
from ..kernels.linear import linears, stored_order_linear, stored_order_takes_int8, takes_int8
from ..util import host_to_device
from .cache_spec import RecurrentSpec
from .transformer import fuse_linears


BUCKET = "prefill bucket"  # `_split`'s answer for a prefill graph bucket's rows under routing.bucket_chunks


@dataclass
class StepRows:
    """The sequences of a batch that take the steps path, as every DeltaNet layer reads them:
    `rows` of the batch (None: all), per sequence its rows starts..ends-1 among them, slot and
    advance, per row its sequence and index in it; max_len bounds a sequence's rows (host)."""
    rows: torch.Tensor | None
    starts: torch.Tensor
    ends: torch.Tensor
    slots: torch.Tensor
    advance: torch.Tensor
    seq: torch.Tensor
    local: torch.Tensor
    max_len: int
    device_only: bool
    stash_index: dict = field(default_factory=dict)  # (positions, trash) -> each row's stash row
    tree_mask: torch.Tensor | None = None  # per row, its visibility bits when the batch holds tree rows
    _links: TreeLinks | None = None

    @classmethod
    def of_device_batch(cls, batch: ForwardBatch) -> "StepRows":
        """All of a device-only batch (a CUDA graph's): read on the device only."""
        qsl = batch.query_start_loc
        every = torch.arange(batch.num_tokens, device=qsl.device)
        seq = torch.searchsorted(qsl[1:], every, right=True)
        return cls(None, qsl[:-1], qsl[1:], batch.state_slots, batch.state_advance, seq, every - qsl[seq],
                   batch.max_query_len, True, tree_mask=batch.tree_mask)

    @classmethod
    def of_host(cls, batch: ForwardBatch, seqs: list[int], everything: bool) -> "StepRows":
        """Sequences `seqs` of an eager batch, from its host lists."""
        starts_all, device = batch.query_starts_host, batch.input_ids.device
        lens = [batch.query_lens_host[i] for i in seqs]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        rows = None if everything else host_to_device(
            [r for i in seqs for r in range(starts_all[i], starts_all[i + 1])], device, torch.long)
        seq = [j for j, n in enumerate(lens) for _ in range(n)]
        local = [r for n in lens for r in range(n)]

        def as_device(values):
            return host_to_device(values, device, torch.long)

        tree_mask = batch.tree_mask
        if tree_mask is not None and rows is not None:
            tree_mask = tree_mask[rows]
        return cls(rows, as_device(starts[:-1]), as_device(starts[1:]),
                   as_device([batch.state_slots_host[i] for i in seqs]),
                   as_device([batch.state_advance_host[i] for i in seqs]), as_device(seq), as_device(local),
                   max(lens, default=0), False, tree_mask=tree_mask)

    def stash_rows(self, positions: int, trash: int) -> torch.Tensor:
        """Each row's stash row: slot * positions + its index (rows past the stash: `trash`)."""
        key = (positions, trash)
        if key not in self.stash_index:
            self.stash_index[key] = stash_rows(self.slots, self.seq, self.local, positions, trash)
        return self.stash_index[key]

    @property
    def tree(self) -> TreeLinks | None:
        """Each row's parent, depth and run when the batch holds tree rows (kernels/gated_delta_tree.py)."""
        if self.tree_mask is not None and self._links is None:
            self._links = tree_links(self.tree_mask, self.starts, self.seq, self.local)
        return self._links


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(gate), per value head (weight used as stored: no 1 + w)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype | None = None,
                head_order: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., size] (rounded to `dtype`, default its own, first), gate like x -> `dtype`;
        head_order: see kernels.gated_delta.gated_rms_norm."""
        return gated_rms_norm(x, gate, self.weight, self.eps, dtype or x.dtype, head_order)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.layer = layer
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        hidden = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        # HF keeps nn.Conv1d's [channels, 1, kernel] weight; the depthwise filter is all we use
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.state = None  # RecurrentState of this layer, installed by the runner
        self.projections = None  # qkv | z | b | a as one projection, after fuse()
        self.qkvz = self.ba = None  # or qkv | z and b | a as two, when the four cannot be one (e.g. quantised + float)
        # after fuse(), where out_proj stores its columns in another head order (GGUF ssm_out): the
        # source head of each stored one, so the gated norm writes that order (no permuting launch)
        self.register_buffer("out_heads", None, persistent=False)

    def fuse(self) -> None:
        """The four input projections as one GEMV where their weights allow (float of one dtype, or
        quantised of one type), else qkv | z and b | a as two (a GGUF's small b and a are often float
        beside quantised qkv and z): fewer kernels per decode step."""
        block_order = getattr(self.out_proj, "block_order", None)
        if block_order is not None and self.out_heads is None:
            self.out_heads = block_order(self.head_v_dim)
        if self.projections is not None or self.qkvz is not None or self.ba is not None:
            return
        self.projections = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        if self.projections is None:
            self.qkvz = fuse_linears([self.in_proj_qkv, self.in_proj_z])
            self.ba = fuse_linears([self.in_proj_b, self.in_proj_a])

    def input_projections(self) -> tuple:
        """The projections of the normalised input, fused where fuse() could: their outputs are
        qkv | z | b | a in that order."""
        if self.projections is not None:
            return (self.projections,)
        qkvz = (self.qkvz,) if self.qkvz is not None else (self.in_proj_qkv, self.in_proj_z)
        return qkvz + ((self.ba,) if self.ba is not None else (self.in_proj_b, self.in_proj_a))

    def _project(self, h: torch.Tensor, rows: torch.Tensor | None = None):
        """(qkv, z, b, a) of the normalised input; rows: h rounded to int8 by the norm, if it was."""
        sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        parts = []
        for out in linears(h, self.input_projections(), rows):  # each output covers the next sizes
            take = [sizes[len(parts)]]
            while sum(take) < out.shape[-1]:
                take.append(sizes[len(parts) + len(take)])
            parts.extend(out.split(take, dim=-1))
        return parts

    def cache_spec(self) -> RecurrentSpec:
        """Per sequence: S [Hv, dk, dv] and the conv window [channels, kernel - 1], in float32
        (the recurrence accumulates in float32 whatever the model dtype), and a verify's stash."""
        return RecurrentSpec((self.num_v_heads, self.head_k_dim, self.head_v_dim),
                             (self.conv_dim, self.conv_kernel - 1), self.num_k_heads, torch.float32)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, hidden] (normalised) of the batch's sequences -> [T, hidden]; each sequence's
        state is read from (and, as batch.state_advance says, written back to) its slot. rows: h
        rounded to int8 by the norm, if it was (norm_rows)."""
        if self.state is None or batch.state_slots is None:
            raise RuntimeError(f"layer {self.layer}: Gated DeltaNet needs recurrent-state slots in the batch")
        qkv, z, b, a = self._project(h, rows)
        steps, chunks = self._split(batch)
        if steps is BUCKET:
            g, beta = gates(a, b, self.A_log, self.dt_bias)
            out = self._bucket_chunk(qkv, beta, g, batch)
        elif chunks is None and steps is not None:
            out = self._steps(qkv, a, b, steps)
        else:
            out = torch.zeros(h.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=h.device)
            if steps is not None:
                out[steps.rows] = self._steps(qkv[steps.rows], a[steps.rows], b[steps.rows], steps)
            if chunks:
                g, beta = gates(a, b, self.A_log, self.dt_bias)
                self._chunks(qkv, beta, g, batch, chunks, out)
        return self._output(out, z, h.dtype)

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj(norm(out) * silu(z)): the gated norm's launch rounds out_proj's int8 rows too."""
        tokens, order = z.shape[0], self.out_heads  # order: out_proj's stored head order, written by the norm
        heads = z.view(tokens, self.num_v_heads, self.head_v_dim)
        if stored_order_takes_int8(z, self.out_proj) if order is not None else takes_int8((self.out_proj,), z):
            o, rows = gated_rms_norm_rounded(out, heads, self.norm.weight, self.norm.eps, dtype, order)
        else:
            o, rows = self.norm(out, heads, dtype, order), None
        o = o.reshape(tokens, -1)
        if order is not None:
            return stored_order_linear(o, self.out_proj, rows)
        return linears(o, (self.out_proj,), rows)[0]

    @staticmethod
    def _split(batch: ForwardBatch) -> tuple[StepRows | None, list[int] | None]:
        """(the steps path's rows, the sequences of prefill chunks or None); the same for every layer."""
        if "deltanet" not in batch.layer_cache:
            if batch.prefill_bucket and routing.bucket_chunks():
                split = BUCKET, None
            elif batch.device_only:
                split = StepRows.of_device_batch(batch), None
            else:
                lens, advance = batch.query_lens_host, batch.state_advance_host
                small = [i for i, n in enumerate(lens) if n and (n == 1 or advance[i] == 0)]
                chunks = [i for i, n in enumerate(lens) if n > 1 and advance[i]]
                steps = StepRows.of_host(batch, small, everything=not chunks) if small else None
                split = steps, chunks or None
            batch.layer_cache["deltanet"] = split
        return batch.layer_cache["deltanet"]

    def _qkv_heads(self, mixed: torch.Tensor):
        """Conv outputs [T, channels] -> q (normalised, scaled), k (normalised) [T, Hk, dk], v [T, Hv, dv], float32."""
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.reshape(-1, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = l2_normalize(k.reshape(-1, self.num_k_heads, self.head_k_dim))
        return q, k, v.reshape(-1, self.num_v_heads, self.head_v_dim)

    def _steps(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """Decode / verify rows (qkv, a, b of `rows` only) -> o [T', Hv, dv] float32, no host sync;
        with a stash, each row's conv input and output, g and beta are kept there too."""
        state = self.state
        stash = gate_stash = None
        if state.positions:
            # (a graph bucket longer than the stash is a catch-up of taps, never committed)
            if rows.max_len > state.positions and not rows.device_only:
                raise RuntimeError(f"layer {self.layer}: a verify of {rows.max_len} tokens needs "
                                   f"{rows.max_len} stash positions, the pool keeps {state.positions}")
            stash = state.conv_stash
            gate_stash = state.gate_stash(rows.stash_rows(state.positions, state.trash))
        mixed, g, beta = conv_gate_steps(qkv, a, b, state.conv, self.conv1d.weight[:, 0, :], self.A_log, self.dt_bias,
                                         rows, stash, state.positions, gate_stash)
        tree = rows.tree
        q = mixed[:, :self.key_dim].view(-1, self.num_k_heads, self.head_k_dim)
        k = mixed[:, self.key_dim:2 * self.key_dim].view(-1, self.num_k_heads, self.head_k_dim)
        v = mixed[:, 2 * self.key_dim:].view(-1, self.num_v_heads, self.head_v_dim)
        if tree is not None:  # each node from the state after its ancestors only
            return gated_delta_tree(q, k, v, g, beta, state.state, rows.slots, rows.starts, rows.seq, rows.local,
                                    rows.tree_mask, rows.advance, rows.max_len, tree.run_end, normalize=True,
                                    scale=self.head_k_dim ** -0.5)
        return gated_delta_steps(q, k, v, g, beta, state.state, rows.slots, rows.starts, rows.ends, rows.advance,
                                 rows.max_len, normalize=True, scale=self.head_k_dim ** -0.5)

    def _bucket_chunk(self, qkv, beta, g, batch: ForwardBatch) -> torch.Tensor:
        """A prefill graph bucket's one sequence through the chunked rule, on the device only: its first
        state_advance rows are real, the rest padding, which g = beta = 0 keeps out of the state; the conv
        window moves to the raw inputs ending at the last real row. o [Q, Hv, dv] float32."""
        state, slot, advance = self.state, batch.state_slots[:1], batch.state_advance[:1]
        real = (torch.arange(qkv.shape[0], device=qkv.device) < advance)[:, None]
        window = torch.cat([state.conv.index_select(0, slot)[0].to(qkv.dtype), qkv.t()], dim=1)
        mixed = F.silu(F.conv1d(window[None], self.conv1d.weight.to(qkv.dtype), groups=self.conv_dim)[0]).t()
        conv_windows(qkv, state.conv, slot, torch.zeros_like(slot), advance)
        q, k, v = self._qkv_heads(mixed)
        o = gated_delta_chunk_slot(q, k, v, torch.where(real, g, 0), torch.where(real, beta, 0), state.state, slot,
                                   qkv.dtype)
        return o.float()

    def _chunks(self, qkv, beta, g, batch: ForwardBatch, seqs: list[int], out: torch.Tensor) -> None:
        """Prefill chunks of sequences `seqs` (eager): conv per sequence from its window, then the
        chunked rule over all of them; o into `out`, final states and windows into their slots."""
        starts_all, state, width = batch.query_starts_host, self.state, self.conv_kernel - 1
        weight = self.conv1d.weight.to(qkv.dtype)
        mixed, starts, slots, rows = [], [0], [], []
        for i in seqs:
            slot, part = batch.state_slots_host[i], slice(starts_all[i], starts_all[i + 1])
            window = torch.cat([state.conv[slot].to(qkv.dtype), qkv[part].t()], dim=1)  # [channels, K-1+L]
            state.conv[slot] = window[:, window.shape[1] - width:].float()
            mixed.append(F.silu(F.conv1d(window[None], weight, groups=self.conv_dim)[0]).t())
            starts.append(starts[-1] + part.stop - part.start)
            slots.append(slot)
            rows.extend(range(part.start, part.stop))
        q, k, v = self._qkv_heads(torch.cat(mixed))
        index = host_to_device(rows, qkv.device, torch.long)
        o = gated_delta_chunk(q, k, v, g[index], beta[index], state.state, slots, starts, qkv.dtype)
        out[index] = o.float()
