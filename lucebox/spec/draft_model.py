"""Draft-model speculation: a smaller model with the target's tokenizer proposes k tokens, one
forward per token, with its own paged KV indexed by the target's block tables.

The draft's KV is valid for the positions whose tokens it was fed and that are still the
sequence's tokens; after a verify, the first position where they differ is where it resumes.
At temperature > 0 drafts are sampled from the draft's processed distribution q (the same
processing as the target's), which verification needs for lossless acceptance.

A draft with recurrent layers (a Qwen 3.5 hybrid drafting for its family) keeps per sequence a live
state slot and a snapshot slot in its runner's pools: each step feeds the new committed tokens,
copies the live state to the snapshot, then feeds its drafts. A rejected draft cannot be taken back
out of a recurrent state, so the next step restores the snapshot (the state after the committed
tokens of the last step) and feeds from there: the accepted drafts again, with the bonus token.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import CheckpointError
from ..model.cache_spec import RecurrentSpec, bytes_per_sequence
from ..model.loader import load_model
from ..sampling.acceptance import Draft, row_states
from ..sampling.sampler import Sampler, exponential_race
from ..util import common_prefix, move
from .proposer import Proposer


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, draft, target):
        self.draft, self.target = draft, target
        self.vocab = target.config.vocab_size
        self.device = draft.model.device  # --draft-device: its runner, K/V and logits there
        self.sampler = Sampler(set(target.tokenizer.eos_token_ids) | set(target.config.eos_token_ids))
        self.runner = None  # the engine's ModelRunner of the draft model (allocate)
        self.blocks = None
        self.fed: dict[int, list[int]] = {}  # per sequence: the tokens whose draft K/V are cached
        # per sequence: how many leading tokens of fed are known to be committed ones (those never
        # change), so each step compares only the tail: a full comparison is O(context) of Python
        self.synced: dict[int, int] = {}
        # recurrent drafts: per sequence its live slot, and how many tokens the snapshot slot's state holds
        self.slots: dict[int, int] = {}
        self.snapshot_at: dict[int, int] = {}
        self.free_slots: list[int] = []

    @classmethod
    def load(cls, path: str, target, dtype=None, device=None) -> "DraftModelProposer":
        draft = load_model(path, dtype=dtype or target.model.dtype, device=str(device or target.model.device))
        _check_same_vocabulary(draft, target, path)
        return cls(draft, target)

    def cache_specs(self) -> list:
        """The draft model's own K/V, one paged spec per attention layer. Unbounded even where its layers
        slide: after steps without drafts it catches up on positions behind the target's. Recurrent
        layers keep their state in the draft runner's slots (state_slots, fixed_bytes), not here."""
        return [replace(spec, window=None) for spec in self.draft.model.cache_specs()
                if not isinstance(spec, RecurrentSpec)]

    def _recurrent_specs(self) -> list:
        return [s for s in self.draft.model.cache_specs() if isinstance(s, RecurrentSpec)]

    def state_slots(self, max_num_seqs: int) -> int:
        """Recurrent slots the draft runner needs: a live and a snapshot slot a sequence (0: none)."""
        return 2 * max_num_seqs if self._recurrent_specs() else 0

    def fixed_bytes(self, max_num_seqs: int) -> int:
        """Bytes of those slots (and the scratch slot) on the target's device, for the memory plan
        (none when the draft runs elsewhere: --draft-device)."""
        slots = self.state_slots(max_num_seqs)
        if not slots or self.device != self.target.model.device:
            return 0
        return (slots + 1) * bytes_per_sequence(self._recurrent_specs())

    @property
    def runs_model(self):
        return self.draft.model

    def allocate(self, num_blocks: int, block_size: int, block_manager=None, graphs=None, runner=None) -> None:
        self.runner = runner
        self.blocks = block_manager
        if runner is not None and runner.recurrent_layers:
            self.free_slots = list(range(self._live - 1, -1, -1))

    def capture_graphs(self) -> None:
        self.runner.capture_graphs()

    def release(self, seq, finished: bool = True) -> None:
        self.fed.pop(id(seq), None)
        self.synced.pop(id(seq), None)
        self.snapshot_at.pop(id(seq), None)
        slot = self.slots.pop(id(seq), None)
        if slot is not None:
            self.free_slots.append(slot)

    @torch.inference_mode()
    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        # Drafts need KV slots past the target's allocation; take blocks now or draft less.
        ks = [self._reserve(seq, k) for seq, k in zip(seqs, num_tokens)]
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts = [Draft([]) for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        feed = {}
        recurrent = bool(self.runner is not None and self.runner.recurrent_layers)
        if recurrent:
            active = self._take_slots(seqs, active)
        restore = []
        for i in active:
            seq = seqs[i]
            fed = self.fed.setdefault(id(seq), [])
            start = min(self.synced.get(id(seq), 0), len(fed))
            end = min(len(fed), seq.num_tokens)
            keep = start + common_prefix(fed[start:end], seq.token_slice(start, end))
            if recurrent and keep < len(fed):  # the live state holds rejected drafts: back to the snapshot
                keep = self.snapshot_at[id(seq)]
                restore.append(self.slots[id(seq)])
            del fed[keep:]
            feed[i] = seq.token_slice(keep, seq.num_tokens)
            self.synced[id(seq)] = seq.num_tokens  # fed will hold all of them after this step
        if restore:
            self._copy_states([s + self._live for s in restore], restore)
        slot = {i: self.slots[id(seqs[i])] for i in active} if recurrent else {}
        for step in range(max((ks[i] for i in active), default=0)):
            rows = [i for i in active if len(drafts[i].tokens) < ks[i]]
            if not rows:
                break
            logits = self.runner.forward([feed[i] for i in rows], [len(self.fed[id(seqs[i])]) for i in rows],
                                         [seqs[i].block_table for i in rows],
                                         **({"state_slots": [slot[i] for i in rows]} if recurrent else {}))
            if recurrent and step == 0:  # the committed tokens are in: snapshot before any draft goes in
                self._copy_states([slot[i] for i in rows], [slot[i] + self._live for i in rows])
                for i in rows:
                    self.snapshot_at[id(seqs[i])] = seqs[i].num_tokens
            logits = _fit_vocab(logits, self.vocab)
            states = [row_states(seqs[i], drafts[i].tokens)[-1] for i in rows]
            q = self.sampler.processed_probs(logits, states)  # processed once: sampled from and kept
            greedy = [seqs[i].params.is_greedy for i in rows]
            tokens = exponential_race(q, states).tolist()  # greedy rows of q are one-hot: their argmax
            for row, i in enumerate(rows):
                self.fed[id(seqs[i])].extend(feed[i])
                drafts[i].tokens.append(tokens[row])
                if not greedy[row]:
                    probs[i].append(q[row])
                feed[i] = [tokens[row]]
        for i in active:
            if probs[i]:
                drafts[i].probs = move(torch.stack(probs[i]), self.target.model.device)
        return drafts

    @property
    def _live(self) -> int:
        """Live slots of the draft runner's pools; live slot s keeps its snapshot in slot s + _live."""
        return self.runner.recurrent_states[0].num_slots // 2

    def _take_slots(self, seqs: list, active: list[int]) -> list[int]:
        """Recurrent drafts: each active sequence's live slot (a new one starts from the zero state);
        sequences finding no free slot draft nothing this step."""
        fresh = []
        for i in active:
            if id(seqs[i]) not in self.slots and self.free_slots:
                self.slots[id(seqs[i])] = slot = self.free_slots.pop()
                self.fed[id(seqs[i])], self.synced[id(seqs[i])] = [], 0
                fresh.append(slot)
        if fresh:
            self.runner.reset_states(fresh)
        return [i for i in active if id(seqs[i]) in self.slots]

    def _copy_states(self, src: list[int], dst: list[int]) -> None:
        device = self.runner.model.device
        src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst))
        for state in self.runner.recurrent_states:
            state.copy(src_t, dst_t)

    def _reserve(self, seq, k: int) -> int:
        """Blocks for the draft positions (up to num_tokens + k - 1): take them, or shorten k."""
        if self.blocks is None:
            return k
        while k > 0 and not self.blocks.can_allocate(seq.block_table, seq.num_tokens + k):
            k -= 1
        if k > 0:
            self.blocks.allocate(seq.block_table, seq.num_tokens + k)
        return k



def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary: padded rows the draft lacks get -inf."""
    if logits.shape[1] == vocab:
        return logits
    if logits.shape[1] > vocab:
        return logits[:, :vocab]
    pad = torch.full((logits.shape[0], vocab - logits.shape[1]), float("-inf"), device=logits.device)
    return torch.cat([logits, pad], dim=1)


def _check_same_vocabulary(draft, target, path: str) -> None:
    a, b = draft.tokenizer.backend.get_vocab(), target.tokenizer.backend.get_vocab()
    if a != b:
        diff = next((t for t in b if a.get(t) != b[t]), None) or next(t for t in a if a[t] != b.get(t))
        raise CheckpointError(f"{path}: the draft model's tokenizer differs from the target's "
                              f"(token {diff!r}: {a.get(diff)} vs {b.get(diff)}); a draft model must share "
                              f"the target's vocabulary")
