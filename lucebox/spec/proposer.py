"""The proposer seam: draft tokens per sequence, verified by the target in one forward.

A proposer returns, per sequence, up to k draft tokens and (when it sampled them) the processed
draft distributions q they were drawn from; `probs=None` means deterministic drafts (one-hot q).
Proposers that read target hidden states (DFlash) name the layers to capture and receive the
features of committed positions through `observe`.
"""
from __future__ import annotations

import torch

from ..sampling.acceptance import Draft


class Proposer:
    method = "none"
    # Target layers whose outputs the proposer needs, for every committed position.
    capture_layers: tuple[int, ...] = ()

    # A model the engine runs for this proposer through a ModelRunner of its own (draft models).
    runs_model = None

    def allocate(self, num_blocks: int, block_size: int, block_manager=None, graphs=None, runner=None) -> None:
        """Make the proposer's KV pool; it is indexed by the target's block tables. graphs: the
        target's GraphSettings (None: eager), for proposers that run a model; runner: the engine's
        ModelRunner of `runs_model`, when the proposer has one."""

    # A FeatureRing graph steps write the captured layers into (None: features come as tensors).
    feature_ring = None

    def feature_rows(self, n: int) -> int | None:
        """The first of n ring rows reserved for a step's tokens, or None (no ring)."""
        return None

    def capture_graphs(self) -> None:
        """Capture the proposer's CUDA graphs now, if it has any (the engine calls this at start)."""

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        """Drafts for each sequence (at most num_tokens[i] tokens; fewer or none is fine)."""
        raise NotImplementedError

    def observe(self, seq, start: int, features: torch.Tensor) -> None:
        """Target features (captured layers, concatenated) of committed positions start.. of seq."""

    def release(self, seq, finished: bool = True) -> None:
        """The sequence finished or was aborted (finished=True; called before its blocks are freed)
        or was preempted (called after the scheduler's step that preempted it): drop per-sequence state."""

    def state_slots(self, max_num_seqs: int) -> int:
        """Recurrent state slots the runner of `runs_model` needs (0: none)."""
        return 0

    def fixed_bytes(self, max_num_seqs: int) -> int:
        """Device bytes the proposer keeps outside its cache_specs (the memory plan counts them)."""
        return 0

    def cache_specs(self) -> list:
        """The state the proposer keeps per sequence next to the target's (model/cache_spec.py specs;
        none by default). Paged specs share the target's block tables."""
        return []
