"""The Triton sampler of CUDA-graph steps (kernels/triton_sampling.py) keeps the tokens the Sampler
keeps and commits what lossless acceptance commits.

Without a GPU the kernel runs under Triton's interpreter, which takes tens of milliseconds a row:
the distribution test here is small (rows without filters), the filters are checked exactly
through the threshold each row reports. On a GPU, tests/test_verify.py's in-graph distribution
test (3000 trials, filters on) runs this kernel too, through accept_in_graph's dispatch.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from lucebox.kernels.triton_sampling import accept_rows_triton
from lucebox.sampling import SamplingParams
from lucebox.sampling.graph_rows import graph_row
from lucebox.sampling.sampler import Sampler, SamplingState

from tests.spec.test_spec import chi_square_rejects
from tests.kernels.test_triton_kernels import DEVICE  # noqa: I001  (sets TRITON_INTERPRET=1 before triton loads)
from tests.sampling.test_acceptance import FIXED_DRAFTS, P, correction_from_p, exact_outcomes, one_hot

FILTERS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5),
           SamplingParams(temperature=1.3, top_p=0.7), SamplingParams(temperature=0.6, min_p=0.05),
           SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.02), SamplingParams(temperature=1.0, top_k=1)]


def launch(logits: torch.Tensor, draft: list[int], params: list[SamplingParams], seed: int = 7, search: str = "chunks"):
    """accept_rows_triton over len(params) sequences of equal rows; returns (verdicts, thresholds,
    what decided each row)."""
    vocab = logits.shape[1]
    temperature, top_k, top_p, min_p, greedy = (torch.tensor(col, device=DEVICE)
                                                for col in zip(*(graph_row(p, vocab) for p in params)))
    logits = logits.to(DEVICE)
    out, kept_from, searched = accept_rows_triton(logits, torch.tensor(draft, device=DEVICE), logits.argmax(-1),
                                        temperature.float(), top_k, top_p.float(), min_p.float(), greedy,
                                        torch.tensor([seed], device=DEVICE), search=search)
    return out.cpu(), kept_from.cpu(), searched.cpu().tolist()


def test_each_row_keeps_the_tokens_the_sampler_keeps():
    """Thresholds found by bisection (no sort) keep exactly the Sampler's tokens: temperature,
    top-k, top-p over the top-k set, min-p, each alone and together; top_k = 1 keeps the argmax."""
    torch.manual_seed(3)
    logits = torch.randn(len(FILTERS), 40) * 3
    _, kept_from, _ = launch(logits, [-1] * len(FILTERS), FILTERS)
    for row, params in enumerate(FILTERS):
        reference = Sampler().process_logits(logits[row:row + 1], [SamplingState(params, [])])[0] > float("-inf")
        kept = logits[row] / params.temperature >= kept_from[row]
        assert torch.equal(kept, reference), (row, params, kept.nonzero().flatten(), reference.nonzero().flatten())
    assert int((logits[-1] >= kept_from[-1]).sum()) == 1


@pytest.mark.parametrize("vocab", [2500, 9000])
def test_every_search_decides_as_searching_the_whole_row(vocab):
    """Chunked (many programs a row: 1 or 3 chunks of 4,096 here), listed (top-k candidates listed
    in one pass) and whole-row searches keep the same tokens, draw the same ones and accept the
    same drafts, for top-k rows (with top-p and min-p too), temperature-only rows, top-p or min-p
    alone and k above the chunks' lists (from the lists where they hold the kept set, else from
    the row); the kept sets are the Sampler's."""
    torch.manual_seed(5)
    params = [SamplingParams(temperature=0.8, top_k=5),
              SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.02),
              SamplingParams(temperature=1.3, top_k=40, top_p=0.7), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.1, min_p=0.05),
              SamplingParams(temperature=1.0, top_k=100)]
    drafts = [17, -1] * len(params)
    logits = torch.randn(len(drafts), vocab) * 3
    logits[0, 17] = logits[0].max() + 0.5  # a draft the first sequence keeps (accepted with its p)
    logits[6, 17] = logits[6].max() + 2.0  # and the temperature-only one
    results = {search: launch(logits, drafts, params, search=search) for search in ("chunks", "list", "row")}
    for search in ("chunks", "list"):
        assert torch.equal(results[search][0], results["row"][0]), search
        assert torch.equal(results[search][1], results["row"][1]), search
    assert results["chunks"][2][:8] == [2] * 6 + [1] * 2  # top-k rows from the chunks' lists, T alone raced
    assert results["list"][2] == [3] * 6 + [4] * 6 + [3] * 2 and results["row"][2] == [4] * 14
    kept_from = results["chunks"][1]
    for row in range(len(drafts)):
        state = SamplingState(params[row // 2], [])
        reference = Sampler().process_logits(logits[row:row + 1], [state])[0] > float("-inf")
        assert torch.equal(logits[row] / params[row // 2].temperature >= kept_from[row], reference), row


@pytest.mark.parametrize("spread", [8.0, 0.05], ids=["peaked", "flat"])
def test_top_p_and_min_p_rows_use_the_chunk_lists_only_when_their_kept_sets_lie_in_them(spread):
    """Top-p or min-p without top-k: the chunks list their 64 largest tokens each, which holds a
    peaked row's kept set (searched there) but not a flat row's (searched over the whole row).
    Either way the chunked search decides as the whole-row one, with the Sampler's kept sets."""
    torch.manual_seed(7)
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=200, top_p=0.5)]
    logits = torch.randn(2 * len(params), 9000) * spread
    drafts = [int(logits[0].argmax()), -1] + [5, -1] * (len(params) - 1)
    chunks, chunks_from, searched = launch(logits, drafts, params)
    whole, whole_from, _ = launch(logits, drafts, params, search="row")
    assert torch.equal(chunks, whole) and torch.equal(chunks_from, whole_from)
    kept = [int((logits[r] / params[r // 2].temperature >= chunks_from[r]).sum()) for r in range(len(drafts))]
    for row in range(len(drafts)):
        state = SamplingState(params[row // 2], [])
        reference = Sampler().process_logits(logits[row:row + 1], [state])[0] > float("-inf")
        assert torch.equal(logits[row] / params[row // 2].temperature >= chunks_from[row], reference), row
    assert (max(kept) < 64) if spread > 1 else (min(kept[:4]) > 1000), kept  # in the lists / far beyond
    # the chunks' lists (top-k 200 exceeds what 3 chunks list: a row's list) / the row
    assert searched == ([2] * 4 + [3] * 2 if spread > 1 else [4] * 4 + [3] * 2)


def test_top_k_ties_that_overflow_the_lists_are_all_kept_and_drawn():
    """1,500 tokens tied at the top of a 2,500-token row, top-k 3: all of them are kept (as the
    Sampler keeps ties), more than a chunk's list (64) or a row's list (1,024) holds, so the row
    is searched whole and its draws range over every tied token."""
    torch.manual_seed(6)
    logits = torch.randn(16, 2500) - 10
    logits[:, :1500] = 4.0
    params = [SamplingParams(temperature=1.0, top_k=3)] * 16
    out, kept_from, searched = launch(logits, [-1] * 16, params)
    for search in ("list", "row"):
        assert torch.equal(out, launch(logits, [-1] * 16, params, search=search)[0]), search
    assert searched == [4] * 16  # neither list holds the ties
    assert ((logits >= kept_from[:, None]).sum(1) == 1500).all()
    drawn = out[:, 1]
    assert (drawn < 1500).all() and (drawn >= 1024).any()


def test_an_unknown_search_is_refused():
    with pytest.raises(ValueError, match="search 'sort'"):
        launch(torch.zeros(1, 8), [-1], [SamplingParams(temperature=1.0)], search="sort")


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits = P.float().log()  # argmax 3, 0, 2
    out, kept_from, searched = launch(logits, [3, 1, -1], [SamplingParams(temperature=0)])
    assert out.tolist() == [[1, 0]]
    assert torch.isinf(kept_from).all() and searched == [0, 0, 0]


def test_a_graph_passes_int64_flags_and_its_own_output():
    """As CudaGraphRunner calls it: greedy flags straight from the int64 static inputs, the verdicts
    written into the graph's output buffer (no conversion or copy nodes)."""
    logits = P.float().log().repeat(2, 1).to(DEVICE)  # two sequences of three rows: greedy, sampled
    one = torch.ones(2, device=DEVICE)
    out = torch.full((2, 2), -7, dtype=torch.int64, device=DEVICE)
    returned, _, _ = accept_rows_triton(logits, torch.tensor([3, 1, -1, 3, 2, -1], device=DEVICE), logits.argmax(-1),
                                     one, torch.tensor([4, 4], device=DEVICE), 2 * one, 0 * one,
                                     torch.tensor([1, 0], device=DEVICE), torch.tensor([3], device=DEVICE), out)
    assert returned is out and out[0].tolist() == [1, 0]
    assert 0 <= out[1, 0] <= 2 and 0 <= out[1, 1] < 4


SAMPLES = 250


def test_committed_tokens_follow_the_exact_distribution():
    """Fixed drafts [3, 2] checked against P's rows at T = 1: the committed tuples follow lossless
    acceptance (Pearson at 1e-3) and reject a wrong rule (correction drawn from p itself)."""
    logits = P.float().log().repeat(SAMPLES, 1)
    out, _, _ = launch(logits, (FIXED_DRAFTS + [-1]) * SAMPLES, [SamplingParams(temperature=1.0)] * SAMPLES)
    counts = Counter(tuple(FIXED_DRAFTS[:a] + [t]) for a, t in out.tolist())
    rejected, stat, critical = chi_square_rejects(counts, exact_outcomes(P, one_hot(FIXED_DRAFTS)), SAMPLES)
    assert not rejected, (stat, critical)
    assert chi_square_rejects(counts, correction_from_p(P, FIXED_DRAFTS), SAMPLES)[0]


def test_the_seed_decides_the_draw():
    logits = P.float().log()[:1].repeat(12, 1)
    draft, params = [-1] * 12, [SamplingParams(temperature=1.0)] * 12
    first, again, other = (launch(logits, draft, params, seed)[0] for seed in (5, 5, 6))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("vocab", [3, 1500])
def test_a_row_keeping_only_its_draft_offers_the_draft(vocab):
    """top_k = 1 and the draft is the argmax: accepted with probability 1, and the correction (never
    used) falls back to the draft rather than to a token outside the kept set. Vocabularies below
    and above one block."""
    logits = torch.zeros(2, vocab)
    logits[:, 1] = 5.0
    out, _, _ = launch(logits, [1, -1], [SamplingParams(temperature=1.0, top_k=1)])
    assert out.tolist() == [[1, 1]]
