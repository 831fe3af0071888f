"""Speculator: what the engine talks to — proposes per step, records acceptance, keeps metrics."""
from __future__ import annotations

import time

from .adaptive import DraftLengthPolicy, SequenceAcceptance
from .proposer import Draft, Proposer


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 adaptive: bool = True):
        self.proposer = proposer
        self.capture_layers = proposer.capture_layers
        self.max_model_len = max_model_len
        self.policy = DraftLengthPolicy(num_speculative_tokens, adaptive)
        self.acceptance: dict[int, SequenceAcceptance] = {}
        self.overall = SequenceAcceptance(decay=0.99)  # across sequences: the prior of new ones
        self.last_k = 0
        self._forward_started = None

    def propose(self, running: list) -> None:
        """Give each running sequence that is decoding (its last token not yet computed) a draft."""
        decoding = [s for s in running if s.num_computed == s.num_tokens - 1]
        prefill_tokens = sum(s.num_tokens - s.num_computed for s in running if s.num_computed < s.num_tokens - 1)
        k = self.policy.choose([self._acceptance(s).alpha for s in decoding], prefill_tokens)
        self.last_k = k
        limits = [min(k, self._room(s)) for s in decoding]
        chosen = [(s, n) for s, n in zip(decoding, limits) if n > 0]
        if not chosen:
            return
        start = time.perf_counter()
        drafts = self.proposer.propose([s for s, _ in chosen], [n for _, n in chosen])
        self.policy.draft.add(k, time.perf_counter() - start)
        for (seq, n), draft in zip(chosen, drafts):
            if draft.tokens:
                probs = draft.probs[:n] if draft.probs is not None else None
                seq.draft = Draft(draft.tokens[:n], probs)

    def record_forward(self, num_tokens: int, seconds: float) -> None:
        self.policy.forward.add(num_tokens, seconds)

    def _room(self, seq) -> int:
        """Drafts beyond max_tokens or the context window could never be committed."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return room

    def _acceptance(self, seq) -> SequenceAcceptance:
        key = id(seq)
        if key not in self.acceptance:
            self.acceptance[key] = self.overall.prior()
        return self.acceptance[key]

    def observe(self, seq, start: int, features) -> None:
        self.proposer.observe(seq, start, features)

    def record(self, seq, num_drafts: int, num_accepted: int) -> None:
        self._acceptance(seq).update(num_drafts, num_accepted)
        self.overall.update(num_drafts, num_accepted)
        m = seq.metrics
        m.num_drafts += 1
        m.num_draft_tokens += num_drafts
        m.num_accepted_tokens += num_accepted
        while len(m.accepted_per_position) < num_drafts:
            m.accepted_per_position.append(0)
        for i in range(num_accepted):
            m.accepted_per_position[i] += 1

    def release(self, seq, finished: bool) -> None:
        seq.draft = None
        self.proposer.release(seq, finished)
        if finished:
            self.acceptance.pop(id(seq), None)
