"""N-gram lookup first, a drafter model otherwise (speculative_config["ngram_first"]).

Where the text repeats itself (loops, quoted input, edits), prompt lookup proposes the repeat for
free and it is usually accepted; elsewhere the drafter proposes. Per sequence and per step: when
the last n tokens occurred before and at least `min_match` tokens followed them, those are the
draft; the other sequences of the batch go to the drafter in one call. The drafter still observes
every committed position, so its context stays whole whichever proposer drafted.
"""
from __future__ import annotations

from .ngram import NgramProposer
from .proposer import Draft, Proposer


class LookupFirstProposer(Proposer):
    def __init__(self, drafter: Proposer, lookup: NgramProposer, min_match: int = 4):
        self.drafter, self.lookup, self.min_match = drafter, lookup, min_match
        self.method = f"{drafter.method}+ngram"
        self.capture_layers = drafter.capture_layers
        self.looked_up = self.drafted = 0  # sequences-steps drafted by each, for the curious

    def allocate(self, num_blocks: int, block_size: int, block_manager=None) -> None:
        self.drafter.allocate(num_blocks, block_size, block_manager)

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        drafts: list[Draft | None] = []
        for seq, k in zip(seqs, num_tokens):
            found = self.lookup.lookup(seq.token_ids, k)
            drafts.append(Draft(found) if len(found) >= min(k, self.min_match) else None)
        rest = [i for i, d in enumerate(drafts) if d is None]
        if rest:
            for i, draft in zip(rest, self.drafter.propose([seqs[i] for i in rest], [num_tokens[i] for i in rest])):
                drafts[i] = draft
        self.looked_up += len(seqs) - len(rest)
        self.drafted += len(rest)
        return drafts

    def observe(self, seq, start: int, features) -> None:
        self.drafter.observe(seq, start, features)

    def release(self, seq, finished: bool = True) -> None:
        self.drafter.release(seq, finished)

    def kv_bytes_per_token(self) -> int:
        return self.drafter.kv_bytes_per_token()
