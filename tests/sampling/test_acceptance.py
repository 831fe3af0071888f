"""accept_batch: every verifying sequence of a step accepted at once, with one host transfer.

Greedy verdicts equal the per-sequence longest-matching-prefix rule; sampled verdicts follow the
exact distribution of lossless rejection sampling (so the first committed token follows p0);
seeded sequences do not depend on the rest of the batch."""
from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from lucebox.sampling import SamplingParams, acceptance
from lucebox.sampling.acceptance import Draft, Verdict, accept_batch, row_states
from lucebox.sampling.graph_rows import argmax_only, graph_row
from lucebox.sampling.sampler import Sampler, SamplingState

from tests.spec.test_spec import chi_square_rejects


@dataclass(eq=False)
class Seq:
    """What accept_batch reads of an engine Sequence."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def seeded(seed: int, **params) -> Seq:
    return Seq(SamplingParams(seed=seed, **params), generator=torch.Generator().manual_seed(seed))


def greedy_reference(sampler: Sampler, logits: torch.Tensor, seq: Seq, draft: Draft) -> Verdict:
    """The rule, one sequence at a time: accept while the draft is the target's argmax."""
    choice = sampler.process_logits(logits, row_states(seq, draft.tokens)).argmax(-1).tolist()
    a = 0
    while a < len(draft.tokens) and draft.tokens[a] == choice[a]:
        a += 1
    return Verdict(draft.tokens[:a] + [choice[a]], a)


def greedy_batch(rng: random.Random, vocab: int, num_seqs: int):
    """Greedy sequences (some with a repetition penalty, so each row's history matters) whose drafts
    follow the unpenalised argmax for a random stretch, then guess."""
    seqs, drafts, rows = [], [], []
    for _ in range(num_seqs):
        k = rng.randint(1, 6)
        logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        good = rng.randint(0, k)
        tokens = logits.argmax(-1).tolist()[:good] + [rng.randrange(vocab) for _ in range(k - good)]
        penalty = rng.choice([1.0, 1.0, 1.5])
        seqs.append(Seq(SamplingParams(temperature=0, repetition_penalty=penalty),
                        output_token_ids=[rng.randrange(vocab) for _ in range(3)]))
        drafts.append(Draft(tokens))
        rows.append(logits)
    return seqs, drafts, rows


def test_greedy_batch_equals_per_sequence_reference():
    rng, sampler = random.Random(0), Sampler(eos_token_ids=[0])
    for vocab in (5, 50):
        seqs, drafts, rows = greedy_batch(rng, vocab, num_seqs=40)
        verdicts = accept_batch(sampler, torch.cat(rows), seqs, drafts)
        assert verdicts == [greedy_reference(sampler, r, s, d) for r, s, d in zip(rows, seqs, drafts)]
        assert len({v.num_accepted for v in verdicts}) > 3  # prefixes of many lengths were exercised


def test_host_argmax_rule_equals_the_batch_rule_for_unprocessed_greedy_rows():
    """accept_argmax (the engine's path when the graph returns argmax tokens) against accept_batch."""
    rng, sampler = random.Random(2), Sampler()
    seqs, drafts, rows = greedy_batch(rng, 30, num_seqs=40)
    seqs = [Seq(SamplingParams(temperature=0)) for _ in seqs]  # nothing processes the logits
    logits = torch.cat(rows)
    assert all(argmax_only(s.params, 0) for s in seqs)
    verdicts = acceptance.accept_argmax(logits.argmax(-1).tolist(), drafts)
    assert verdicts == accept_batch(sampler, logits, seqs, drafts)
    assert len({v.num_accepted for v in verdicts}) > 3


@pytest.mark.parametrize("params", [dict(temperature=0.5), dict(temperature=0, repetition_penalty=1.2),
                                    dict(temperature=0, logit_bias={1: 5.0}), dict(temperature=0, logprobs=2),
                                    dict(temperature=0, min_tokens=3)])
