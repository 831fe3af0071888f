"""Adaptive draft length: speculate as far as measured costs and acceptance make it pay."""
from __future__ import annotations

import pytest

from lucebox import LLM, SamplingParams
from lucebox.spec.adaptive import (MAX_PROBE_INTERVAL, MIN_REALIZED, PLAIN_STRETCH, PROBE_BUDGET, PROBE_EVERY,
                                   REEVALUATE_PLAIN_EVERY, REMEASURE_PLAIN_EVERY,
                                   DraftLengthPolicy, SequenceAcceptance, TimingTable, expected_tokens)

from tests.spec_fixtures import write_dflash_drafter


def policy_with(forward_per_token: float, forward_fixed: float, draft_cost: float, max_k: int = 8):
    policy = DraftLengthPolicy(max_k)
    for _ in range(2):  # a size's first sample is provisional (a warm-up's); two settle it
        for tokens in (1, 4, 9):
            policy.forward.add(tokens, forward_fixed + forward_per_token * tokens)
        for k in (1, max_k):  # the lengths a policy measures before judging any
            policy.draft.add(k, draft_cost)
    return policy


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_cheap_verify_and_good_drafts_speculate_fully():
    # Memory-bound target: a wider forward costs almost nothing more.
    policy = policy_with(forward_per_token=0.0001, forward_fixed=0.01, draft_cost=0.001)
    assert policy.choose([0.9], batch_tokens=0) == 8


def test_poor_acceptance_falls_back_to_plain_decoding():
    policy = policy_with(forward_per_token=0.002, forward_fixed=0.01, draft_cost=0.004)
    assert policy.choose([0.05], batch_tokens=0) == 0


def test_a_stale_slow_plain_step_does_not_keep_useless_drafts_on():
    """One plain step measured during a load spike must not make wider verify forwards look cheaper
    than plain decoding: with acceptance near zero, the policy decodes plainly."""
    policy = DraftLengthPolicy(4)
    policy.forward.add(1, 0.050)  # the spike, never re-measured while speculating
    for tokens in (2, 3, 5):
        policy.forward.add(tokens, 0.010)
    for k in (1, 4):
        policy.draft.add(k, 0.001)
    assert policy.choose([0.01], 0) == 0


def test_plain_decoding_is_measured_before_speculating_and_probes_come_back():
    policy = DraftLengthPolicy(4)
    assert policy.choose([0.9], 0) == 0  # nothing measured: the baseline first
    # A cheap drafter with poor acceptance: plain decoding, with probes now and then.
    poor = policy_with(forward_per_token=0.001, forward_fixed=0.01, draft_cost=0.0001, max_k=4)
    choices = [poor.choose([0.05], 0) for _ in range(PROBE_EVERY)]
    assert choices.count(0) == PROBE_EVERY - 1 and choices[-1] > 0
    # Probes that keep failing back off: the next one comes after twice as many plain steps.
    later = [poor.choose([0.05], 0) for _ in range(2 * PROBE_EVERY)]
    assert later.count(0) == 2 * PROBE_EVERY - 1 and later[-1] > 0


def test_an_expensive_drafter_is_probed_within_the_probe_budget():
    """A draft costing as much as several plain steps is probed so rarely that the probes take at
    most PROBE_BUDGET of the plain decoding time."""
    plain_cost, draft_cost = 0.011, 0.05
    slow = policy_with(forward_per_token=0.01, forward_fixed=0.001, draft_cost=draft_cost, max_k=4)
    choices = [slow.choose([0.1], 0) for _ in range(2000)]
    probes = [i for i, k in enumerate(choices) if k]
    assert probes, "never probed"
    extra = [draft_cost + 0.01 * choices[i] for i in probes]  # the draft and the wider forward's extra
    assert sum(extra) <= PROBE_BUDGET * plain_cost * len(choices) * 1.01
    assert probes[0] >= extra[0] / (PROBE_BUDGET * plain_cost) - 1


