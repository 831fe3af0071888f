"""Rows rotated a constant past their storage (PlanRow.rope_shift: decoding past a PFlash-compressed prompt,
a KVFlash view's tail) run through the CUDA-graph buckets like any other row: the shift rides in the
static positions, storage stays put. On the CPU, GraphSettings(capture=False) runs the padded static
batches a graph would replay, eagerly (tests/engine/test_cuda_graphs.py)."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:  # before any Triton import
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox import LLM, SamplingParams  # noqa: E402
from lucebox.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from lucebox.engine.graph_settings import GraphSettings  # noqa: E402
from lucebox.engine.graph_io import StaticInputs  # noqa: E402
from lucebox.engine.overlap import AheadStep  # noqa: E402
from lucebox.engine.pflash.positions import PromptCompression  # noqa: E402
from lucebox.engine.step_plan import PlanRow, RowKind, StepPlan  # noqa: E402
from lucebox.engine.tp_plan import pack_plan, unpack_plan  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402

from tests.conftest import build_hf_model  # noqa: E402
from tests.engine.test_cuda_graphs import BLOCK, prefilled, rel_err, step_tokens, tiny_model  # noqa: E402
from tests.engine.test_tree_graphs import tiny_model as windowless_model  # noqa: E402  (trees refuse short windows)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
COMPRESS = dict(block_size=BLOCK, prefill_keep_ratio=0.5, prefill_min_tokens=16)


# ----------------------------------------------------------------------------- positions

def test_a_row_past_the_kept_prompt_has_a_constant_shift():
    c = PromptCompression(list(range(100, 110)), [0, 1, 5, 9])  # 10 tokens, 4 kept: shift 6
    assert [c.shift_of(s) for s in (0, 3, 4, 7)] == [None, None, 6, 6]
    for start in (4, 7):  # the shift is what the position map says there, trees included
        assert c.positions(start, 3) == [start + 6 + i for i in range(3)]
        assert c.positions(start, 4, depths=[0, 1, 1, 2]) == [start + 6 + d for d in (0, 1, 1, 2)]


def test_a_forward_batch_with_shifts_equals_one_with_explicit_positions():
    tokens, starts, tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [0, 6, 2], [[0, 1], [2, 3], [4, 5]]
    parents = [None, None, [-1, 0, 0, 1]]
    shifted = ForwardBatch.build(tokens, starts, tables, 4, tree_parents=parents, rope_shifts=[5, 0, 3])
    explicit = ForwardBatch.build(tokens, starts, tables, 4, tree_parents=parents,
                                  rope_positions=[[5, 6, 7], None, [5, 6, 6, 7]])
    assert shifted.positions.tolist() == explicit.positions.tolist() == [5, 6, 7, 6, 7, 5, 6, 6, 7]
    for name in ("slot_mapping", "seq_lens", "query_start_loc", "block_tables", "tree_mask"):
        assert torch.equal(getattr(shifted, name), getattr(explicit, name)), name
    assert shifted.seq_lens.tolist() == [3, 8, 6]  # storage is untouched by the shift
    assert shifted.position_bound == explicit.position_bound == 8
    unshifted = ForwardBatch.build(tokens, starts, tables, 4, rope_shifts=[0, 0, 0])
    assert unshifted.rope_bound is None and unshifted.positions.tolist() == [0, 1, 2, 6, 7, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="rope_shifts has 1 entries for 3 sequences"):
        ForwardBatch.build(tokens, starts, tables, 4, rope_shifts=[1])


def test_static_inputs_shift_the_positions_of_real_rows_only():
    inputs = StaticInputs(max_tokens=12, max_seqs=4, width=3, device=torch.device("cpu"))
    real = inputs.fill([[11, 12], [21, 22, 23]], [5, 0], [[1, 3], [2]], 3, 3, BLOCK, 9, rope_shifts=[40, 7])
    inputs.upload(3)
    assert real == [0, 1, 3, 4, 5]
    assert inputs.view("positions", 9).tolist() == [45, 46, 0, 7, 8, 9, 0, 0, 0]  # padding rotated at 0
    assert inputs.view("slots", 9).tolist()[:2] == [3 * BLOCK + 1, 3 * BLOCK + 2]  # stored at 5, 6
    assert inputs.view("seq_lens", 3).tolist() == [8, 3, 3]
    inputs.fill([[1, 2, 3]], [4], [[1, 2]], 1, 3, BLOCK, 9, tree_parents=[[-1, 0, 0]], rope_shifts=[10])
    inputs.upload(1)
    assert inputs.view("positions", 3).tolist() == [14, 15, 15]


def test_a_shift_past_the_reserved_rope_table_runs_eagerly():
    graphs = CudaGraphRunner(tiny_model(), BLOCK, 0, GraphSettings(16, max_batch=4, query_lens=(1,), capture=False))
    limit = graphs.width * BLOCK  # 20: the RoPE table the graphs read
    assert graphs.bucket([[1]], [3], [[1]], rope_shifts=[limit - 4]) == (1, 1)
    assert graphs.bucket([[1]], [3], [[1]], rope_shifts=[limit - 3]) is None
    assert graphs.bucket([[1]], [3], [[1]], rope_shifts=[-4]) is None


@pytest.mark.parametrize("q_lens, tree", [([1, 1, 1], False), ([4, 2], False), ([4], True)])
def test_a_padded_static_step_with_shifts_gives_the_eager_logits_of_its_positions(q_lens, tree):
    """Graph path with rope_shift == eager with the explicit position map (decodes, chain and tree verifies)."""
    settings = GraphSettings(64, max_batch=8, query_lens=(1, 4), tree_lens=(4,), capture=False)
    runner, tables, lens = prefilled(windowless_model() if tree else tiny_model(), settings, len(q_lens))
    shifts = [9, 0, 23][:len(q_lens)]
    parents = [-1, 0, 0, 1]

    def plan(map_positions: bool) -> StepPlan:
        p = StepPlan.forward(step_tokens(q_lens), lens, tables, all_logits=True)
        for row, shift in zip(p.rows, shifts):
            if tree:
                row.parents, row.depths = parents, [0, 1, 1, 2]
            offsets = row.depths or range(len(row.tokens))
            if map_positions:
                row.positions = [row.start + shift + d for d in offsets]
            else:
                row.rope_shift = shift
        return p

    got, want = runner.run(plan(False)), runner.run(plan(True))
    replays = runner.graphs.tree_replays if tree else runner.graphs.replays
    assert sum(replays.values()) == 1  # the shifted step took the static path, the mapped one ran eagerly
    assert got.logits.shape == want.logits.shape and rel_err(got.logits, want.logits) <= 1e-5
    unshifted = runner.run_eager(StepPlan.forward(step_tokens(q_lens), lens, tables, all_logits=True))
    assert rel_err(unshifted.logits, want.logits) > 1e-3  # the shift does change what is computed


def test_catch_up_past_a_compressed_prompt_recomputes_its_taps_through_a_catch_up_bucket():
    """A dormant drafter's missed taps (StepPlanner.catch_up, write_kv=False) past the kept prompt: a shifted
    row through the padded catch-up bucket gives the taps the first (mapped, eager) pass captured; a pass
    reaching into the prompt keeps its position map."""
    from types import SimpleNamespace

    from lucebox.engine.block_manager import BlockManager
    from lucebox.engine.runner import ModelRunner
    from lucebox.engine.step_plan import StepPlanner
    settings = GraphSettings(64, max_batch=2, query_lens=(1, 4), catch_up_lens=(8, 16), capture=False)
    runner = ModelRunner(tiny_model(), 16, BLOCK, graphs=settings)
    tokens = [(5 * j) % 90 + 1 for j in range(30)]
    table: list[int] = []
    BlockManager(16, BLOCK).allocate(table, len(tokens))
    compression = PromptCompression(list(range(50)), list(range(10)) + list(range(30, 40)))  # 20 of 50 kept
    first = StepPlan.forward([tokens], [0], [table], all_logits=True, capture_layers=(0,))
    first.rows[0].positions = compression.positions(0, len(tokens))  # 0..9, 30..39, then 50..59
    want = runner.run_eager(first).features
    spec = SimpleNamespace(capture_layers=(0,), proposer=SimpleNamespace(feature_rows=lambda n: None))
    planner = StepPlanner(spec, runner, 96, async_decode=False)
    seq = SimpleNamespace(num_computed=30, token_slice=lambda a, b: tokens[a:b], block_table=table,
                          window_tables=[], compression=compression)
    [(begin, plan)] = list(planner.catch_up(seq, 20))
    assert begin == 20 and plan.rows[0].rope_shift == 30 and plan.rows[0].positions is None
    got = runner.run(plan).features
    assert dict(runner.graphs.replays) == {(1, 16): 1}
    torch.testing.assert_close(got, want[20:], atol=2e-5, rtol=1e-4)
    [(_, mapped)] = list(planner.catch_up(seq, 15))
    assert mapped.rows[0].rope_shift == 0 and mapped.rows[0].positions == compression.positions(15, 15)
    assert mapped.has_position_maps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_a_captured_graph_replays_shifted_rows_as_the_eager_map_computes_them():
    settings = GraphSettings(64, max_batch=4, query_lens=(1, 4))
    runner, tables, lens = prefilled(tiny_model("cuda"), settings, 3)
    padded_eagerly = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block, replace(settings, capture=False))
    shifts = [9, 0, 23]

    def plan(map_positions: bool) -> StepPlan:
        p = StepPlan.forward(step_tokens([1, 1, 1]), lens, tables, all_logits=True)
        for row, shift in zip(p.rows, shifts):
            if map_positions:
                row.positions = [row.start + shift]
            else:
                row.rope_shift = shift
        return p

    got, padded, want = runner.run(plan(False)), padded_eagerly.run(plan(False)), runner.run_eager(plan(True))
    assert runner.graphs.graphs[(4, 1, (), False, False, False)][0] is not None  # a real graph replayed it
    assert rel_err(got.logits, padded.logits) <= 1e-6 and rel_err(got.logits, want.logits) <= 1e-4


# ----------------------------------------------------------------------------- plans

def test_tensor_parallel_packing_carries_the_shift():
    rows = [PlanRow([5, 6], 10, [3, 4], window_tables=[[9]], rope_shift=77), PlanRow([1], 2, [0], window_tables=[[2]])]
    back = unpack_plan(pack_plan(StepPlan(rows, logits_rows=[1, 2])))
    assert [r.rope_shift for r in back.rows] == [77, 0] and back.rope_shifts == [77, 0]
    assert back.token_ids == [[5, 6], [1]] and back.group_tables == [[[9], [2]]]
    assert StepPlan.forward([[1]], [0], [[0]]).rope_shifts is None


def test_a_step_launched_ahead_covers_only_a_plan_of_the_same_shifts():
    seq = object()
    ahead = AheadStep([seq], [12], True, None, step=None, shifts=[30])
    plan = StepPlan([PlanRow([4], 12, [0, 1, 2, 3], seq=seq, window_tables=[], rope_shift=30)], argmax=True)
    assert ahead.covers(plan)
    plan.rows[0].rope_shift = 31  # e.g. a KVFlash view reselected: another shift, the step goes unused
    assert not ahead.covers(plan)
    assert AheadStep([seq], [12], True, None, step=None).shifts == [0]


# ----------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("target"), tokenizer_dir, seed=5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 380, (n,), generator=gen).tolist() for n in (120, 90)]


def static_graph_llm(path, **kwargs) -> LLM:
    """An LLM on the CPU whose decode / verify steps take the padded static batches a graph replays."""
    llm = LLM(str(path), device="cpu", cuda_graphs=True, **kwargs)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                    replace(llm.engine._graph_settings(), capture=False))
    return llm


def logprobs_of(out) -> list[float]:
    completion = out.outputs[0]
    return [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]


def recorded_plans(llm) -> list[StepPlan]:
    runner, plans = llm.engine.runner, []
    run = runner.run
    runner.run = lambda plan: (plans.append(plan), run(plan))[1]
    return plans


def test_decode_rows_past_a_compressed_prompt_carry_a_shift_not_a_map(qwen3_path, prompts):
    llm = static_graph_llm(qwen3_path, max_num_batched_tokens=24, **COMPRESS)  # chunked prefill of the kept tokens
    plans = recorded_plans(llm)
    out = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0]
    kept = out.metrics.prompt_tokens_kept
    assert kept < len(prompts[0])
    rows = [row for plan in plans for row in plan.rows]
    prefill = [row for row in rows if row.start < kept]
    decode = [row for row in rows if row.start >= kept]
    assert len(prefill) > 1 and all(row.positions is not None and row.rope_shift == 0 for row in prefill)
    assert prefill[-1].kind is RowKind.DECODE  # the prompt's last chunk samples the first token: still mapped
    assert len(decode) >= GREEDY.max_tokens - 1  # (one more when a step launched ahead went unused)
    assert all(row.positions is None and row.rope_shift == len(prompts[0]) - kept for row in decode)
    assert not any(plan.has_position_maps for plan in plans if plan.rows[0].start >= kept)
    assert sum(llm.engine.runner.graphs.replays.values()) == len(decode)


@pytest.mark.parametrize("mode", ["greedy", "overlapped", "sampled", "ngram"])
def test_a_compressed_prompt_decodes_through_graphs_as_it_does_eagerly(qwen3_path, prompts, mode):
    """Two compressed prompts batched: the static graph path (plain decodes, decodes launched ahead and fed on
    the device, sampling in the graph, n-gram verifies) gives the eager engine's tokens."""
    kwargs = dict(COMPRESS, async_decode=mode == "overlapped")
    # logprobs make the comparison sharp (greedy tokens of a tiny model may survive a wrong rotation)
    params = GREEDY if mode == "overlapped" else replace(GREEDY, logprobs=1)
    if mode == "sampled":
        params = SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True)  # sampled, deterministic
    if mode == "ngram":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "adaptive": False}
    batch = [{"prompt_token_ids": p} for p in prompts]
    eager = LLM(str(qwen3_path), device="cpu", **kwargs).generate(batch, params, use_tqdm=False)
    llm = static_graph_llm(qwen3_path, **kwargs)
    got = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]
    if params.logprobs:
        for g, e in zip(got, eager):
            assert logprobs_of(g) == pytest.approx(logprobs_of(e), abs=1e-5)
    assert all(o.metrics.prompt_tokens_kept < len(p) for o, p in zip(got, prompts))
    graphs = llm.engine.runner.graphs
    assert sum(graphs.replays.values()) > 0
    assert (llm.engine.step_counts["overlapped"] > 0) == (mode == "overlapped")
    if mode == "sampled":
        assert any(key[3] for key in graphs.graphs)  # sampled in the graph
    if mode == "ngram":
        assert any(q > 1 for _, q in graphs.replays)  # verifies in the graph
