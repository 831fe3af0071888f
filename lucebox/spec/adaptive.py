"""Adaptive draft length: speculate only as far as it pays, from measured costs and acceptance.

Each sequence's drafts are modelled as accepted independently with probability alpha until the
first rejection, so k drafts commit E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per step. A step
costs the measured draft time plus the measured rest of an engine step for the batch's token count
(scheduling, the target forward, sampling or verification, building the outputs: all of it, since
on a fast GPU the host's share of a step can outweigh the forward itself).
The step's k maximises committed tokens per second over the batch; k = 0 is plain decoding. Costs
are measured at the longest and the shortest draft first and interpolated between. When plain
decoding wins, the most promising length is re-tried now and then, so a sequence whose text
turns predictable (a quoted file, a repeated block) gets speculation back.

The model can be wrong where its inputs are (bursty acceptance at high temperature makes alpha
swing; a cost table holds few samples of a width), so what drafting delivered is measured too:
seconds per committed token of the steps a source drafted, against plain decoding steps of the
same number of sequences. While drafting has measured slower, only probes draft (and their
outcomes can lift the veto): speculation must not make a request slower than plain decoding.

Widths (draft trees, spec/tree.py): a drafter that builds DDTrees drafts either a chain (width None)
or a tree of one of the budgets in `widths`; each width has its own acceptance (alpha per depth,
measured on its own verifies: a tree of depth k accepts more than a chain of k), its own draft costs
(building a tree costs host time) and its own delivered rate, and a tree row of depth k is priced at
its node count, 1 + tree_nodes(budget, k), on the forward-cost table keyed by the step's tokens:
the measured verify cost per node count. (On a MoE target that cost already includes the extra
experts a wide verify routes to: the table measures whole steps.) The step's (width, k) is the one
of most committed tokens per second, plain decoding included, a tree's discounted by TREE_MARGIN;
a tree verify also tells what the chain of its depth would have accepted (its top-1 chain is
seeded first), so the chain's acceptance stays current while trees run. A tree width whose
drafted steps have delivered tokens slower than chains' (per committed token, same batch) is left
out while that holds. Simulated, trees then never cost more than 5% against the best of plain and
chain (tests/spec/test_adaptive_trees.py).
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort

from .tree import tree_nodes

PRIOR_ACCEPTED, PRIOR_REJECTED = 2.0, 1.0  # a mild prior: alpha = 2/3 before any evidence
DECAY = 0.9  # recent steps weigh more: acceptance drifts as the text changes
PROBE_EVERY = 16  # steps of plain decoding before the first probe with drafts
MAX_PROBE_INTERVAL = 512  # probes that keep failing back off (doubling) up to this many steps
# ... and, whatever the interval, a probe's extra cost (its draft, its wider forward, recomputing the
# taps a dormant drafter missed) may take at most this share of the plain decoding time between
# probes: a drafter pass that costs as much as ten plain steps (a small target on a fast GPU) is
# probed ten times more rarely. 1%: of the 5% that speculation may cost plain decoding, the rest is
# the host's bookkeeping and the bench's noise (bench spec --repeats 15, H200, 2026-12-03).
PROBE_BUDGET = 0.01
REMEASURE_PLAIN_EVERY = 64  # while speculating, a plain stretch after this many steps keeps the baseline fresh
# Plain decoding is measured over this many consecutive steps (the baseline first, then each
# remeasure): with overlapped decoding (EngineArgs.async_decode) a lone plain step pays the host's
# whole turn, while a run of them hides it behind the GPU -- 30-60% faster on a small target. What a
# run's overlapped steps cost is the baseline; a lone plain step's cost is not (Speculator.record_step).
PLAIN_STRETCH = 4
# While decoding plainly with unchanged acceptance and batch, the choice is re-evaluated only every
# this many steps (and at each probe): an evaluation is ~12 us of Python on a fast CPU, ~3x that on
# the H200 machine's host, against a small model's 300 us step. (What it re-reads between probes
# is the step-cost tables, which drift slowly; a changed batch or acceptance re-evaluates at once.)
REEVALUATE_PLAIN_EVERY = 32
DELIVERED_DECAY = 0.9  # per step, of the sums behind seconds per committed token
MIN_REALIZED = 4  # drafted steps measured before what they delivered can veto the model's choice
STALL_CLIP = 3.0  # a step counts for at most this many mean steps in what was delivered
MIN_WIDTH_STEPS = 4  # verifies of a width measured (its acceptance) before the model judges it
TREE_BUDGETS = (8, 16, 32)  # the tree budgets tried below the configured one
# A tree must promise this much more than chains and plain steps to be chosen: its acceptance is
# estimated from few recent verifies, and the best of several noisy estimates is biased upwards
# (tests/spec/test_adaptive_trees.py simulates trees that accept no deeper than the chain).
TREE_MARGIN = 0.05


class TimingTable:
    """EMA of a duration keyed by an integer size; unseen sizes interpolate linearly between
    the nearest seen ones (or extrapolate from the two nearest). The first sample of a size is
    provisional and the second replaces it: a size's first step pays one-off costs (a CUDA graph
    capture, kernel compilation) that can be a hundred times the step's real cost."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing = smoothing
        self.values: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.sizes: list[int] = []  # the keys of values, sorted

    def add(self, size: int, seconds: float) -> None:
        n = self.counts.get(size, 0)
        if n == 0:
            insort(self.sizes, size)
        self.counts[size] = n + 1
        old = self.values.get(size)
        self.values[size] = seconds if n < 2 else old + self.smoothing * (seconds - old)

    def forget(self, size: int) -> None:
        """Drop what was measured for `size` (its samples no longer stand for what it costs)."""
        if self.counts.pop(size, 0):
            del self.values[size]
            self.sizes.remove(size)

    def provisional(self, size: int) -> bool:
        """Measured once only: the value may be a warm-up's."""
        return self.counts.get(size, 0) == 1

    def settled(self, size: int) -> bool:
        return self.counts.get(size, 0) >= 2

    def settled_at_or_above(self, size: int) -> bool:
        """Some size >= `size` is settled: estimates up to it interpolate, never extrapolate."""
        return any(self.counts[key] >= 2 for key in self.sizes[bisect_left(self.sizes, size):])

    def estimate(self, size: int) -> float | None:
        value = self.values.get(size)
        if value is not None:
            return value
        keys = self.sizes
        if not keys:
            return None
        i = bisect_left(keys, size)
        if i == 0:
            return self.values[keys[0]]  # no extrapolation downwards: smaller is not cheaper than measured
        if i == len(keys):
            # Upwards, grow with the slope of the two largest sizes, never shrink: noise must not
            # make a wider forward look cheaper than a measured narrower one.
            if len(keys) == 1:
                return self.values[keys[-1]]
            a, b = keys[-2], keys[-1]
            slope = max(0.0, (self.values[b] - self.values[a]) / (b - a))
            return self.values[b] + slope * (size - b)
        a, b = keys[i - 1], keys[i]
        return self.values[a] + (self.values[b] - self.values[a]) * (size - a) / (b - a)


