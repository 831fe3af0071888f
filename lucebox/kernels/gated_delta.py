"""The gated delta rule (Gated DeltaNet's recurrence): torch references and the dispatch to device kernels.

Per value head, with a state S [dk, dv] and per token t (q, k l2-normalised, q already scaled):
    S = S * exp(g_t);  S += k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
GVA: value head h reads q/k head h // (Hv / Hk).

Two entry points, picked by the caller per row kind (routing.gated_delta_route says which kernel):
  gated_delta_steps   token by token, many sequences at once, states read from and (optionally)
                      written back to slots of a state pool: decode and verify rows, and a verify's
                      commit. Every length and slot is a device tensor and the grid is fixed, so it
                      runs inside CUDA graphs. Triton (triton_gated_delta.py) or the torch reference.
  gated_delta_chunk   prefill chunks: flash-linear-attention's chunked kernel on CUDA (fla-core, the
                      `gpu` extra), else the torch reference `chunked_gated_delta_rule` per sequence.
  conv_steps          the causal depthwise conv (+ silu) of decode / verify rows, windows from the
  conv_windows        slots, and moving each advancing sequence's window (also a verify's commit)
                      (Triton: triton_deltanet_conv.py).
  gates               each token's decay g and beta from its projections (one launch, any rows).
  conv_gate_steps     conv_steps and gates of a step's rows, in one launch for short sequences.
  gated_rms_norm      the output norm, rms_norm(o) * weight * silu(z) per value head (one launch).
"""
from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from . import routing
from .dispatch import use_triton

log = logging.getLogger(__name__)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """q/k [H, L, dk] (normalised, q scaled), v [H, L, dv], g/beta [H, L], state [H, dk, dv]
    (float32) -> (o [H, L, dv], the state after the last token). The specification."""
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


def gated_delta_steps(q, k, v, g, beta, state, slots, starts, ends, advance, max_len: int,
                      outputs: bool = True, normalize: bool = False, scale: float = 1.0) -> torch.Tensor | None:
    """Sequence b's tokens are rows starts[b]..ends[b]-1 of q/k [T, Hk, dk], v [T, Hv, dv], g/beta
    [T, Hv]; it starts from state[slots[b]] (state [N, Hv, dk, dv] float32) and, when advance[b] > 0,
    the state after its first advance[b] tokens is written back to that slot (0: read only, e.g. a
    verify whose drafts are not accepted yet). max_len bounds ends - starts (a host number: the
    torch reference's step count; the Triton kernel loops on the device values). Returns o [T, Hv,
    dv] float32 (rows outside every sequence are left unwritten), or None with outputs=False. No
    host sync: every length is read on the device. normalize: q and k as they come from the conv,
    l2-normalised here (q then times `scale`); else already normalised and scaled."""
    if state.dtype != torch.float32 or state.dim() != 4 or state.stride(-1) != 1:
        raise ValueError(f"gated_delta_steps: state must be contiguous float32 [slots, Hv, dk, dv], got "
                         f"{tuple(state.shape)} {state.dtype}")
    if v.shape[1] % k.shape[1]:
        raise ValueError(f"gated_delta_steps: {v.shape[1]} value heads are no multiple of {k.shape[1]} key heads")
    if routing.gated_delta_route("steps", triton=use_triton(q, k, v, state)) == routing.TRITON_STEPS:
        from .triton_gated_delta import gated_delta_steps_triton
        return gated_delta_steps_triton(q, k, v, g, beta, state, slots, starts, ends, advance, outputs,
                                        normalize, scale)
    return gated_delta_steps_reference(q, k, v, g, beta, state, slots, starts, ends, advance, max_len, outputs,
                                       normalize, scale)


