"""Gated DeltaNet (Qwen 3.5 "linear_attention" layers): the torch reference, per sequence.

One layer, one sequence of L new tokens x [L, hidden]:
  qkv = in_proj_qkv(x)                 conv channels: [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]
  qkv = silu(causal depthwise conv)    over the last `conv_kernel` inputs; the K-1 inputs before
                                       this chunk come from the sequence's conv window
  q, k = l2norm(q), l2norm(k); q *= dk^-0.5; k/q heads repeated to the Hv value heads
  beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   (per head)
  per token: S = S * exp(g); S += k (beta (v - k^T S))^T; o = q^T S       S [Hv, dk, dv]
  out = out_proj(rms_norm(o) * weight * silu(in_proj_z(x)))            (per value head)
The state S and the conv window live in RecurrentState slots (model/recurrent_state.py); a chunk
starts from its slot's state and writes the state after its last token back, so chunked prefill
and decode continue exactly where the previous step stopped.

`chunked_gated_delta_rule` computes a prefill chunk in blocks of C tokens (the WY/UT form:
one triangular solve per block instead of C dependent steps); `recurrent_gated_delta_rule`
is the token-by-token specification (decode steps, and the tests' reference).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.forward_batch import ForwardBatch
from .cache_spec import RecurrentSpec


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """q/k [H, L, dk] (normalised, q scaled), v [H, L, dv], g/beta [H, L], state [H, dk, dv]
    (float32) -> (o [H, L, dv], the state after the last token)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[:, t], state)
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], state)
    return out, state


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64):
    """recurrent_gated_delta_rule's result, C = `chunk` tokens at a time. Within a block, the
    delta rule's updates form a unit lower-triangular system (I + tril(beta k k^T * decay, -1))
    whose solution gives each token's correction u = beta v - (what the state before the block
    and earlier tokens of the block predict); the block's output and final state follow in
    matrix products."""
    heads, length = k.shape[:2]
    pad = -length % chunk
    if pad:  # padded tokens: k = 0 and beta = 0 write nothing, g = 0 decays nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    blocks = (length + pad) // chunk
    q, k, v = (x.reshape(heads, blocks, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(heads, blocks, chunk) for x in (g, beta))
    decay_in = g.cumsum(-1)  # log decay from the block's start through token i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(decay_in_i - decay_in_j) for j <= i: what of token j's write survives to i
    decay = (decay_in[..., :, None] - decay_in[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal.tril(-1), 0) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False)
    w = torch.linalg.solve_triangular(system, k_beta * decay_in.exp()[..., None], upper=False)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * decay_in.exp()[..., None]
    k_to_end = k * (decay_in[..., -1:] - decay_in).exp()[..., None]
    block_decay = decay_in[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for b in range(blocks):
        corrections = u[:, b] - w[:, b] @ state
        out[:, b] = q_decayed[:, b] @ state + intra[:, b] @ corrections
        state = state * block_decay[:, b] + k_to_end[:, b].transpose(-1, -2) @ corrections
    return out.reshape(heads, blocks * chunk, -1)[:, :length], state


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(gate), per value head (weight used as stored: no 1 + w)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


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

    def cache_spec(self) -> RecurrentSpec:
        """Per sequence: S [Hv, dk, dv] and the conv window [channels, kernel - 1], in float32
        (the recurrence accumulates in float32 whatever the model dtype)."""
        return RecurrentSpec((self.num_v_heads, self.head_k_dim, self.head_v_dim),
                             (self.conv_dim, self.conv_kernel - 1), torch.float32)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """h [T, hidden] (normalised) of the batch's sequences -> [T, hidden]; each sequence's
        state is read from and written back to its slot (batch.state_slots_host)."""
        if self.state is None or batch.state_slots_host is None:
            raise RuntimeError(f"layer {self.layer}: Gated DeltaNet needs recurrent-state slots in the batch")
        qkv, z = self.in_proj_qkv(h), self.in_proj_z(h)
        beta = self.in_proj_b(h).float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(h).float() + self.dt_bias.float())
        out = torch.empty(h.shape[0], self.value_dim, dtype=h.dtype, device=h.device)
        starts, snapshots = batch.query_starts_host, batch.state_snapshots_host
        for i, slot in enumerate(batch.state_slots_host):
            rows = slice(starts[i], starts[i + 1])
            if starts[i] == starts[i + 1]:
                continue
            keep = snapshots is not None and snapshots[i]
            out[rows] = self._sequence(qkv[rows], beta[rows], g[rows], slot, keep).to(h.dtype)
        o = self.norm(out.view(-1, self.num_v_heads, self.head_v_dim), z.view(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(h.shape[0], -1))

    def _sequence(self, qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, slot: int,
                  keep_snapshots: bool = False) -> torch.Tensor:
        """One sequence's L tokens from its slot's state; the slot then holds the state after them.
        keep_snapshots (a verify): the state and conv window after token i also go to snapshot i."""
        length = qkv.shape[0]
        if keep_snapshots and length > self.state.snapshots:
            raise RuntimeError(f"layer {self.layer}: a verify of {length} tokens needs {length} recurrent "
                               f"snapshots, the pool keeps {self.state.snapshots}")
        window = torch.cat([self.state.conv[slot].to(qkv.dtype), qkv.t()], dim=1)  # [channels, K-1+L]
        self.state.conv[slot] = window[:, window.shape[1] - (self.conv_kernel - 1):].float()
        if keep_snapshots:  # the window after token i: the K-1 inputs ending with it
            self.state.snap_conv[slot, :length] = window.unfold(1, self.conv_kernel - 1, 1)[:, 1:].transpose(0, 1).float()
        mixed = F.silu(F.conv1d(window[None], self.conv1d.weight.to(qkv.dtype), groups=self.conv_dim)[0]).t()
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.view(length, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = l2_normalize(k.view(length, self.num_k_heads, self.head_k_dim))
        repeat = self.num_v_heads // self.num_k_heads  # each q/k head serves `repeat` consecutive v heads
        q, k = (x.repeat_interleave(repeat, dim=1).transpose(0, 1) for x in (q, k))
        v = v.view(length, self.num_v_heads, self.head_v_dim).transpose(0, 1)
        if keep_snapshots:
            o, self.state.state[slot] = self._stepwise(q, k, v, g.t(), beta.t(), slot)
        else:
            rule = recurrent_gated_delta_rule if length == 1 else chunked_gated_delta_rule
            o, self.state.state[slot] = rule(q, k, v, g.t(), beta.t(), self.state.state[slot].float())
        return o.transpose(0, 1).reshape(length, self.value_dim)

    def _stepwise(self, q, k, v, g, beta, slot: int):
        """recurrent_gated_delta_rule one token at a time, the state after token i kept as snapshot i
        (a verify is a few tokens: the token-by-token rule costs nothing there)."""
        state, outs = self.state.state[slot].float(), []
        for t in range(q.shape[1]):
            step = slice(t, t + 1)
            o, state = recurrent_gated_delta_rule(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state)
            self.state.snap_state[slot, t] = state
            outs.append(o)
        return torch.cat(outs, dim=1), state