class DeliveredRate:
    """Seconds per committed token by batch size (sequences decoding in the step), from decayed sums
    of seconds and of tokens: a ratio of sums, so a step weighs as many tokens as it committed. (An
    average of per-step ratios would punish bursty acceptance: a 1-token and a 9-token step of 1 ms
    each deliver 0.2 ms a token, not the 0.56 ms their ratios average to.)

    Once MIN_REALIZED steps are in, a step counts for at most STALL_CLIP times the mean step: a
    one-off stall (a host hiccup, a compile) would otherwise sit in the sums of drafted steps for as
    long as few drafted steps follow -- under a veto, only probes, so thousands of steps. A lasting
    slowdown still shows: each slow step raises the mean it is clipped against."""

    def __init__(self, decay: float = DELIVERED_DECAY):
        self.decay = decay
        self.sums: dict[int, list[float]] = {}  # batch size -> [seconds, tokens, steps, decayed steps]

    def add(self, num_seqs: int, committed: int, seconds: float) -> None:
        s = self.sums.setdefault(num_seqs, [0.0, 0.0, 0, 0.0])
        if s[2] >= MIN_REALIZED:
            seconds = min(seconds, STALL_CLIP * s[0] / s[3])
        s[0] = self.decay * s[0] + seconds
        s[1] = self.decay * s[1] + committed
        s[2] += 1
        s[3] = self.decay * s[3] + 1

    def forget(self, num_seqs: int) -> None:
        self.sums.pop(num_seqs, None)

    def seconds_per_token(self, num_seqs: int) -> float | None:
        s = self.sums.get(num_seqs)
        return s[0] / s[1] if s else None

    def steps(self, num_seqs: int) -> int:
        return int(self.sums[num_seqs][2]) if num_seqs in self.sums else 0