def gated_delta_steps_reference(q, k, v, g, beta, state, slots, starts, ends, advance, max_len: int,
                                outputs: bool = True, normalize: bool = False,
                                scale: float = 1.0) -> torch.Tensor | None:
    """gated_delta_steps in torch: step t of every sequence at once, t = 0..max_len-1; rows past a
    sequence's end compute into a trash row."""
    if normalize:
        k = l2_normalize(k.float())
        q = l2_normalize(q.float()) * scale if outputs else None
    rows, v_heads = v.shape[0], v.shape[1]
    group = v_heads // k.shape[1]
    current = state.index_select(0, slots)
    final = current
    out = torch.zeros(rows + 1, v_heads, v.shape[2], dtype=torch.float32, device=v.device) if outputs else None
    for t in range(max_len):
        row = starts + t
        valid = row < ends
        read = torch.where(valid, row, 0).clamp(max=max(rows - 1, 0))
        k_t = k.index_select(0, read).float().repeat_interleave(group, dim=1)
        current = current * g.index_select(0, read).float().exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, current)
        delta = (v.index_select(0, read).float() - predicted) * beta.index_select(0, read).float()[..., None]
        current = current + k_t[..., :, None] * delta[..., None, :]
        if outputs:
            q_t = q.index_select(0, read).float().repeat_interleave(group, dim=1)
            out.index_copy_(0, torch.where(valid, row, rows), torch.einsum("bhk,bhkv->bhv", q_t, current))
        final = torch.where((advance == t + 1)[:, None, None, None], current, final)
    state.index_copy_(0, slots, final)  # slots not advanced get their own state back
    return out[:rows] if outputs else None


def conv_steps(qkv, conv, weight, slots, starts, advance, seq, local, stash=None, positions: int = 0,
               tree=None) -> torch.Tensor:
    """The causal depthwise conv of decode / verify rows, then silu: qkv [T, channels] are the rows
    (row t is input local[t] of sequence seq[t], whose rows begin at starts[seq]); inputs before
    the step come from the window conv[slots[seq]] [channels, K-1]; weight [channels, K]. Each
    sequence with advance > 0 then gets the window ending at its input advance - 1. stash: (raw,
    mixed) [slots * positions + 1, channels] float32 stores, row slot * positions + local, that keep
    each row's input and output (rows past `positions`, never a verify's, are dropped: the last row
    is a trash row). tree: per row its parent row (-1: none) and depth (gated_delta_tree.TreeLinks):
    a tree verify row's taps read its ancestors, then the window (default: row t - 1, depth local).
    Returns [T, channels] in qkv's dtype. No host sync."""
    if routing.gated_delta_route("conv", triton=use_triton(qkv, conv)) == routing.TRITON_CONV:
        from .triton_deltanet_conv import conv_steps_triton
        return conv_steps_triton(qkv, conv, weight, slots, starts, advance, seq, local, stash, positions, tree)
    return conv_steps_reference(qkv, conv, weight, slots, starts, advance, seq, local, stash, positions, tree)


