"""The engine step as plan -> run -> commit: what the planner asks of a forward, the one result type
the runner answers with, and the speculator and scheduler telling the engine instead of calling it."""
from __future__ import annotations

import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.block_manager import BlockManager
from lucebox.engine.cache_manager import CacheManager
from lucebox.engine.runner import ModelRunner
from lucebox.engine.scheduler import ScheduledBatch, Scheduler
from lucebox.engine.sequence import Sequence
from lucebox.engine.step_plan import CATCH_UP_LENS, RowKind, StepPlan, StepPlanner
from lucebox.sampling.acceptance import Draft
from lucebox.sampling.graph_rows import graph_row
from lucebox.spec.proposer import Proposer
from lucebox.spec.speculator import Speculator

from tests.engine.test_cuda_graphs import tiny_model

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9)
VOCAB = 96


class Runner:
    """What the planner reads of a ModelRunner: whether it has graphs."""

    def __init__(self, graphs: bool):
        self.graphs = object() if graphs else None


class TapProposer(Proposer):
    """A drafter with taps on layer 0 whose drafts are [7] * k; records what it observes."""
    capture_layers = (0,)

    def __init__(self):
        self.observed, self.reserved = [], []

    def feature_rows(self, n: int) -> int:
        self.reserved.append(n)
        return 100 + n

    def propose(self, seqs, num_tokens):
        return [Draft([7] * k) for k in num_tokens]

    def observe(self, seq, start, features):
        self.observed.append((seq, start, features))


def sequence(prompt: int, computed: int, params=GREEDY, output: int = 0, draft: list[int] | None = None) -> Sequence:
    seq = Sequence("r", 0, list(range(1, prompt + 1)), params)
    seq.output_token_ids = list(range(50, 50 + output))
    seq.num_computed, seq.block_table = computed, [0, 1, 2, 3]
    seq.draft = Draft(draft) if draft else None
    return seq


def batch_of(*pairs) -> ScheduledBatch:
    batch = ScheduledBatch()
    for seq, n in pairs:
        batch.add(seq, n)
    return batch


def test_rows_say_what_each_sequence_needs_back_and_logits_rows_put_decodes_first():
    chunk = sequence(10, 0)  # 4 of 10 prompt tokens: nothing back
    verify = sequence(6, 6, output=1, draft=[8, 9])  # pending token + 2 drafts: a verdict
    decode = sequence(5, 5, output=1)  # one token back
    plan = StepPlanner(None, Runner(False), VOCAB, False).plan(batch_of((chunk, 4), (verify, 3), (decode, 1)), False)
    assert [r.kind for r in plan.rows] == [RowKind.CHUNK, RowKind.VERIFY, RowKind.DECODE]
    assert plan.token_ids == [[1, 2, 3, 4], [50, 8, 9], [50]]
    assert plan.start_positions == [0, 6, 5] and [r.offset for r in plan.rows] == [0, 4, 7]
    assert plan.rows[1].draft.tokens == [8, 9] and plan.rows[2].draft is None
    assert plan.logits_rows == [7, 4, 5, 6]  # the decode's row, then the verify's k + 1
    assert plan.prefilling and plan.argmax and plan.sample is None and not plan.capture_layers


def test_graph_sampling_is_planned_only_for_simple_rows_on_a_runner_with_graphs():
    planner = StepPlanner(None, Runner(True), VOCAB, False)
    rows = [sequence(5, 5, SAMPLED, output=1), sequence(6, 6, GREEDY, output=1, draft=[3])]
    plan = planner.plan(batch_of((rows[0], 1), (rows[1], 2)), False)
    assert not plan.argmax and plan.sample == [graph_row(SAMPLED, VOCAB), graph_row(GREEDY, VOCAB)]
    seeded = sequence(5, 5, SamplingParams(temperature=0.7, seed=1), output=1)
    assert planner.plan(batch_of((seeded, 1)), False).sample is None  # its own generator: sampled outside
    assert planner.plan(batch_of((rows[0], 1), (sequence(9, 0), 3)), False).sample is None  # a prompt chunk
    assert StepPlanner(None, Runner(False), VOCAB, False).plan(batch_of((rows[0], 1)), False).sample is None


def test_taps_are_captured_for_prompts_and_verifies_and_deferral_only_for_plain_decodes():
    proposer = TapProposer()
    spec = Speculator(proposer, 3, 1000, adaptive=False)
    planner = StepPlanner(spec, Runner(True), VOCAB, async_decode=True)
    decode = sequence(5, 5, output=1)
    plain = planner.plan(batch_of((decode, 1)), False)
    assert not plain.capture_layers and plain.feature_rows is None and plain.defer
    prompt = planner.plan(batch_of((sequence(8, 0), 8)), in_run=True)  # a prompt's taps, run or not
    assert prompt.capture_layers == (0,) and prompt.feature_rows == 108 and not prompt.defer
    spec.step_sources = {"model"}  # this step verifies drafts: its decodes capture too
    assert planner.plan(batch_of((decode, 1)), False).capture_layers == (0,)
    assert not planner.plan(batch_of((decode, 1)), in_run=True).capture_layers  # a promised plain run: never
    assert proposer.reserved == [8, 1]