def test_rows_whose_logits_are_processed_or_reported_are_not_argmax_only(params):
    assert not argmax_only(SamplingParams(**params), num_output=0)


def test_greedy_verdicts_do_not_change_in_a_mixed_batch():
    rng, sampler = random.Random(1), Sampler()
    seqs, drafts, rows = greedy_batch(rng, 20, num_seqs=12)
    alone = accept_batch(sampler, torch.cat(rows), seqs, drafts)
    mixed_seqs, mixed_drafts, mixed_rows, where = [], [], [], []
    for s, d, r in zip(seqs, drafts, rows):
        k = rng.randint(0, 4)  # a sampled neighbour, sometimes with no drafts (a plain decode row)
        q = torch.rand(k, 20).softmax(-1) if rng.random() < 0.5 else None
        mixed_seqs.append(Seq(SamplingParams(temperature=0.8)))
        mixed_drafts.append(Draft([rng.randrange(20) for _ in range(k)], q))
        mixed_rows.append(torch.randn(k + 1, 20))
        where.append(len(mixed_seqs))
        mixed_seqs.append(s), mixed_drafts.append(d), mixed_rows.append(r)
    verdicts = accept_batch(sampler, torch.cat(mixed_rows), mixed_seqs, mixed_drafts)
    assert [verdicts[i] for i in where] == alone
    for v, d in zip(verdicts, mixed_drafts):
        assert v.tokens[:v.num_accepted] == d.tokens[:v.num_accepted] and len(v.tokens) == v.num_accepted + 1


# ---------------------------------------------------------------------- sampling is lossless
VOCAB = 4
P = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3], [0.25, 0.25, 0.4, 0.1]], dtype=torch.float64)
Q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.2, 0.2, 0.5, 0.1]], dtype=torch.float64)
FIXED_DRAFTS = [3, 2]  # deterministic drafts: one-hot q