def conv_gate_steps(qkv, a, b, conv, weight, a_log, dt_bias, rows, stash=None, positions: int = 0,
                    gate_stash=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(conv_steps of qkv, then gates of a and b): (mixed [T, channels], g, beta [T, Hv]) for the rows
    of `rows` (slots, starts, ends, advance, seq, local per sequence / row, max_len, tree: as
    model.deltanet.StepRows holds them), which cover every row. One Triton launch where the
    sequences are short (decode, verify: triton_deltanet_conv.SEQ_ROWS_MAX), else conv_steps' and
    gates' own. No host sync."""
    tree = rows.tree
    if routing.gated_delta_route("conv", triton=use_triton(qkv, conv)) == routing.TRITON_CONV and \
            routing.gated_delta_route("gates", triton=use_triton(a, b, a_log, dt_bias)) == routing.TRITON_GATES:
        from . import triton_deltanet_conv
        if rows.max_len <= triton_deltanet_conv.SEQ_ROWS_MAX:
            return triton_deltanet_conv.conv_gate_steps_triton(
                qkv, a, b, conv, weight, a_log, dt_bias, rows.slots, rows.starts, rows.ends, rows.advance, rows.local,
                stash, positions, tree, gate_stash)
    g, beta = gates(a, b, a_log, dt_bias, gate_stash)
    mixed = conv_steps(qkv, conv, weight, rows.slots, rows.starts, rows.advance, rows.seq, rows.local, stash,
                       positions, tree)
    return mixed, g, beta


def stash_rows(slots, seq, local, positions: int, trash: int) -> torch.Tensor:
    """Each row's stash row, slot * positions + its index; rows past the stash go to `trash`."""
    return torch.where(local < positions, slots[seq] * positions + local, trash)


def conv_steps_reference(qkv, conv, weight, slots, starts, advance, seq, local, stash=None,
                         positions: int = 0, tree=None) -> torch.Tensor:
    """conv_steps in torch: gathers from [the rows; each sequence's old window]."""
    tokens, channels = qkv.shape
    width = weight.shape[1] - 1
    old = conv.index_select(0, slots).transpose(1, 2).reshape(-1, channels)
    inputs = torch.cat([qkv, old.to(qkv.dtype)])
    w = torch.arange(width + 1, device=qkv.device)
    if tree is None:
        pos = local[:, None] + w - width  # the tap's input position in its sequence (< 0: the old window)
        rows = torch.arange(tokens, device=qkv.device)[:, None] + w - width
    else:  # tap `back` rows up reads the back-th ancestor (a depth below back: the window)
        parent, depth = tree[:2]
        pos = depth[:, None] + w - width
        chain = [torch.arange(tokens, device=qkv.device)]
        for _ in range(width):
            chain.append(torch.where(chain[-1] >= 0, parent.index_select(0, chain[-1].clamp(min=0)), -1))
        rows = torch.stack(chain[::-1], dim=1)
    taps = torch.where(pos >= 0, rows, tokens + seq[:, None] * width + pos + width)
    mixed = F.silu((inputs[taps] * weight.t().to(qkv.dtype)).sum(1))
    conv_windows_reference(qkv, conv, slots, starts, advance)
    if stash is not None:
        raw, kept = stash
        at = stash_rows(slots, seq, local, positions, raw.shape[0] - 1)
        raw.index_copy_(0, at, qkv.to(raw.dtype))
        kept.index_copy_(0, at, mixed.to(kept.dtype))
    return mixed


def gates(a, b, a_log, dt_bias, stash=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head, from the projections a, b [T, Hv]: (g = -exp(A_log) *
    softplus(a + dt_bias), beta = sigmoid(b)), float32 [T, Hv] each. stash: (g store, beta store,
    rows [T]) float32 [rows, Hv] stores that keep token t's g and beta at row rows[t] as well
    (a verify's stash, written in the same launch)."""
    if routing.gated_delta_route("gates", triton=use_triton(a, b, a_log, dt_bias)) == routing.TRITON_GATES:
        from .triton_gated_delta import gates_triton
        return gates_triton(a, b, a_log, dt_bias, stash)
    beta = b.float().sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    if stash is not None:
        g_stash, beta_stash, rows = stash
        g_stash.index_copy_(0, rows, g.to(g_stash.dtype))
        beta_stash.index_copy_(0, rows, beta.to(beta_stash.dtype))
    return g, beta


def gated_rms_norm(x, gate, weight, eps: float, dtype: torch.dtype,
                   head_order: torch.Tensor | None = None) -> torch.Tensor:
    """DeltaNet's output norm per value head: rms_norm(x) * weight * silu(gate) in `dtype` (x, any
    float dtype, is rounded to it first), rows [..., size]. head_order [heads] (x [T, heads, size]):
    output head j of a token is its head head_order[j] normalised (a consumer's stored order)."""
    if routing.gated_delta_route("norm", triton=use_triton(x, gate, weight)) == routing.TRITON_NORM:
        from .triton_gated_delta import gated_rms_norm_triton
        return gated_rms_norm_triton(x, gate, weight, eps, dtype, head_order=head_order)[0]
    if head_order is not None:
        x, gate = x.index_select(-2, head_order), gate.index_select(-2, head_order)
    return gated_rms_norm_reference(x, gate, weight, eps, dtype)


def gated_rms_norm_rounded(x, gate, weight, eps: float, dtype: torch.dtype,
                           head_order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gated_rms_norm of x [T, heads, size], its token rows [T, heads * size] rounded to int8 as
    triton_dp4a.quantize_rows packs them, from the Triton kernel's same launch; None from the
    reference, or where the rows do not round in one launch: size not a power of two from 32)."""
    size = x.shape[-1]
    if (routing.gated_delta_route("norm", triton=use_triton(x, gate, weight)) == routing.TRITON_NORM
            and x.dim() == 3 and 32 <= size == 1 << (size.bit_length() - 1) and x.shape[1] * size % 256 == 0):
        from .triton_gated_delta import gated_rms_norm_triton
        return gated_rms_norm_triton(x, gate, weight, eps, dtype, rounded=True, head_order=head_order)
    return gated_rms_norm(x, gate, weight, eps, dtype, head_order), None


def gated_rms_norm_reference(x, gate, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    xf = x.to(dtype).float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)


def conv_windows(rows, conv, slots, starts, advance) -> None:
    """Each sequence b with advance[b] > 0: its window conv[slots[b]] [channels, K-1] becomes the
    K-1 inputs ending at its input advance[b] - 1, where its inputs are rows[starts[b]:] and the
    ones before them the window itself (a step's rows, or a verify's stashed raw rows). No host sync."""
    if routing.gated_delta_route("conv", triton=use_triton(rows, conv)) == routing.TRITON_CONV:
        from .triton_deltanet_conv import conv_windows_triton
        conv_windows_triton(rows, conv, slots, starts, advance)
    else:
        conv_windows_reference(rows, conv, slots, starts, advance)


def conv_windows_reference(rows, conv, slots, starts, advance) -> None:
    """conv_windows in torch: a gather from [the rows; each sequence's old window]."""
    channels, width = conv.shape[1:]
    old = conv.index_select(0, slots).transpose(1, 2).reshape(-1, channels)
    inputs = torch.cat([rows, old.to(rows.dtype)])
    pos = advance[:, None] - width + torch.arange(width, device=rows.device)  # input position of each column
    seqs = torch.arange(slots.shape[0], device=rows.device)[:, None]
    index = torch.where(pos >= 0, starts[:, None] + pos, rows.shape[0] + seqs * width + pos + width)
    window = inputs[index.reshape(-1)].view(-1, width, channels).transpose(1, 2)
    conv.index_copy_(0, slots, window.to(conv.dtype))  # unchanged where advance is 0


@functools.cache
def fla_chunk():
    """flash-linear-attention's chunked gated delta rule, or None when fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # ImportError, or a broken install (its Triton version) raising anything
        return None
    return chunk_gated_delta_rule


def _fla_applies(q, k, v, state) -> bool:
    """fla-core's chunk kernel can take these: CUDA tensors Triton may run on, head sizes its tiles are made for."""
    dk, dv = k.shape[-1], v.shape[-1]
    return (all(t.is_cuda for t in (q, state)) and use_triton(q, state) and fla_chunk() is not None
            and dk % 16 == 0 and dv % 16 == 0 and dk <= 256)


def gated_delta_chunk(q, k, v, g, beta, state, slots: list[int], starts: list[int],
                      fla_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Prefill chunks: sequence i's tokens are rows starts[i]..starts[i+1]-1 of q/k [T, Hk, dk]
    (normalised, q scaled), v [T, Hv, dv], g/beta [T, Hv]; it starts from state[slots[i]] and its
    final state is written back there. Returns o [T, Hv, dv] (float32 on the torch path). fla_dtype:
    what fla's kernels read q/k/v in (the model's dtype; the state stays float32)."""
    if routing.gated_delta_route("chunk", fla=_fla_applies(q, k, v, state)) == routing.FLA_CHUNK:
        if fla_dtype is not None:
            q, k, v = (x.to(fla_dtype) for x in (q, k, v))
        index = torch.tensor(slots, dtype=torch.long).to(state.device, non_blocking=True)
        cu_seqlens = torch.tensor(starts, dtype=torch.long).to(q.device, non_blocking=True)
        # cu_seqlens_cpu: fla plans its chunks from host lengths we already have (no sync to read them back)
        o, final = fla_chunk()(q[None], k[None], v[None], g[None].float(), beta[None].float(), scale=1.0,
                               initial_state=state.index_select(0, index), output_final_state=True,
                               cu_seqlens=cu_seqlens, cu_seqlens_cpu=torch.tensor(starts, dtype=torch.long))
        state.index_copy_(0, index, final.float())
        return o[0]
    group = v.shape[1] // k.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for i, slot in enumerate(slots):
        rows = slice(starts[i], starts[i + 1])
        if starts[i] == starts[i + 1]:
            continue
        qh, kh = (x[rows].float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))
        vh = v[rows].float().transpose(0, 1)
        rule = recurrent_gated_delta_rule if starts[i + 1] - starts[i] == 1 else chunked_gated_delta_rule
        o, state[slot] = rule(qh, kh, vh, g[rows].float().t(), beta[rows].float().t(), state[slot])
        out[rows] = o.transpose(0, 1)
    return out


def gated_delta_chunk_slot(q, k, v, g, beta, state, slot: torch.Tensor,
                           fla_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's rows through the chunked rule with every length and index on the device (a
    prefill graph bucket): it starts from state[slot] (slot: a device tensor [1]) and writes its final
    state back there. Rows whose g and beta are 0 (a bucket's padding) neither decay nor write the
    state. Shapes as gated_delta_chunk's; returns o [T, Hv, dv]."""
    initial = state.index_select(0, slot)
    if routing.gated_delta_route("chunk", fla=_fla_applies(q, k, v, state)) == routing.FLA_CHUNK:
        if fla_dtype is not None:
            q, k, v = (x.to(fla_dtype) for x in (q, k, v))
        o, final = fla_chunk()(q[None], k[None], v[None], g[None].float(), beta[None].float(), scale=1.0,
                               initial_state=initial, output_final_state=True)
        state.index_copy_(0, slot, final.float())
        return o[0]
    group = v.shape[1] // k.shape[1]
    qh, kh = (x.float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))
    o, final = chunked_gated_delta_rule(qh, kh, v.float().transpose(0, 1), g.float().t(), beta.float().t(),
                                        initial[0])
    state.index_copy_(0, slot, final[None])
    return o.transpose(0, 1)


def warm_up_chunk(num_k_heads: int, num_v_heads: int, dk: int, dv: int, dtype: torch.dtype,
                  device: torch.device) -> None:
    """Run the prefill chunk kernel once at these head sizes (fla-core autotunes and compiles on its first
    call: minutes on a machine whose Triton cache is cold); without fla-core on a GPU, say what that costs."""
    if fla_chunk() is None:
        if device.type == "cuda":
            log.warning("fla-core is not installed: Gated DeltaNet prefill chunks take the torch reference, "
                        "many times slower on a GPU; pip install 'lucebox[gpu]' (flash-linear-attention)")
        return
    start = time.perf_counter()
    log.info("compiling the Gated DeltaNet prefill kernels (a cold Triton cache takes minutes once)")
    tokens = 64
    q, k = (l2_normalize(torch.randn(tokens, num_k_heads, dk, device=device)) for _ in range(2))
    v = torch.randn(tokens, num_v_heads, dv, device=device)
    g, beta = -torch.rand(tokens, num_v_heads, device=device), torch.rand(tokens, num_v_heads, device=device)
    state = torch.zeros(1, num_v_heads, dk, dv, device=device)
    gated_delta_chunk(q, k, v, g, beta, state, [0], [0, tokens], dtype)
    log.info("prefill kernels ready in %.1f s", time.perf_counter() - start)
