"""Tree acceptance (sampling/tree_acceptance.py): greedy walks equal a per-node reference; sampled
verdicts follow the exact distribution of sampling the target alone (the product of the target's
processed probabilities along the walk), and a biased rule fails the same test."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from lucebox.sampling import SamplingParams, acceptance
from lucebox.sampling.acceptance import Draft, Verdict, accept_argmax, accept_batch
from lucebox.sampling.sampler import Sampler
from lucebox.sampling.tree_acceptance import tree_children, tree_row_states
from tests.sampling.test_acceptance import Seq, seeded
from tests.spec.test_spec import chi_square_rejects

VOCAB = 4
# Rows: 0 the pending token; nodes in DFS order: 1 = 3 (under 0), 2 = 0 (under 1), 3 = 2 (under 1), 4 = 1 (under 0).
TOKENS, PARENTS = [3, 0, 2, 1], [0, 1, 1, 0]
P = torch.tensor([[0.1, 0.3, 0.2, 0.4], [0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.4, 0.1], [0.1, 0.6, 0.2, 0.1],
                  [0.3, 0.3, 0.3, 0.1]], dtype=torch.float64)


def processed(p: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The target's processed distributions, written out: temperature, then the top-k tokens kept."""
    logits = p.log() / temperature
    kth = logits.topk(top_k, -1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


def exact_outcomes(p: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(committed tokens): the target's choice y at each row, descending while y is a child."""
    children = tree_children(TOKENS, PARENTS)
    out: dict[tuple[int, ...], float] = {}

    def visit(row: int, prefix: tuple[int, ...], weight: float) -> None:
        for y in range(VOCAB):
            w = weight * float(p[row, y])
            if y in children[row]:
                visit(children[row][y], prefix + (y,), w)
            else:
                out[prefix + (y,)] = out.get(prefix + (y,), 0.0) + w

    visit(0, (), 1.0)
    return out


SAMPLES = 3000
PARAMS = [{"temperature": 1.0, "top_k": -1}, {"temperature": 0.7, "top_k": 3}]


def tree_batch(n: int, params: dict, chains: bool = True):
    """n copies of the tree (alternately seeded and on the global RNG), each beside a sampled chain and a
    greedy tree: the trees' rows are picked out of a mixed batch."""
    torch.manual_seed(0)
    logits = P.float().log()
    seqs, drafts, rows = [], [], []
    for i in range(n):
        seqs.append(seeded(20_000 + i, **params) if i % 2 else Seq(SamplingParams(**params)))
        drafts.append(Draft(list(TOKENS), parents=list(PARENTS)))
        rows.append(logits)
        if chains:
            seqs += [Seq(SamplingParams(temperature=1.0)), Seq(SamplingParams(temperature=0))]
            drafts += [Draft([3, 2]), Draft(list(TOKENS), parents=list(PARENTS))]
            rows += [logits[:3], logits]
    return seqs, drafts, torch.cat(rows)


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-topk3"])
def test_sampled_tree_verdicts_follow_the_exact_distribution(params):
    seqs, drafts, logits = tree_batch(SAMPLES, params)
    verdicts = accept_batch(Sampler(), logits, seqs, drafts)
    trees = verdicts[0::3]
    p = processed(P, params["temperature"], params["top_k"] if params["top_k"] > 0 else VOCAB)
    exact = exact_outcomes(p)
    assert sum(exact.values()) == pytest.approx(1.0)
    rejected, stat, critical = chi_square_rejects(Counter(tuple(v.tokens) for v in trees), exact, SAMPLES)
    print(f"\ntree {params}: chi-square {stat:.1f} (reject above {critical:.1f})")
    assert not rejected
    first = Counter(v.tokens[0] for v in trees)  # the first committed token follows p_0 alone
    assert not chi_square_rejects(first, dict(enumerate(p[0].tolist())), SAMPLES)[0]
    for v in trees:  # the accepted rows are a root path whose tokens were committed
        assert v.rows[0] == 0 and len(v.rows) == v.num_accepted + 1
        assert [TOKENS[r - 1] for r in v.rows[1:]] == v.tokens[:-1]
        assert all(PARENTS[b - 1] == a for a, b in zip(v.rows, v.rows[1:]))
    # The chains beside are accepted by the chain rule; greedy trees walk the argmax: 3 (row 1), then 0 (row 2),
    # whose argmax 2 is no child.
    assert all(v.rows is None and len(v.tokens) == v.num_accepted + 1 for v in verdicts[1::3])
    assert all(v == Verdict([3, 0, 2], 2, [0, 1, 2]) for v in verdicts[2::3])


def biased_tree_choices(sampler, logits, seqs, drafts):
    """A wrong rule: a sample that is no child gets a second draw (children favoured)."""
    states = [st for seq, d in zip(seqs, drafts) for st in tree_row_states(seq, d.tokens, d.parents)]
    probs = sampler.processed_probs(logits, states)
    first, second = torch.multinomial(probs, 2, replacement=True).T.tolist()
    out, row = [], 0
    for d in drafts:
        children = tree_children(d.tokens, d.parents)
        for r in range(len(d.tokens) + 1):
            out.append(first[row + r] if first[row + r] in children[r] else second[row + r])
        row += len(d.tokens) + 1
    return out


def test_a_biased_tree_rule_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(acceptance, "tree_choices", biased_tree_choices)
    seqs, drafts, logits = tree_batch(SAMPLES, PARAMS[0], chains=False)
    verdicts = accept_batch(Sampler(), logits, seqs, drafts)
    rejected, stat, critical = chi_square_rejects(Counter(tuple(v.tokens) for v in verdicts), exact_outcomes(P),
                                                  SAMPLES)
    print(f"\nbiased tree rule: chi-square {stat:.1f} (reject above {critical:.1f})")
    assert rejected


def greedy_tree_reference(logits: torch.Tensor, seq: Seq, draft: Draft, sampler: Sampler) -> list[int]:
    """Node by node: the processed argmax after the path so far, descending while some child holds it."""
    row, committed = 0, []
    while True:
        state = tree_row_states(seq, draft.tokens, draft.parents)[row]
        y = int(sampler.process_logits(logits[row:row + 1], [state]).argmax())
        committed.append(y)
        kids = [i + 1 for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)) if p == row and t == y]
        if not kids:
            return committed
        row = kids[0]