def test_a_dormant_drafters_catch_up_and_the_step_after_count_in_the_probe_budget():
    """Before a dormant drafter's probe drafts, its missed taps are recomputed, and after its verify
    the next step runs in turn (overlapped decoding cannot launch it ahead): both are part of what
    a probe costs, so probes come further apart when they are large."""
    def first_probe(catch_up: float, in_turn: float = 0.0) -> int:
        policy = policy_with(forward_per_token=0.01, forward_fixed=0.001, draft_cost=0.002, max_k=4)
        if catch_up:
            policy.record_catch_up(catch_up)
        for _ in range(2 if in_turn else 0):
            policy.in_turn.add(1, in_turn)
        return next(i for i in range(5000) if policy.choose([0.1], 0))
    plain_cost, extra = 0.011, 0.002 + 0.01  # the draft and the wider forward's extra (k = 1 is the probe)
    assert first_probe(0.0) == pytest.approx(extra / (PROBE_BUDGET * plain_cost), abs=1)
    assert first_probe(0.05) == pytest.approx((extra + 0.05) / (PROBE_BUDGET * plain_cost), abs=1)
    assert first_probe(0.0, plain_cost + 0.02) == pytest.approx((extra + 0.02) / (PROBE_BUDGET * plain_cost), abs=1)