class SequenceAcceptance:
    def __init__(self, accepted: float = PRIOR_ACCEPTED, rejected: float = PRIOR_REJECTED, decay: float = DECAY):
        self.accepted, self.rejected, self.decay = accepted, rejected, decay

    def update(self, k: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < k else 0)

    def prior(self, weight: float = PRIOR_ACCEPTED + PRIOR_REJECTED) -> "SequenceAcceptance":
        """A new sequence starts from this (engine-wide) estimate, worth `weight` pseudo-steps: with
        a drafter that rarely hits, new requests should not each pay to rediscover it."""
        scale = weight / (self.accepted + self.rejected)
        return SequenceAcceptance(self.accepted * scale, self.rejected * scale)

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def tree_widths(budget: int | None) -> list[int | None]:
    """The widths a drafter of this configured tree budget chooses among: chains (None), then the
    TREE_BUDGETS below the budget, then the budget itself. None: chains only."""
    if budget is None:
        return [None]
    return [None, *sorted({b for b in TREE_BUDGETS if b < budget} | {budget})]


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class DraftLengthPolicy:
    def __init__(self, max_k: int, adaptive: bool = True, tree_budget: int | None = None):
        """tree_budget: the drafter builds trees of up to this many nodes (widths: tree_widths)."""
        self.max_k, self.adaptive = max_k, adaptive
        self.widths = tree_widths(tree_budget)
        self.width: int | None = self.widths[-1]  # of the last choice (None: a chain)
        self.forward = TimingTable()  # engine-step seconds besides drafting, by tokens in the batch
        # Plain steps run in turn where plain steps of their size also overlap (Speculator.record_step):
        # what a step costs that cannot overlap, the one after a verify.
        self.in_turn = TimingTable()
        self.drafts = {w: TimingTable() for w in self.widths}  # proposer seconds by draft length, per width
        self.draft = self.drafts[None]  # a chain's
        self.width_steps = dict.fromkeys(self.widths, 0)  # verifies of each width recorded
        self.plain_steps = 0
        self.speculated_steps = 0  # since the last plain step
        self.probe_interval = PROBE_EVERY
        self.plain_query = None  # (alphas, batch_tokens) of the last evaluation that chose plain decoding
        self.next_probe = PROBE_EVERY  # plain steps before the next probe: interval and budget allowing
        self.candidates = sorted({k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if k <= max_k} | {max_k})
        # Seconds per committed token as delivered, by decoding sequences in the step: of the steps
        # this source drafted, and of plain steps (one table shared by every source of an engine).
        self.delivered_by_width = {w: DeliveredRate() for w in self.widths}
        self.delivered = self.delivered_by_width[self.widths[-1]]  # the default width's
        self.delivered_plain = DeliveredRate()
        self.exploring = False  # the last choice measured a length rather than chose it
        self.stretch = 0  # plain steps still to come of a stretch measuring plain decoding
        self.catch_up = 0.0  # seconds a dormant drafter's catch-up took before its recent drafts (EMA)

    def row_tokens(self, k: int, width: int | None = -1) -> int:
        """Tokens a sequence's verify row brings for drafts of depth k: 1 + k for a chain, the pending
        token and the nodes for a tree of budget `width` (default: the widest width)."""
        width = self.widths[-1] if width == -1 else width
        return 1 + (k if width is None else tree_nodes(width, k))

    def record_width(self, width: int | None) -> None:
        """A verify of this width was judged (its acceptance is in the sequence's record of it)."""
        self.width_steps[width] = self.width_steps.get(width, 0) + 1

    def record_delivered(self, num_seqs: int, committed: int, seconds: float, drafted: bool,
                         width: int | None = -1) -> None:
        """A whole step (drafting included) of num_seqs decoding sequences committed `committed` tokens
        (drafted: at `width`, default the last choice's). Drafted steps that only measured a length
        (the shortest, whose fixed drafting cost buys one or two tokens) say nothing about the lengths
        the model picks, and are left out."""
        if drafted and self.exploring:
            return
        if drafted:
            self.plain_query = None  # new evidence on drafting (a probe's outcome): choose afresh next step
            width = self.width if width == -1 else width
            self.delivered_by_width[width].add(num_seqs, committed, seconds)
        else:
            self.delivered_plain.add(num_seqs, committed, seconds)

    def drafting_loses(self, num_seqs: int, width: int | None = -1) -> bool:
        """Drafted steps (of this width; default: the widest) of this many sequences have delivered
        tokens slower than plain steps."""
        delivered = self.delivered_by_width[self.widths[-1] if width == -1 else width]
        spec = delivered.seconds_per_token(num_seqs)
        plain = self.delivered_plain.seconds_per_token(num_seqs)
        return (spec is not None and plain is not None and delivered.steps(num_seqs) >= MIN_REALIZED
                and spec > plain)

    def tree_loses(self, width: int | None, num_seqs: int) -> bool:
        """Trees of this width have delivered tokens slower than chains (each over MIN_REALIZED steps
        of this many sequences): left out while that holds."""
        if width is None:
            return False
        tree, chain = self.delivered_by_width[width], self.delivered_by_width[None]
        return (tree.steps(num_seqs) >= MIN_REALIZED and chain.steps(num_seqs) >= MIN_REALIZED
                and tree.seconds_per_token(num_seqs) > chain.seconds_per_token(num_seqs))

    def record_catch_up(self, seconds: float) -> None:
        """Before a draft, the drafter's missed taps took `seconds` to recompute: part of a probe's cost."""
        self.catch_up += 0.3 * (seconds - self.catch_up) if self.catch_up else seconds

    def plain_run(self) -> int:
        """How many next choices are plain decoding, if the batch and its acceptance stay as they are:
        the rest of a stretch measuring plain decoding, or the plain steps short of the next probe
        (0: the next step may draft). The steps it answers for are then counted (advance_plain)
        without evaluating them."""
        if not self.adaptive:
            return 0
        if self.stretch:
            return self.stretch
        return max(0, self.next_probe - self.plain_steps - 1) if self.plain_query is not None else 0

    def advance_plain(self, steps: int = 1) -> None:
        """Plain steps that plain_run() foretold: choose()'s outcome without its evaluation (the
        batch and its acceptance are those the run was promised for)."""
        self.exploring = False
        measuring = min(steps, self.stretch)
        self.stretch -= measuring
        self.plain_steps += steps - measuring

    def nothing_to_probe(self) -> None:
        """This source's probe was due but it had nothing to propose (a lookup found no match): the
        run of plain steps starts over, rather than the source being consulted every step until it
        has something (what a lookup costs the host is most of a vetoed lookup's cost)."""
        due = self.plain_query is not None and self.plain_steps + 1 >= self.next_probe
        if self.adaptive and not self.stretch and due:
            self.plain_steps = 0

    def choose(self, alphas: list[float] | dict, batch_tokens: int) -> int:
        """One k for this step (and its width: self.width): `alphas` of the decoding sequences (a list,
        or per width a list), `batch_tokens` other new tokens."""
        self.exploring = False
        by_width = alphas if isinstance(alphas, dict) else dict.fromkeys(self.widths, alphas)
        alphas = by_width[self.widths[-1]]
        self.width = self.widths[-1]
        if not self.adaptive or not alphas:
            return self.max_k
        if self.stretch:
            self.stretch -= 1
            return 0
        if (self.plain_steps + 1 < self.next_probe and self.plain_steps % REEVALUATE_PLAIN_EVERY
                and self.plain_query == (alphas, batch_tokens)):
            self.plain_steps += 1  # plain decoding, as evaluated a few steps ago for this same batch
            return 0
        n = len(alphas)
        plain_cost = self.forward.estimate(batch_tokens + n)
        if (plain_cost is None or self.forward.provisional(batch_tokens + n)
                or self.speculated_steps >= REMEASURE_PLAIN_EVERY):
            # Plain decoding is the baseline speculation must beat: measured first, and again now and
            # then, since a stale baseline (a slow early step) would keep a losing drafter on.
            self.speculated_steps, self.stretch = 0, PLAIN_STRETCH - 1
            return 0
        for width in self.widths:
            unexplored = self._unexplored(batch_tokens, n, width)
            if unexplored:
                self.exploring, self.width = True, width
                return unexplored
        best_k, best_rate, probe_k, probe_rate = 0, n / plain_cost, 0, 0.0
        best_w = probe_w = self.widths[0]
        for width in self.widths:
            if self.tree_loses(width, n):
                continue
            draft = self.drafts[width]
            for k in self.candidates:
                size = batch_tokens + n * self.row_tokens(k, width)
                if self.forward.provisional(size) or draft.provisional(k):
                    self.exploring, self.width = True, width
                    return k  # measured once, maybe with a one-off cost (a graph capture): measure again
                # A wider forward never costs less than the plain step: without this floor, one slow
                # plain step (a load spike), never re-measured while speculation runs, would keep a
                # useless drafter on.
                rate = sum(expected_tokens(a, k) for a in by_width[width]) / (
                    max(self.forward.estimate(size), plain_cost) + draft.estimate(k))
                if width is not None:
                    rate /= 1 + TREE_MARGIN
                if rate > best_rate:
                    best_k, best_w, best_rate = k, width, rate
                if rate > probe_rate:
                    probe_k, probe_w, probe_rate = k, width, rate
        if best_k and self.drafting_loses(n, best_w):
            best_k = 0  # the model says it pays, the measurements say it has not: probes only
        if best_k == 0:
            # Probes re-try the most promising length now and then, so a text that turns predictable
            # gets speculation back. A drafter that keeps losing is re-tried ever more rarely, so the
            # probes themselves cannot make plain decoding measurably slower.
            # With overlapped decoding the step after a verify runs in turn: its extra counts too.
            in_turn = self.in_turn.estimate(batch_tokens + n)
            probe_size = batch_tokens + n * self.row_tokens(probe_k, probe_w)
            probe_cost = (self.drafts[probe_w].estimate(probe_k) + self.catch_up
                          + max(0.0, self.forward.estimate(probe_size) - plain_cost)
                          + max(0.0, (in_turn or plain_cost) - plain_cost))
            self.plain_query = (alphas, batch_tokens)
            self.next_probe = max(self.probe_interval, math.ceil(probe_cost / (PROBE_BUDGET * plain_cost)))
            self.plain_steps += 1
            if self.plain_steps >= self.next_probe:
                self.plain_steps = 0
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
                self.width = probe_w
                return probe_k
            return 0
        self.plain_steps, self.probe_interval, self.next_probe = 0, PROBE_EVERY, PROBE_EVERY
        self.speculated_steps += 1
        self.width = best_w
        return best_k

    def _unexplored(self, batch_tokens: int, n: int, width: int | None = None) -> int:
        """A draft length to measure before any is judged (0: none). The longest first, then the
        shortest, each until settled: the lengths between are interpolated from them. (Extrapolating
        from short drafts upwards would not do: a verify's extra cost over a plain step is mostly
        per step, not per token, so a line through the two narrowest forwards overprices wide ones,
        and a drafter whose long drafts pay would never be tried at length.) A tree width is also
        drafted (at the longest length) until MIN_WIDTH_STEPS of its verifies were judged: its
        acceptance is its own."""
        longest, shortest, draft = self.candidates[-1], self.candidates[0], self.drafts[width]
        if not (self.forward.settled_at_or_above(batch_tokens + n * self.row_tokens(longest, width))
                and draft.settled(longest)):
            return longest
        if not draft.settled(shortest):
            return shortest
        if width is not None and self.width_steps.get(width, 0) < MIN_WIDTH_STEPS:
            return longest
        return 0