def test_greedy_trees_with_penalties_equal_the_node_by_node_reference():
    rng, sampler, vocab = random.Random(0), Sampler(), 12
    from lucebox.spec.tree import build_tree
    seqs, drafts, rows = [], [], []
    for i in range(20):
        logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(i))
        tree = build_tree(logits[1:].log_softmax(-1), rng.randint(1, 8))  # drafter-like guesses
        n = len(tree.tokens)
        seqs.append(Seq(SamplingParams(temperature=0, repetition_penalty=rng.choice([1.0, 1.6])),
                        output_token_ids=[rng.randrange(vocab) for _ in range(3)]))
        drafts.append(Draft(tree.tokens, parents=tree.parents))
        rows.append(torch.randn(n + 1, vocab, generator=torch.Generator().manual_seed(100 + i)))
        # Make the target agree with the tree's first branch now and then.
        rows[-1][0, tree.tokens[0]] += 5 * (i % 2)
    verdicts = accept_batch(sampler, torch.cat(rows), seqs, drafts)
    assert [v.tokens for v in verdicts] == [greedy_tree_reference(r, s, d, sampler)
                                            for r, s, d in zip(rows, seqs, drafts)]
    assert any(v.num_accepted > 0 for v in verdicts)
    # Without penalties the host argmax rule walks the same trees.
    plain = [Seq(SamplingParams(temperature=0), output_token_ids=s.output_token_ids) for s in seqs]
    argmax = torch.cat([sampler.process_logits(r, tree_row_states(s, d.tokens, d.parents)).argmax(-1)
                        for r, s, d in zip(rows, plain, drafts)]).tolist()
    assert accept_argmax(argmax, drafts) == accept_batch(sampler, torch.cat(rows), plain, drafts)