def test_plain_decoding_of_an_unchanged_batch_is_not_re_evaluated_every_step():
    """Each evaluation is Python arithmetic over the cost tables; on a fast GPU with a small model
    it would cost plain decoding a few percent. A changed batch is evaluated at once."""
    slow = policy_with(forward_per_token=0.01, forward_fixed=0.001, draft_cost=0.05, max_k=4)
    calls = []
    estimate = slow.forward.estimate
    slow.forward.estimate = lambda size: calls.append(size) or estimate(size)
    steps = PROBE_EVERY - 2
    assert [slow.choose([0.1], 0) for _ in range(steps)] == [0] * steps
    # An evaluation estimates the plain step, every candidate and the probe's forward.
    assert len(calls) == -(-steps // REEVALUATE_PLAIN_EVERY) * (2 + len(slow.candidates))
    calls.clear()
    assert slow.choose([0.1], 4) == 0 and calls  # a prefill chunk joined the batch: evaluated
    fast = policy_with(forward_per_token=0.0001, forward_fixed=0.01, draft_cost=0.001)
    assert fast.choose([0.1], 0) == 0 and fast.choose([0.95], 0) == 8  # acceptance changed: evaluated


def test_a_run_of_plain_steps_is_predicted_before_the_tokens_are_known():
    """plain_run(): what overlapped decoding asks before launching the next steps. Over a vetoed
    drafter's steps, a run of k means the next k choices are plain (never past a probe), and
    advance_plain(k) leaves the policy as those k choices would; runs cover most steps."""
    import copy
    slow = policy_with(forward_per_token=0.01, forward_fixed=0.001, draft_cost=0.05, max_k=4)
    covered = steps = 0
    while steps < 4 * MAX_PROBE_INTERVAL:
        run = slow.plain_run()
        if run:
            promised = copy.deepcopy(slow)
            promised.advance_plain(run)
            assert [slow.choose([0.1], 0) for _ in range(run)] == [0] * run
            assert vars(promised).keys() == vars(slow).keys()
            for name in ("plain_steps", "stretch", "next_probe", "probe_interval", "exploring", "plain_query"):
                assert getattr(promised, name) == getattr(slow, name), name
            covered, steps = covered + run, steps + run
        elif slow.choose([0.1], 0):  # a probe's outcome: re-evaluated afresh next step
            slow.record_delivered(1, 1, 0.06, drafted=True)
            steps += 1
        else:
            steps += 1
    assert covered > 0.97 * steps
    assert DraftLengthPolicy(4, adaptive=False).plain_run() == 0


def simulate(policy: DraftLengthPolicy, steps: int, alpha: float, forward, draft) -> list[int]:
    """The engine's loop around a policy: choose, then record the step's measured costs."""
    chosen = []
    for _ in range(steps):
        k = policy.choose([alpha], 0)
        policy.forward.add(1 + k, forward(1 + k))
        if k:
            policy.draft.add(k, draft(k))
        chosen.append(k)
    return chosen


def test_long_drafts_that_pay_are_found_when_a_verify_costs_a_step_more_than_plain():
    """On a fast GPU a verify costs about one step more than a plain step (sampling and acceptance
    of its rows), whatever its width. A line through the two narrowest forwards would price 9
    tokens at 9 steps and keep this drafter (one pass for any length, 80% acceptance) off; measured
    at the longest draft first, it runs at full length."""
    policy = DraftLengthPolicy(8)
    chosen = simulate(policy, 200, 0.8, forward=lambda t: 0.010 if t == 1 else 0.018 + 0.0001 * t,
                      draft=lambda k: 0.002)
    # plain (a stretch), then the longest and the shortest draft, each measured twice
    assert chosen[:PLAIN_STRETCH + 4] == [0] * PLAIN_STRETCH + [8, 8, 1, 1]
    assert set(chosen[-100:]) == {0, 8} and chosen[-100:].count(8) >= 100 - 2 * PLAIN_STRETCH  # and remeasures


def test_a_draft_model_whose_cost_grows_with_k_settles_between_the_ends():
    policy = DraftLengthPolicy(8)
    chosen = simulate(policy, 200, 0.7, forward=lambda t: 0.010 + 0.0002 * t, draft=lambda k: 0.003 * k)
    rates = {k: expected_tokens(0.7, k) / (0.010 + 0.0002 * (1 + k) + 0.003 * k) for k in policy.candidates}
    assert max(set(chosen[-50:]), key=chosen[-50:].count) == max(rates, key=rates.get)


def test_a_warm_up_step_does_not_stand_for_the_plain_cost():
    """The first plain step pays a CUDA graph capture: 100x its cost. Taken at face value, any
    drafter would look worth it; the policy measures plain decoding again first."""
    policy = DraftLengthPolicy(4)
    policy.forward.add(1, 0.1)  # capture + step
    assert policy.choose([0.3], batch_tokens=0) == 0  # measure plain again
    policy.forward.add(1, 0.001)
    assert policy.forward.estimate(1) == 0.001  # the warm-up sample is gone, not averaged in
    for _ in range(2):
        for k in (1, 4):
            policy.forward.add(1 + k, 0.0011)
            policy.draft.add(k, 0.002)  # a drafter slower than the target step
    assert policy.choose([0.3], batch_tokens=0) == 0


def test_plain_decoding_is_remeasured_while_speculating():
    """The baseline must not go stale: a stretch of PLAIN_STRETCH plain steps after every
    REMEASURE_PLAIN_EVERY speculated ones, the engine told ahead (plain_run) so they overlap."""
    policy = policy_with(forward_per_token=0.0001, forward_fixed=0.01, draft_cost=0.001)
    chosen, ahead = [], []
    for _ in range(3 * REMEASURE_PLAIN_EVERY):
        ahead.append(policy.plain_run() > 0)
        chosen.append(policy.choose([0.9], batch_tokens=0))
    stretch = slice(REMEASURE_PLAIN_EVERY, REMEASURE_PLAIN_EVERY + PLAIN_STRETCH)
    assert chosen.count(0) == 2 * PLAIN_STRETCH and chosen[stretch] == [0] * PLAIN_STRETCH
    assert set(chosen) == {0, 8} and ahead[stretch] == [False] + [True] * (PLAIN_STRETCH - 1)
    assert sum(ahead) == 2 * (PLAIN_STRETCH - 1)


def test_overlapped_plain_steps_are_the_baseline(hf_models):
    """Plain decoding costs what a run of overlapped steps costs: once plain steps of a size have
    overlapped, they replace what lone plain steps measured, and lone ones are no longer recorded;
    drafted steps are recorded as before."""
    from lucebox.spec.ngram import NgramProposer
    from lucebox.spec.speculator import Speculator
    spec = Speculator(NgramProposer(3), 4, 1000)
    policy = spec.policy

    def step(seconds, drafted=0, overlapped=False):
        spec.step_decoding, spec.step_drafted, spec.step_accepted = 1, drafted, drafted
        spec.step_sources = spec.step_chose = {"model"} if drafted else set()
        spec.record_step(1 + drafted, seconds, overlapped)
    for _ in range(3):
        step(0.010)
    assert policy.forward.estimate(1) == 0.010
    step(0.006, overlapped=True)
    step(0.010)  # a lone plain step: not what plain decoding costs any more
    step(0.006, overlapped=True)
    assert policy.forward.estimate(1) == 0.006 and policy.delivered_plain.seconds_per_token(1) == 0.006
    step(0.012, drafted=3)
    assert policy.forward.estimate(4) == 0.012 and policy.delivered.steps(1) == 1


def test_acceptance_estimate_tracks_recent_steps():
    acc = SequenceAcceptance()
    for _ in range(30):
        acc.update(4, 4)
    high = acc.alpha
    for _ in range(30):
        acc.update(4, 0)
    assert high > 0.9 and acc.alpha < 0.2


def test_timing_table_interpolates_between_measured_sizes():
    table = TimingTable()
    table.add(2, 1.0)
    table.add(10, 3.0)
    assert table.estimate(6) == pytest.approx(2.0)
    assert table.estimate(14) == pytest.approx(4.0)
    assert table.estimate(1) == pytest.approx(1.0)


def test_a_useless_drafter_is_mostly_switched_off(hf_models, tmp_path):
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "d")
    llm = LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter)})
    out = llm.generate({"prompt_token_ids": list(range(40, 60))},
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    # A random drafter is almost never right; after the first probes it drafts only now and then.
    assert out.metrics.num_accepted_tokens <= out.metrics.num_drafts
    assert 1 <= out.metrics.num_drafts <= 100 // 6


def test_new_sequences_start_from_the_engine_wide_acceptance():
    overall = SequenceAcceptance(decay=0.99)
    for _ in range(50):
        overall.update(4, 0)
    fresh = overall.prior()
    assert fresh.alpha == pytest.approx(overall.alpha) and fresh.alpha < 0.1
    assert fresh.accepted + fresh.rejected == pytest.approx(3.0)  # a light prior the sequence soon outweighs


def test_with_lookup_first_a_useless_drafter_is_switched_off_on_its_own_record(hf_models, tmp_path):
    """n-gram lookups and the drafter keep separate acceptance: the random drafter stops drafting
    while the (free) lookups of the repeated prompt go on, and the output stays plain greedy."""
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "d")
    prompt = {"prompt_token_ids": list(range(40, 60)) * 3}
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    plain = LLM(str(target)).generate(prompt, params, use_tqdm=False)[0]
    llm = LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter), "ngram_first": True})
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    steps = llm.engine.speculator.steps_by_source
    print(f"\nsequence-steps drafted: {steps}")
    assert steps["lookup"] >= 1
    assert 1 <= steps["model"] <= 100 // 6


