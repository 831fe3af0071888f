"""The gated delta rule over tree verify rows (DDTree on hybrid targets): each node sees its ancestors only.

A tree verify row (kernels/forward_batch.py) is the pending token then draft nodes in DFS order;
bit j of tree_mask[i] is set when row token j is token i or one of its ancestors (-1: an ordinary
row, every earlier token). Node i's DeltaNet output must come from the slot's state advanced over
its root-to-node path only, and its causal conv must read its ancestors' inputs (not the previous
DFS rows). Two pieces, both without host syncs (graph-safe):

  tree_links         per row: the row of its parent (-1: the slot's window comes next), its depth,
                     and where a run ends: a run is rows r, r + 1, ... each the child of the one
                     before (a chain row is one run; in DFS order a run ends at a leaf, so a tree
                     has as many runs as leaves). kernels.gated_delta.conv_steps takes parent/depth.
  gated_delta_tree   per row: the state advanced along the row's root-to-node path from the slot's
                     state. Triton: one program per run (and head and value block), which steps its
                     first row's ancestors, then its rows in order, writing each one's output: a
                     tree costs sum over leaves of (depth of its run's start) + rows steps, a chain
                     its length, and no state memory beyond registers. The torch reference keeps
                     one running state per row for one layer at a time.

Verify rows write no state (stash and recompute, model/recurrent_state.py): the commit after the
verdict advances the slot over the accepted path's stash rows (CacheManager.rollback(path=...)).
A sequence with advance > 0 (a decode sharing the batch, a chain) gets the state after its row
advance - 1 written back, by the one program of its run.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import routing
from .dispatch import use_triton
from .gated_delta import l2_normalize

MASK_BITS = 64  # one int64 word of visibility bits per row


class TreeLinks(NamedTuple):
    parent: torch.Tensor  # [T] the row of each row's parent, -1 where the slot's state / window come first
    depth: torch.Tensor  # [T] rows above it on its path
    run_end: torch.Tensor  # [T] for a run's first row, the run's last row; -1 for other rows


def tree_links(tree_mask: torch.Tensor, starts: torch.Tensor, seq: torch.Tensor, local: torch.Tensor) -> TreeLinks:
    """TreeLinks of each row: rows are a sequence's starts[seq]..; local[t] its index there;
    tree_mask[t] its visibility bits (-1: chain semantics, parent t - 1)."""
    bit = torch.arange(MASK_BITS, device=tree_mask.device)
    ancestors = ((tree_mask[:, None] >> bit) & 1).bool() & (bit <= local[:, None])
    tree_parent = torch.where(ancestors & (bit < local[:, None]), bit, -1).amax(1)
    chain = tree_mask == -1
    parent_local = torch.where(chain, local - 1, tree_parent)
    depth = torch.where(chain, local, ancestors.sum(1) - 1)
    parent = torch.where(parent_local >= 0, starts[seq] + parent_local, -1)
    rows = torch.arange(tree_mask.shape[0], device=tree_mask.device)
    first = (parent < 0) | (parent != rows - 1)  # a run starts where a row does not continue the one before
    run = first.long().cumsum(0) - 1
    last = torch.zeros_like(rows).scatter_reduce(0, run, rows, "amax")
    return TreeLinks(parent, depth, torch.where(first, last.index_select(0, run), -1))


def gated_delta_tree(q, k, v, g, beta, state, slots, starts, seq, local, tree_mask, advance, max_len: int,
                     run_end: torch.Tensor, normalize: bool = False, scale: float = 1.0) -> torch.Tensor:
    """Row t (of sequence seq[t], index local[t] among its rows starts[seq]..) -> o[t] from
    state[slots[seq]] advanced over the row tokens j <= local[t] with bit j of tree_mask[t] set (its
    path; all earlier ones for -1). q/k [T, Hk, dk], v [T, Hv, dv], g/beta [T, Hv]; returns o [T, Hv,
    dv] float32. A sequence with advance[b] > 0 (a chain) gets the state after its row advance[b] - 1
    written back. run_end: tree_links' (the runs the Triton kernel walks; the reference needs none).
    max_len bounds a sequence's rows (host). normalize: as gated_delta_steps."""
    if state.dtype != torch.float32 or state.dim() != 4 or state.stride(-1) != 1:
        raise ValueError(f"gated_delta_tree: state must be contiguous float32 [slots, Hv, dk, dv], got "
                         f"{tuple(state.shape)} {state.dtype}")
    if routing.gated_delta_route("steps", triton=use_triton(q, k, v, state)) == routing.TRITON_STEPS:
        from .triton_gated_delta import gated_delta_tree_triton
        return gated_delta_tree_triton(q, k, v, g, beta, state, slots, starts, seq, tree_mask, advance, run_end,
                                       normalize, scale)
    return gated_delta_tree_reference(q, k, v, g, beta, state, slots, starts, seq, local, tree_mask, advance,
                                      max_len, run_end, normalize, scale)


def gated_delta_tree_reference(q, k, v, g, beta, state, slots, starts, seq, local, tree_mask, advance,
                               max_len: int, run_end=None, normalize: bool = False,
                               scale: float = 1.0) -> torch.Tensor:
    """gated_delta_tree in torch: one running state per row, step j applied where j is on its path."""
    if normalize:
        k = l2_normalize(k.float())
        q = l2_normalize(q.float()) * scale
    rows, v_heads = v.shape[0], v.shape[1]
    if rows == 0:
        return torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    group = v_heads // k.shape[1]
    current = state.index_select(0, slots.index_select(0, seq))  # [T, Hv, dk, dv]
    first = starts.index_select(0, seq)
    for j in range(max_len):
        on_path = (j <= local) & ((tree_mask == -1) | (((tree_mask >> min(j, MASK_BITS - 1)) & 1) == 1))
        if j >= MASK_BITS:
            on_path &= tree_mask == -1
        read = torch.where(on_path, first + j, 0).clamp(max=max(rows - 1, 0))
        k_j = k.index_select(0, read).float().repeat_interleave(group, dim=1)
        decayed = current * g.index_select(0, read).float().exp()[..., None, None]
        delta = (v.index_select(0, read).float() - torch.einsum("thk,thkv->thv", k_j, decayed)) \
            * beta.index_select(0, read).float()[..., None]
        current = torch.where(on_path[:, None, None, None], decayed + k_j[..., :, None] * delta[..., None, :], current)
    q_t = q.float().repeat_interleave(group, dim=1)
    out = torch.einsum("thk,thkv->thv", q_t, current)
    last = (starts + advance - 1).clamp(0, max(rows - 1, 0))  # each advancing sequence's row advance - 1
    kept = torch.where((advance > 0)[:, None, None, None], current.index_select(0, last), state.index_select(0, slots))
    state.index_copy_(0, slots, kept)  # slots not advanced get their own state back
    return out
