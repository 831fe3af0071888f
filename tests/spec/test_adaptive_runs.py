"""The adaptive draft-length policy and runs of plain steps: a lookup or dormant drafter that found nothing
is guessed plain for a run of steps, which every policy counts and times as plain decoding."""
from __future__ import annotations

from lucebox import SamplingParams
from tests.spec.test_adaptive import policy_with


def _decoding_sequences(count: int) -> list:
    from lucebox.engine.sequence import Sequence
    seqs = [Sequence("r", i, [3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=100)) for i in range(count)]
    for seq in seqs:
        seq.num_computed = seq.num_tokens - 1
    return seqs


def test_a_lookup_binds_a_run_of_plain_steps_only_in_one_itself_and_is_guessed_plain_when_it_found_nothing():
    """Speculator.plain_run and guesses_plain, asked before the new tokens are known: a run binds
    only as long as every policy (the lookup's too) is in a run of plain steps, and only for the
    batch last evaluated; the lookup reads the new tokens, so otherwise a step is guessed plain
    while the drafter's policy decodes plainly and the lookup found nothing this step."""
    from lucebox.spec.ngram import NgramProposer
    from lucebox.spec.speculator import LOOKUP, Speculator
    spec = Speculator(NgramProposer(3), 4, 1000, lookup=NgramProposer(3))
    seqs = _decoding_sequences(2)
    spec.evaluated = list(seqs)
    spec.policy.stretch = 2  # the drafter's policy measuring plain decoding
    spec.step_found = False
    assert spec.plain_run(seqs) == 0 and spec.guesses_plain(seqs)
    assert not spec.guesses_plain(seqs[:1])  # not the batch its policies evaluated
    spec.step_found = True
    assert not spec.guesses_plain(seqs)
    spec.policies[LOOKUP].stretch = 3
    assert spec.plain_run(seqs[:1]) == 0
    assert spec.plain_run(seqs) == 2  # the shorter run, counted by both policies at once
    assert spec.policy.stretch == 0 and spec.policies[LOOKUP].stretch == 1
    assert spec.plain_run(seqs) == 0 and not spec.guesses_plain(seqs)


def test_a_drafter_that_had_nothing_is_guessed_plain_and_asked_again(monkeypatch):
    """A drafter asked to draft that came back empty (n-gram lookup without a match) gets the next
    step launched ahead on a guess: unlike a run its policy promises, the guess binds nothing, and
    the next step asks the drafter again (a match then drafts, and the launched step goes unused)."""
    from lucebox.spec.ngram import NgramProposer
    from lucebox.spec.speculator import MODEL, Speculator
    spec = Speculator(NgramProposer(3), 4, 1000)
    seqs = _decoding_sequences(1)
    spec.evaluated = list(seqs)
    spec.step_chose, spec.step_sources = {MODEL}, set()  # asked, nothing came back
    assert spec.plain_run(seqs) == 0 and spec.guesses_plain(seqs)
    asked = []
    monkeypatch.setattr(spec, "_choose", lambda *a: asked.append(a) or 0)
    spec.choose(seqs)
    spec.propose()
    assert asked  # evaluated
    spec.step_chose = set()  # plain by choice, not in a run of plain steps: no guess
    assert not spec.guesses_plain(seqs)


def test_a_promised_run_is_counted_by_every_policy_and_timed_as_plain_decoding():
    """The steps of a run plain_run() promised cost the host nothing (the engine does not call the
    speculator for them), yet every policy counts them as the plain steps choose() would have
    returned, so probes come when they would have; their mean time, reported once, is plain
    decoding's cost at that size, as an overlapped plain step's would be."""
    from lucebox.spec.ngram import NgramProposer
    from lucebox.spec.speculator import Speculator
    spec = Speculator(NgramProposer(3), 4, 1000, lookup=NgramProposer(3))
    seqs = _decoding_sequences(1)
    spec.choose(seqs)  # evaluated
    spec.propose()
    assert spec.evaluated == seqs
    for policy, probe in zip(spec.policies.values(), (10, 20)):  # in runs of plain steps
        policy.plain_query, policy.plain_steps, policy.next_probe, policy.stretch = ([0.1], 0), 3, probe, 0
    assert spec.plain_run(seqs) == 6  # the drafter's probe is 7 steps away: 6 plain steps before it
    assert [p.plain_steps for p in spec.policies.values()] == [9, 9]
    assert spec.plain_run(seqs) == 0 and spec.policy.plain_run() == 0  # the drafter's probe is next
    spec.policy.forward.add(1, 0.004)  # a lone plain step, before any overlapped
    spec.record_plain_steps(1, 0.001)
    assert spec.policy.forward.estimate(1) == 0.001 and 1 in spec.overlapped_sizes
    assert spec.policy.delivered_plain.seconds_per_token(1) == 0.001


def test_a_lookup_with_nothing_to_probe_starts_its_plain_run_over():
    """A vetoed lookup's probe waits for a match; instead of looking up every step until one comes
    (most of what a lookup costs), a due probe that finds nothing starts the run of plain steps over."""
    slow = policy_with(forward_per_token=0.01, forward_fixed=0.001, draft_cost=0.05, max_k=4)
    while slow.plain_run() or slow.plain_query is None:
        assert slow.choose([0.1], 0) == 0
    due = slow.plain_steps
    assert due + 1 >= slow.next_probe
    slow.nothing_to_probe()
    assert slow.plain_steps == 0 and slow.plain_run()
    slow.plain_steps = 3
    slow.nothing_to_probe()  # not due: nothing changes
    assert slow.plain_steps == 3