def test_drafting_that_delivered_slower_than_plain_decoding_is_vetoed_to_probes():
    """The model says drafting pays (cheap verify, high alpha) but drafted steps have measured more
    seconds per committed token than plain steps: only probes draft. Probes that deliver fast tokens
    lift the veto."""
    policy = policy_with(forward_per_token=0.0001, forward_fixed=0.01, draft_cost=0.001)
    assert policy.choose([0.9], 0) == 8
    for _ in range(MIN_REALIZED):
        policy.record_delivered(1, 1, 0.010, drafted=False)
        policy.record_delivered(1, 2, 0.030, drafted=True)  # 15 ms a token against 10
    choices = [policy.choose([0.9], 0) for _ in range(4 * PROBE_EVERY)]
    assert 1 <= sum(k > 0 for k in choices) <= 3  # probes only
    for _ in range(8):  # probes that committed 9 tokens in 12 ms
        policy.record_delivered(1, 9, 0.012, drafted=True)
    assert policy.choose([0.9], 0) == 8
    # A different batch size has its own record: one sequence's losses do not veto two.
    assert not policy.drafting_loses(2)


def test_bursty_acceptance_is_judged_by_the_tokens_it_delivered():
    """Drafted steps committing 1 then 9 tokens in 1 ms each deliver 0.2 ms a token, faster than
    plain steps at 0.5 ms: no veto (an average of per-step ratios, 0.56 ms, would veto them)."""
    policy = policy_with(forward_per_token=0.0001, forward_fixed=0.01, draft_cost=0.001)
    for i in range(4 * MIN_REALIZED):
        policy.record_delivered(1, 1, 0.0005, drafted=False)
        policy.record_delivered(1, 1 if i % 2 else 9, 0.001, drafted=True)
    assert policy.delivered.seconds_per_token(1) < 0.0003
    assert not policy.drafting_loses(1)


