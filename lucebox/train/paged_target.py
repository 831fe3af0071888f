"""Dense training batches through a target's own paged forward: for targets the dense forward of
train/lm.py does not cover (hybrids: Gated DeltaNet and gated attention layers, whose dense form
would repeat the model's math). Each row of a [S, T] batch gets its own KV blocks and recurrent
slot, allocated for the call (or for a generation: prefill, then one token a step), so the
features are the paged forward's own -- the very capture point the proposer reads at inference.

Cost: K/V of S x max_len tokens for the full-attention layers only, plus one recurrent state per
row; DeltaNet layers step their rows one after another (the torch reference)."""
from __future__ import annotations

import torch

from ..kernels.forward_batch import ForwardBatch
from ..model.cache_spec import PagedKVSpec, RecurrentSpec
from ..model.transformer import Attention

BLOCK = 16  # tokens per KV block of these private caches


def needs_paged_forward(model) -> bool:
    """Whether the dense forward of train/lm.py cannot run this model's layers."""
    return any(not isinstance(getattr(layer, "self_attn", None), Attention) for layer in model.layers)


class PagedTarget:
    """S rows of up to max_len tokens each in the model's paged caches, private to this object
    (installed on the model's layers for each call: an engine sharing the model reinstalls its own)."""

    def __init__(self, model, rows: int, max_len: int):
        self.model, self.rows = model, rows
        self.width = -(-max_len // BLOCK)
        specs = model.cache_specs()
        device = model.device
        self.caches = {i: s.build(rows * self.width, BLOCK, model.dtype, device)
                       for i, s in enumerate(specs) if isinstance(s, PagedKVSpec)}
        self.states = {i: s.build(rows, 0, device) for i, s in enumerate(specs) if isinstance(s, RecurrentSpec)}
        self.tables = [list(range(r * self.width, (r + 1) * self.width)) for r in range(rows)]

    def _install(self) -> None:
        for i, (k, v) in self.caches.items():
            self.model.layers[i].self_attn.k_cache, self.model.layers[i].self_attn.v_cache = k, v
        for i, state in self.states.items():
            self.model.layers[i].linear_attn.state = state

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: int = 0, capture_layers: tuple[int, ...] = ()):
        """ids [S, t] at positions start..start+t-1 of every row -> final normed hidden states
        [S, t, hidden], and with capture_layers the residual stream after those layers
        [S, t, taps * hidden] (as train/lm.dense_forward returns them)."""
        s, t = ids.shape
        if s != self.rows or start + t > self.width * BLOCK:
            raise ValueError(f"a batch of {s} rows to position {start + t} does not fit {self.rows} rows of "
                             f"{self.width * BLOCK} positions")
        self._install()
        batch = ForwardBatch.build(ids.tolist(), [start] * s, self.tables, BLOCK, self.model.device,
                                   tuple(capture_layers))
        batch.set_state_rows(range(s), [t] * s)
        hidden = self.model(batch).view(s, t, -1)
        if not capture_layers:
            return hidden
        features = torch.cat([batch.captured[i] for i in capture_layers], dim=-1)
        return hidden, features.view(s, t, -1)