def test_catch_up_plans_cover_the_missed_positions_in_chunks_and_write_no_kv():
    spec = Speculator(TapProposer(), 3, 1000, adaptive=False)
    seq = sequence(700, 700)
    plans = list(StepPlanner(spec, Runner(True), VOCAB, False).catch_up(seq, 100))
    last = CATCH_UP_LENS[-1]
    assert [begin for begin, _ in plans] == [100, 100 + last, 100 + 2 * last]
    assert [p.total_tokens for _, p in plans] == [last, last, 600 - 2 * last]
    assert all(not p.write_kv and p.logits_rows == [] and p.capture_layers == (0,) for _, p in plans)
    assert plans[-1][1].token_ids == [seq.token_slice(100 + 2 * last, 700)]
    assert [p.feature_rows for _, p in plans] == [100 + last, 100 + last, 100 + 600 - 2 * last]


def test_the_runner_answers_every_plan_with_one_result_type():
    model = tiny_model()
    runner, table = ModelRunner(model, 16, 8), []
    BlockManager(16, 8).allocate(table, 12)
    tokens = [[5, 9, 2, 7, 1, 3]]
    logits = runner.run(StepPlan.forward(tokens, [0], [table], all_logits=True, capture_layers=(1,)))
    assert logits.tokens is None and logits.verdicts is None and logits.deferred is None
    assert logits.logits.shape == (6, model.config.vocab_size) and logits.features.shape[0] == 6
    argmax = runner.run(StepPlan.forward(tokens, [0], [table], logits_rows=[2, 5], argmax=True))
    assert argmax.logits is None and argmax.features is None
    assert argmax.tokens == logits.logits[[2, 5]].argmax(-1).tolist()
    torch.testing.assert_close(runner.forward(tokens, [0], [table]), logits.logits[-1:])  # the last row alone


def test_the_speculator_asks_for_missed_taps_and_observes_what_it_is_given():
    """No hook into the engine: choose() names the sequences whose taps a dormant drafter missed,
    propose() reads the recomputed chunks before drafting (lazily, one at a time) and times them."""
    proposer = TapProposer()
    spec = Speculator(proposer, 2, 1000, adaptive=False)
    seq = sequence(6, 9, output=4)
    spec.missed(seq, 5)
    assert spec.choose([seq]) == [(seq, 5)] and not spec.missing and seq.draft is None
    read = []

    def chunks():
        for begin in (5, 7):
            read.append(begin)
            yield seq, begin, torch.full((2, 4), float(begin))
    spec.propose(chunks())
    assert read == [5, 7] and [(s, b) for s, b, _ in proposer.observed] == [(seq, 5), (seq, 7)]
    assert seq.draft.tokens == [7, 7] and spec.policy.catch_up > 0
    assert spec.choose([seq]) == []  # nothing missed any more (its draft is pending)


def test_the_scheduler_reports_preemptions_and_the_engine_releases_their_drafter_state(hf_models):
    scheduler = Scheduler(CacheManager([], 4, 4), max_num_seqs=4, max_num_batched_tokens=64)
    old, new = (Sequence("r", i, list(range(1, 8)), GREEDY, arrival=i) for i in range(2))
    scheduler.add(old)
    scheduler.add(new)
    assert scheduler.schedule().preempted == []  # 2 blocks each: all 4 taken
    old.num_computed = new.num_computed = 7
    old.output_token_ids += [9, 9, 9]  # old needs a third block: the newest gives its up
    assert scheduler.schedule().preempted == [new] and new in scheduler.waiting

    # 96 tokens of KV, far too few for ten sequences at once: preemptions.
    llm = LLM(str(hf_models["llama"]), block_size=4, max_model_len=96, kv_cache_memory=96 * 512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec, released = llm.engine.speculator, []
    real = spec.release
    spec.release = lambda seq, finished: released.append((finished, seq.block_table != [])) or real(seq, finished)
    prompts = [{"prompt_token_ids": [3 + i, 4, 5, 3 + i, 4, 5] * (2 + i % 3)} for i in range(10)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    preemptions = llm.engine.scheduler.num_preemptions
    assert preemptions > 0 and sum(not finished for finished, _ in released) == preemptions
    assert [held for finished, held in released if finished] == [True] * 10  # told before its blocks went
    assert not spec.source and not spec.acceptance and not spec.proposer.indexes