def test_steps_that_only_measured_a_length_do_not_count_for_the_veto():
    """Measuring the shortest length (a fixed drafting cost for one or two tokens) delivers slower
    than plain decoding; that is no evidence against the lengths the model picks, so no veto."""
    policy = DraftLengthPolicy(8)
    for _ in range(2):
        for tokens in (1, 4, 9):
            policy.forward.add(tokens, 0.01 + 0.0001 * tokens)
        policy.draft.add(8, 0.001)  # the longest measured, the shortest not yet
    for _ in range(MIN_REALIZED):
        policy.record_delivered(1, 1, 0.010, drafted=False)
    assert policy.choose([0.9], 0) == 1 and policy.exploring
    for _ in range(2 * MIN_REALIZED):
        policy.record_delivered(1, 2, 0.050, drafted=True)  # 25 ms a token against plain's 10
    assert not policy.drafting_loses(1)


def test_a_one_off_stall_does_not_veto_drafting_but_a_lasting_slowdown_does():
    """Drafted steps deliver 0.2 ms a token against plain's 0.5 ms; one drafted step stalls 200 ms
    (a host hiccup, a compile): clipped to a few mean steps, it does not veto drafting. Drafted
    steps that stay slow (2 ms a token) still do, within a few dozen steps."""
    policy = policy_with(forward_per_token=0.0001, forward_fixed=0.01, draft_cost=0.001)
    for _ in range(4 * MIN_REALIZED):
        policy.record_delivered(1, 1, 0.0005, drafted=False)
        policy.record_delivered(1, 5, 0.001, drafted=True)
    policy.record_delivered(1, 5, 0.200, drafted=True)
    assert not policy.drafting_loses(1)
    for _ in range(30):
        policy.record_delivered(1, 5, 0.010, drafted=True)
    assert policy.drafting_loses(1)


def test_the_speculator_records_what_drafted_and_plain_steps_delivered(hf_models, monkeypatch):
    """Every decode-only step feeds the delivered tables: plain steps one token a sequence, drafted
    steps their accepted drafts too, and a step whose policy chose to draft counts as drafting's
    even when the n-gram proposer found nothing; the record adds up to the request's own metrics."""
    llm = LLM(str(hf_models["qwen3"]), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 2})
    calls, empty = [], []
    monkeypatch.setattr(DraftLengthPolicy, "record_delivered",
                        lambda self, n, committed, seconds, drafted: calls.append((n, committed, drafted)))
    proposer = llm.engine.speculator.proposer
    propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda seqs, ks: (
        drafts := propose(seqs, ks), empty.append(not any(d.tokens for d in drafts)))[0])
    out = llm.generate({"prompt_token_ids": list(range(40, 50)) * 3 + [7, 8, 9, 10]},
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    drafted = [(n, c) for n, c, d in calls if d]
    assert len(drafted) == out.metrics.num_drafts + sum(empty) and out.metrics.num_drafts >= 1 and any(empty)
    assert sum(c - n for n, c in drafted) == out.metrics.num_accepted_tokens >= 1
    assert all(n == 1 and c == 1 for n, c, d in calls if not d)
    assert sum(c for _, c, _ in calls) == 40 - 1  # every token but the prefill's