def exact_outcomes(p: torch.Tensor, q: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(committed tokens) when drafts are drawn from q (rows of one-hot q: fixed drafts), by the rule:
    accepted drafts x_i weigh min(p_i, q_i)(x_i); the last token is drawn from max(0, p_a - q_a)
    at the first rejection a, or from p_k after all k."""
    k = q.shape[0]
    out = {}
    for a in range(k + 1):
        last = p[a] if a == k else (p[a] - q[a]).clamp_min(0)
        for xs in itertools.product(range(VOCAB), repeat=a + 1):
            weight = last[xs[-1]]
            for i, x in enumerate(xs[:-1]):
                weight = weight * torch.minimum(p[i], q[i])[x]
            out[xs] = float(weight)
    return out


def one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).double()


@pytest.mark.parametrize("q", [Q, one_hot(FIXED_DRAFTS)], ids=["sampled-drafts", "fixed-drafts"])
def test_exact_distribution_has_the_target_first_token(q):
    first = Counter()
    for xs, prob in exact_outcomes(P, q).items():
        first[xs[0]] += prob
    assert [first[t] for t in range(VOCAB)] == pytest.approx(P[0].tolist())
    assert sum(exact_outcomes(P, q).values()) == pytest.approx(1.0)


SAMPLES = 3000


def sampled_batch(n: int):
    """A mixed batch: per trial a sequence with drafts sampled from Q and one with the fixed drafts
    (alternately seeded and on the global RNG), and a greedy one with a single draft."""
    torch.manual_seed(0)
    logits, drafter = P.float().log(), torch.Generator().manual_seed(1)  # not a sequence's seed: independent
    seqs, drafts, rows = [], [], []
    for i in range(n):
        sampled = torch.multinomial(Q.float(), 1, generator=drafter).squeeze(1).tolist()
        for tokens, probs in ((sampled, Q.float()), (FIXED_DRAFTS, None)):
            seqs.append(seeded(10_000 + i, temperature=1.0) if i % 2 else Seq(SamplingParams(temperature=1.0)))
            drafts.append(Draft(list(tokens), probs))
            rows.append(logits)
        seqs.append(Seq(SamplingParams(temperature=0)))
        drafts.append(Draft([3]))
        rows.append(logits[:2])
    return seqs, drafts, torch.cat(rows)


def committed(verdicts: list[Verdict], kind: int) -> Counter:
    return Counter(tuple(v.tokens) for v in verdicts[kind::3])


@pytest.fixture(scope="module")
def sampled_verdicts():
    seqs, drafts, logits = sampled_batch(SAMPLES)
    return accept_batch(Sampler(), logits, seqs, drafts)


@pytest.mark.parametrize("kind,q", [(0, Q), (1, one_hot(FIXED_DRAFTS))], ids=["sampled-drafts", "fixed-drafts"])
def test_sampled_verdicts_follow_the_exact_distribution(sampled_verdicts, kind, q):
    """Pearson's chi-square over every committed tuple (num_accepted, tokens), significance 1e-3."""
    rejected, stat, critical = chi_square_rejects(committed(sampled_verdicts, kind), exact_outcomes(P, q), SAMPLES)
    print(f"\nchi-square {stat:.1f} (reject above {critical:.1f})")
    assert not rejected
    first = Counter(v.tokens[0] for v in sampled_verdicts[kind::3])
    assert not chi_square_rejects(first, dict(enumerate(P[0].tolist())), SAMPLES)[0]


def test_greedy_sequences_of_the_sampled_batch_take_the_argmax(sampled_verdicts):
    assert all(v == Verdict([3, 0], 1) for v in sampled_verdicts[2::3])  # argmax of P[0], then of P[1]


def test_a_wrong_residual_fails_the_same_test(monkeypatch):
    """Drawing the correction from p instead of max(0, p - q) skews the first token away from p0."""
    monkeypatch.setattr(acceptance, "_residual", lambda probs, q, chosen, meta: probs[chosen])
    seqs, drafts, logits = sampled_batch(SAMPLES)
    verdicts = accept_batch(Sampler(), logits, seqs, drafts)
    rejected, stat, critical = chi_square_rejects(committed(verdicts, 0), exact_outcomes(P, Q), SAMPLES)
    print(f"\nwrong residual: chi-square {stat:.1f} (reject above {critical:.1f})")
    assert rejected


def test_seeded_verdicts_do_not_depend_on_the_rest_of_the_batch():
    sampler, logits = Sampler(), torch.randn(3, 10)
    draft = Draft([4, 7], torch.rand(2, 10).softmax(-1))
    alone = accept_batch(sampler, logits, [seeded(99, temperature=1.0)], [draft])
    for before in range(3):
        others = [Seq(SamplingParams(temperature=0.7)) for _ in range(before)]
        batch = others + [seeded(99, temperature=1.0), seeded(5, temperature=1.0)]
        rows = torch.cat([torch.randn(2 * before, 10), logits, torch.randn(3, 10)])
        ds = [Draft([1]) for _ in others] + [draft, Draft([2, 3], torch.rand(2, 10).softmax(-1))]
        assert accept_batch(sampler, rows, batch, ds)[before] == alone[0]


def test_one_device_to_host_transfer_per_batch(monkeypatch):
    """Every sync a tensor can cause from Python is counted; the whole mixed batch needs one."""
    calls = Counter()
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    seqs, drafts, logits = sampled_batch(4)
    calls.clear()  # building the batch drew drafts on the host
    verdicts = accept_batch(Sampler(), logits, seqs, drafts)
    assert len(verdicts) == 12 and calls == Counter(tolist=1)


# ---------------------------------------------------------------------- acceptance inside a CUDA graph
GRAPH_KINDS = 4  # per trial: fixed drafts at T = 1; fixed drafts filtered; greedy; a plain decode (no drafts)
# top_p 0.85 keeps every row's cut clear of ties (P[1] has two 0.1s): which of two tied tokens a
# cut keeps depends on the device's sort.
FILTERED = SamplingParams(temperature=0.7, top_k=3, top_p=0.85)


def in_graph_verdicts(n: int, device: str = "cpu") -> list[Verdict]:
    """accept_in_graph over n trials of GRAPH_KINDS sequences, each Q = 3 rows scoring P."""
    torch.manual_seed(0)
    kinds = [SamplingParams(temperature=1.0), FILTERED, SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    drafts = [FIXED_DRAFTS, FIXED_DRAFTS, [3, 1], []]  # argmax of P: 3, then 0
    params = [kinds[i % GRAPH_KINDS] for i in range(n * GRAPH_KINDS)]
    rows = [graph_row(p, VOCAB) for p in params]
    temperature, top_k, top_p, min_p, greedy = (torch.tensor(col, device=device) for col in zip(*rows))
    logits = P.float().log().repeat(len(params), 1).to(device)
    draft = torch.tensor([(drafts[i % GRAPH_KINDS] + [-1] * 3)[:3] for i in range(len(params))], device=device)
    out = acceptance.accept_in_graph(logits, draft.view(-1), logits.argmax(-1), temperature.float(), top_k,
                                 top_p.float(), min_p.float(), greedy, torch.tensor([12345], device=device))
    return [Verdict(drafts[i % GRAPH_KINDS][:a] + [t], a) for i, (a, t) in enumerate(out.tolist())]


def committed_every(verdicts: list[Verdict], kind: int) -> Counter:
    return Counter(tuple(v.tokens) for v in verdicts[kind::GRAPH_KINDS])


def correction_from_p(p: torch.Tensor, drafts: list[int]) -> dict[tuple[int, ...], float]:
    """The outcomes of a wrong rule for fixed drafts: d_i accepted with probability p_i(d_i), but the
    correction at a rejection drawn from p_a itself (the rejected draft not removed)."""
    out: Counter = Counter()
    reach = 1.0
    for a in range(len(drafts) + 1):
        stop = 1.0 if a == len(drafts) else 1 - float(p[a, drafts[a]])
        for x in range(VOCAB):
            out[tuple(drafts[:a]) + (x,)] += reach * stop * float(p[a, x])
        if a < len(drafts):
            reach *= float(p[a, drafts[a]])
    return dict(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_acceptance_in_the_graph_follows_the_exact_distribution(device):
    """Every committed tuple of accept_in_graph (fixed drafts: one-hot q), at T = 1 and with the
    filters on (p = what the Sampler samples from), Pearson at 1e-3; greedy rows take the argmax
    rule; a decode row draws from p. The same counts reject the distribution of a wrong rule (the
    correction drawn from p, not from p without the rejected draft): the test has the power."""
    verdicts = in_graph_verdicts(SAMPLES, device)
    filtered = Sampler().processed_probs(P.float().log(), [SamplingState(FILTERED, [])] * 3).double()
    for kind, p in ((0, P), (1, filtered)):
        counts = committed_every(verdicts, kind)
        rejected, stat, critical = chi_square_rejects(counts, exact_outcomes(p, one_hot(FIXED_DRAFTS)), SAMPLES)
        assert not rejected, (kind, stat, critical)
        assert chi_square_rejects(counts, correction_from_p(p, FIXED_DRAFTS), SAMPLES)[0], kind
    assert all(v == Verdict([3, 0], 1) for v in verdicts[2::GRAPH_KINDS])
    plain = Counter(v.tokens[0] for v in verdicts[3::GRAPH_KINDS])
    assert all(v.num_accepted == 0 for v in verdicts[3::GRAPH_KINDS])
    assert not chi_square_rejects(plain, dict(enumerate(P[0].tolist())), SAMPLES)[0]
