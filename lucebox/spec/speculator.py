"""Speculator: what the engine talks to — proposes per step, records acceptance, keeps metrics.

With a `lookup` (speculative_config["ngram_first"]), n-gram prompt lookup drafts for the sequences
whose recent tokens occurred before, and the proposer (a drafter model) for the others. Each
source has its own acceptance statistics and draft-cost table, so the adaptive policy judges
each on its own record: a drafter that does not pay at some temperature is switched off without
taking the nearly free lookups with it, and the other way round.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from ..sampling.acceptance import Draft
from .adaptive import DraftLengthPolicy, SequenceAcceptance
from .proposer import Proposer

LOOKUP, MODEL = "lookup", "model"
MIN_LOOKUP_MATCH = 4  # tokens a lookup must find to be used (fewer: the drafter proposes instead)
# The drafter is dormant while the target decodes plainly: only drafted steps (and prompts) capture
# its taps, so plain steps run the tap-less graphs and overlap (EngineArgs.async_decode)
# like a plain engine's -- on the bundled pair, a plain step with taps cannot overlap and delivers
# 0.57-0.60x an overlapped one. Before it drafts again, the positions decoded meanwhile get their
# taps recomputed by target passes that write no K/V (CUDA graphs of up to 256 positions: about
# one verify step's time, once per run of plain steps).
# Targets with recurrent layers (capture_every_step) cannot recompute: a catch-up pass over cached
# positions would advance their recurrent state a second time. There every step that computes new
# positions captures the taps, a dormant drafter's too: its plain steps pay the tap copies and
# never overlap (no step launched ahead), in exchange for no catch-up ever.


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 adaptive: bool = True, lookup=None):
        self.proposer = proposer
        self.lookup = lookup  # an NgramProposer tried first, or None
        self.capture_layers = proposer.capture_layers
        self.max_model_len = max_model_len
        # A drafter building trees (DDTree): its policy chooses among chains and tree budgets up to this one.
        self.configured_budget = getattr(proposer, "tree_budget", None)
        self.policy = DraftLengthPolicy(num_speculative_tokens, adaptive, self.configured_budget)
        self.policies = {MODEL: self.policy}
        if lookup is not None:
            self.policies[LOOKUP] = DraftLengthPolicy(num_speculative_tokens, adaptive)
            # One target: one forward-cost table, one record of what plain steps deliver.
            self.policies[LOOKUP].forward = self.policy.forward
            self.policies[LOOKUP].delivered_plain = self.policy.delivered_plain
            self.policies[LOOKUP].in_turn = self.policy.in_turn
        # Per (sequence, source, width): a tree of depth k accepts more than a chain of k (adaptive.py).
        self.acceptance: dict[tuple[int, str, int | None], SequenceAcceptance] = {}
        # Across sequences, per source: the prior of new sequences (every width's verifies); per
        # (source, width): the prior of a width's own record.
        self.overall = {source: SequenceAcceptance(decay=0.99) for source in self.policies}
        self.overall_width = {(MODEL, w): SequenceAcceptance(decay=0.99) for w in self.policy.widths}
        self.source: dict[int, tuple[str, int | None]] = {}  # the source and width of each sequence's pending draft
        self.steps_by_source = {source: 0 for source in self.policies}  # sequence-steps drafted by each
        self.draft_seconds = 0.0  # the last propose()'s drafting time: the rest of the step is the step's
        # This step, for what drafting delivered: decoding sequences, the sources that drafted, draft
        # tokens proposed and accepted.
        self.step_decoding = 0
        self.step_sources: set[str] = set()
        self.step_drafted = self.step_accepted = 0
        self.step_found = False  # the lookup found a match for some sequence
        # The sources whose policy chose to draft this step, whether or not their proposals came back
        # empty (an n-gram proposer often finds nothing): such a step is the price of drafting.
        self.step_chose: set[str] = set()
        # Dormancy: the first position of each sequence whose taps were not captured.
        self.missing: dict[int, int] = {}
        self.every_step = False  # capture_every_step(): recurrent targets, never a catch-up
        self._drafting = None  # what choose() left the drafter to draft: (k, [(seq, n)], any late taps)
        self.catch_up_seconds = 0.0  # this step's recomputation: a cost of dormancy, not of drafting
        self.overlapped_sizes: set[int] = set()  # step sizes (new tokens) whose plain steps have overlapped
        self.evaluated: list = []  # the decoding batch of the last choose(): what a promise is made for

    def choose(self, running: list) -> list[tuple[object, int]]:
        """The first half of proposing for each running sequence that is decoding (its last token
        not yet computed): draft lengths chosen, lookups drafted. Returns (seq, start) for each
        sequence the drafter will draft for whose taps from `start` were missed while it was
        dormant: the engine recomputes them (StepPlanner.catch_up) and hands them to `propose`."""
        decoding = [s for s in running if s.num_computed == s.num_tokens - 1]
        self.evaluated = decoding
        other_tokens = sum(s.num_tokens - s.num_computed for s in running if s.num_computed < s.num_tokens - 1)
        found: dict[int, list[int]] = {}
        looked, rest = [], decoding
        if self.lookup is not None:
            for s in decoding:
                tokens = self.lookup.lookup(s, self.policy.max_k)
                if len(tokens) >= min(MIN_LOOKUP_MATCH, self.policy.max_k):
                    found[id(s)] = tokens
            looked = [s for s in decoding if id(s) in found]
            rest = [s for s in decoding if id(s) not in found]
            if not looked:
                self.policies[LOOKUP].nothing_to_probe()
        self.draft_seconds = self.catch_up_seconds = 0.0
        self.step_decoding, self.step_sources, self.step_drafted, self.step_accepted = len(decoding), set(), 0, 0
        self.step_found, self.step_chose = bool(found), set()
        self._drafting = None
        k_lookup = 0
        if looked:  # each group's k is chosen with the other group's tokens in the batch
            k_lookup = self._choose(LOOKUP, looked, other_tokens + len(rest))
            self._assign(LOOKUP, self._chosen(looked, k_lookup), k_lookup,
                         lambda seqs, ks: [Draft(found[id(s)][:k]) for s, k in zip(seqs, ks)])
        if not rest:
            return []
        k = self._choose(MODEL, rest, other_tokens + len(looked) * (1 + k_lookup))
        chosen = self._chosen(rest, k)
        if not chosen:
            return []
        late = [(s, self.missing.pop(id(s))) for s, _ in chosen if id(s) in self.missing]
        self._drafting = (k, chosen, bool(late))
        return late

    def propose(self, recomputed: Iterable = ()) -> None:
        """The second half: the drafter drafts for the sequences `choose` picked, after observing
        `recomputed`, the (seq, start, features) chunks of the taps `choose` said were missed
        (consumed here, lazily, so that each chunk is observed before the next is computed)."""
        drafting, self._drafting = self._drafting, None
        if drafting is None:
            return
        k, chosen, late = drafting
        if late:
            started = time.perf_counter()
            for seq, begin, features in recomputed:
                self.proposer.observe(seq, begin, features)
            self.catch_up_seconds += time.perf_counter() - started
            self.policy.record_catch_up(self.catch_up_seconds)
        self._assign(MODEL, chosen, k, self.proposer.propose)

    def _choose(self, source: str, seqs: list, other_tokens: int) -> int:
        widths = self.policies[source].widths
        if len(widths) == 1:
            return self.policies[source].choose([self._acceptance(s, source).alpha for s in seqs], other_tokens)
        return self.policies[source].choose({w: [self._acceptance(s, source, w).alpha for s in seqs] for w in widths},
                                            other_tokens)

    def _chosen(self, seqs: list, k: int) -> list[tuple[object, int]]:
        """(seq, draft length) for each of seqs with room for a draft of up to k tokens."""
        if k <= 0:
            return []
        return [(s, n) for s in seqs if (n := min(k, self._room(s))) > 0]

    def _assign(self, source: str, chosen: list, k: int, propose) -> None:
        """Draft the chosen (seq, n) with `propose`, timed into the source's draft costs."""
        if not chosen:
            return
        self.step_chose.add(source)
        policy = self.policies[source]
        width = policy.width if len(policy.widths) > 1 else None
        if source == MODEL and self.configured_budget is not None:
            self.proposer.tree_budget = width  # this step's width: a tree of that budget, or a chain (None)
        started = time.perf_counter()
        drafts = propose([s for s, _ in chosen], [n for _, n in chosen])
        seconds = time.perf_counter() - started
        policy.drafts[width].add(k, seconds)
        self.draft_seconds += seconds
        self.steps_by_source[source] += len(chosen)
        for (seq, n), draft in zip(chosen, drafts):
            if draft.tokens:
                self.step_sources.add(source)
                if draft.is_tree:  # n bounded its depth; its nodes are stored past the pending token
                    keep = self.max_model_len - seq.num_tokens  # a DFS prefix is a tree
                    seq.draft = Draft(draft.tokens[:keep], parents=draft.parents[:keep])
                else:
                    probs = draft.probs[:n] if draft.probs is not None else None
                    seq.draft = Draft(draft.tokens[:n], probs)
                self.step_drafted += len(seq.draft.tokens)
                self.source[id(seq)] = (source, width)

    @property
    def tree_budget(self) -> int | None:
        """Nodes of the widest draft trees the proposer builds (DDTree); None: it drafts chains only."""
        return self.configured_budget

    def tree_row_lens(self) -> list[int]:
        """Tokens of every tree verify row the policy may choose (the graphs' tree buckets): the
        pending token and a tree's nodes, for every tree width and draft depth."""
        policy = self.policy
        widths = policy.widths if policy.adaptive else policy.widths[-1:]  # fixed: the configured budget only
        return sorted({policy.row_tokens(k, w) for w in widths if w is not None for k in policy.candidates})

    def capture_every_step(self) -> None:
        """The target has recurrent layers: every step captures the taps, so that nothing is ever
        recomputed over cached positions (see the note at the top)."""
        self.every_step = bool(self.capture_layers)

    def taps_needed(self) -> bool:
        """Whether this step's decodes capture the drafter's taps: only when this step verifies drafts
        (a verify step never overlaps, and the taps cost it little), or on every step (every_step)."""
        return bool(self.capture_layers) and (self.every_step or bool(self.step_sources))

    def plain_run(self, seqs: list) -> int:
        """How many next steps of these sequences (this step's decoding batch) are promised plain
        decodes: the steps every policy is in a run of plain steps for (0: none). The promise binds:
        the policies count those steps now, and the engine launches each ahead of its turn without
        consulting the speculator at all (no call: a few microseconds of Python a step is what a
        speculator would cost plain decoding on a small target), reporting their time through
        record_plain_steps. A batch that changes ends the run early, and the policies have then
        counted a few plain steps that never ran: their next probe comes that much earlier."""
        if seqs != self.evaluated or self.every_step:  # every_step: no tap-less step to run ahead
            return 0
        run = min(policy.plain_run() for policy in self.policies.values())
        if run:
            for policy in self.policies.values():
                policy.advance_plain(run)
        return run

    def guesses_plain(self, seqs: list) -> bool:
        """Whether the next step of these sequences is guessed plain, so that the engine may launch it
        before this step's tokens are read, though nothing is promised: the step asks the speculator
        as usual, and a draft after all leaves the launched step unused (a plain step launched in
        turn costs about as much). Guessed when the drafter was asked to draft and had nothing (the
        n-gram proposer, mostly), or its policy is in a run of plain steps while a lookup, which
        reads the new tokens, found nothing this step or decodes plainly too."""
        if self.every_step:
            return False
        binds = self.policy.plain_run() > 0
        empty_handed = MODEL in self.step_chose and MODEL not in self.step_sources
        return (seqs == self.evaluated and (binds or empty_handed)
                and (self.lookup is None or not self.step_found or self.policies[LOOKUP].plain_run() > 0))

    def missed(self, seq, start: int) -> None:
        """Positions from `start` of seq were computed without the drafter's taps (a dormant step;
        the engine tells only a speculator that has taps)."""
        if self.every_step:
            raise RuntimeError(f"internal error: positions from {start} were computed without the drafter's taps "
                               f"on a target with recurrent layers; recomputing them would advance its "
                               f"recurrent state twice")
        self.missing.setdefault(id(seq), start)

    def record_step(self, num_tokens: int, seconds: float, overlapped: bool = False) -> None:
        """A whole engine step over num_tokens new tokens took `seconds`, drafting included: its cost
        beside the drafting (scheduling, the forward, sampling or verification, outputs) is what the
        policy weighs against the tokens a draft length commits. Recomputing taps after dormancy
        counts for neither: it pays for the dormant steps, not for this one's drafts.
        `overlapped`: the step was launched before the previous one's tokens were read. Once plain
        steps of a size have overlapped, they are what plain decoding costs at that size, and lone
        plain forwards (which pay the host's whole turn) no longer count as plain decoding's cost.
        A step whose policy chose to draft counts as drafting's, even if no draft came back."""
        seconds -= self.catch_up_seconds
        n = self.step_decoding
        lone = not self.step_sources and not overlapped
        if overlapped:
            self._overlapped(num_tokens, n)
        stale = lone and num_tokens in self.overlapped_sizes
        if stale:
            self.policy.in_turn.add(num_tokens, seconds)
        else:
            self.policy.forward.add(num_tokens, max(0.0, seconds - self.draft_seconds))
        # Only steps that decoded and verified alone (no prefill beside), chosen by one source or none.
        if n and num_tokens == n + self.step_drafted and len(self.step_chose) <= 1:
            if self.step_chose:  # at the width its policy chose this step
                self.policies[next(iter(self.step_chose))].record_delivered(n, n + self.step_accepted, seconds, True)
            elif not stale:
                self.policy.record_delivered(n, n, seconds, False)

    def record_plain_steps(self, num_decoding: int, seconds: float) -> None:
        """Steps of a promised run (plain_run), each decoding num_decoding sequences one token and
        launched ahead, took `seconds` each on average: what plain decoding costs at that size."""
        self._overlapped(num_decoding, num_decoding)
        self.policy.forward.add(num_decoding, seconds)
        self.policy.record_delivered(num_decoding, num_decoding, seconds, False)

    def _overlapped(self, num_tokens: int, num_decoding: int) -> None:
        """Plain steps of this size overlap: what lone plain steps measured no longer stands for them."""
        if num_tokens not in self.overlapped_sizes:
            self.overlapped_sizes.add(num_tokens)
            self.policy.forward.forget(num_tokens)
            self.policy.delivered_plain.forget(num_decoding)

    def _room(self, seq) -> int:
        """Drafts beyond max_tokens or the context window could never be committed."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return room

    def _acceptance(self, seq, source: str = MODEL, width: int | None = None) -> SequenceAcceptance:
        key = (id(seq), source, width)
        if key not in self.acceptance:
            overall = self.overall_width.get((source, width), self.overall[source])
            self.acceptance[key] = overall.prior()
        return self.acceptance[key]

    def observe(self, seq, start: int, features) -> None:
        if id(seq) in self.missing:
            return  # its queue must stay contiguous: the catch-up recomputes these positions too
        self.proposer.observe(seq, start, features)

    def record(self, seq, num_drafts: int, num_accepted: int, chain: tuple[int, int] | None = None) -> None:
        """A verify of num_drafts drafts (a tree's: its depth) accepted num_accepted; chain: a tree's
        (nodes, accepted nodes) along its top-1 chain, which is what a chain of that many drafts would
        have accepted: the chain's record stays current while trees are drafted."""
        source, width = self.source.pop(id(seq), (MODEL, None))
        self.step_accepted += num_accepted
        self._acceptance(seq, source, width).update(num_drafts, num_accepted)
        self.overall[source].update(num_drafts, num_accepted)
        if (source, width) in self.overall_width:
            self.overall_width[(source, width)].update(num_drafts, num_accepted)
            if width is not None and chain is not None:
                self._acceptance(seq, source, None).update(*chain)
                self.overall_width[(source, None)].update(*chain)
        self.policies[source].record_width(width)
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
        self.source.pop(id(seq), None)
        # Positions never captured stay without drafter K/V: a later prompt sharing these blocks
        # through the prefix cache drafts from a context with holes (acceptance only).
        self.missing.pop(id(seq), None)
        self.proposer.release(seq, finished)
        if self.lookup is not None:
            self.lookup.release(seq, finished)
        if finished:
            for source, policy in self.policies.items():
                for width in policy.widths:
                    self.acceptance.pop((id(seq), source, width), None)
