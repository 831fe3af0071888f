"""CUDA-graph buckets for tree verify steps (engine/cuda_graphs.py): keyed by (batch, 1 + node count),
static depth-based positions and tree masks (-1 for ordinary and padding rows).

On the CPU the padded static batches run eagerly (GraphSettings(capture=False)), as in
tests/engine/test_cuda_graphs.py: a tree step through them gives the eager step's logits, mixed
with chain verifies and decodes in one tree bucket; the engine's greedy output through them equals
plain decoding, with the drafter's taps in a feature ring compacted like the K/V. The `gpu` tests
capture and replay real graphs (scripts/gpu/tests.sh check-new)."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # before any Triton import; see test_triton_kernels.py
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox import LLM, SamplingParams  # noqa: E402
from lucebox.engine.block_manager import BlockManager  # noqa: E402
from lucebox.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from lucebox.engine.graph_settings import GraphSettings  # noqa: E402
from lucebox.engine.graph_io import StaticInputs  # noqa: E402
from lucebox.engine.runner import ModelRunner  # noqa: E402
from lucebox.engine.step_plan import RowKind, StepPlan  # noqa: E402
from lucebox.kernels.forward_batch import tree_mask_bits  # noqa: E402
from lucebox.model.config import ModelConfig  # noqa: E402
from lucebox.model.feature_ring import FeatureRing  # noqa: E402
from lucebox.model.transformer import Transformer  # noqa: E402
from tests.spec.test_ddtree_engine import (  # noqa: E402,F401
    pair,
    plain_llm,
    small_prompts,
    token_ids,
    tree_llm,
)
from tests.spec.test_spec import small_pair  # noqa: E402,F401

gpu = pytest.mark.skipif(not ON_GPU, reason="captures CUDA graphs")
BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# A tree of 6 nodes under the pending token (row 0): 0 -> 1 -> 2, 1 -> 3, 0 -> 4 -> 5, 0 -> 6
TREE = [-1, 0, 1, 1, 0, 4, 0]


def tiny_model(device="cpu", dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.to(device, dtype)


def prefilled(model, settings: GraphSettings | None, lens: list[int], room: int = 12):
    """A runner whose sequences have prompts of these lengths cached; (runner, tables)."""
    runner = ModelRunner(model, 96, BLOCK, graphs=settings)
    blocks = BlockManager(96, BLOCK)
    tables = [[] for _ in lens]
    for table, n in zip(tables, lens):
        blocks.allocate(table, n + room)
    runner.run_eager(StepPlan.forward([[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate(lens)],
                                      [0] * len(lens), tables))
    return runner, tables


def mixed_step(tables, lens, rows: list[list[int] | None]) -> StepPlan:
    """A verify step, every logits row back: rows[i] is sequence i's tree parents (a tree verify
    row), or None for a chain of 3 tokens (the pending token and 2 drafts)."""
    tokens = [[(5 * i + j) % 90 + 1 for j in range(len(p) if p is not None else 3)] for i, p in enumerate(rows)]
    plan = StepPlan.forward(tokens, lens, tables, all_logits=True)
    for row, parents in zip(plan.rows, rows):
        row.kind = RowKind.VERIFY
        row.parents = parents
    return plan


# ----------------------------------------------------------------------------- static layout and buckets

def test_static_inputs_hold_depth_positions_and_tree_masks_with_minus_one_elsewhere():
    inputs = StaticInputs(32, 4, 8, torch.device("cpu"))
    tables = [[3, 4, 5], [6, 7, 8]]
    real = inputs.fill([[1] * 7, [2] * 3], [5, 9], tables, 2, 8, BLOCK, 100, tree_parents=[TREE, None])
    inputs.upload(2)
    assert real == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]
    positions = inputs.view("positions", 16).tolist()
    assert positions[:7] == [5 + d for d in (0, 1, 2, 2, 1, 2, 1)]  # rotated at start + depth
    assert positions[8:11] == [9, 10, 11]  # the chain row: as ever
    masks = inputs.view("tree_mask", 16).tolist()
    assert masks[:7] == tree_mask_bits(TREE)
    assert masks[7:] == [-1] * 9  # the tree row's padding, the chain row and its padding
    # stored at start + row: slot of position 5 + i in table [3, 4, 5]
    assert inputs.view("slots", 7).tolist() == [[3, 4, 5][(5 + i) // BLOCK] * BLOCK + (5 + i) % BLOCK for i in range(7)]
    with pytest.raises(ValueError, match="sequence 0: 2 tree parents for 7 tokens"):
        inputs.fill([[1] * 7], [5], tables[:1], 1, 8, BLOCK, 100, tree_parents=[[-1, 0]])


def test_tree_steps_take_tree_buckets_no_wider_than_a_chain_step():
    settings = GraphSettings(max_model_len=64, max_batch=8, query_lens=(1, 4), tree_lens=(9, 21), capture=False)
    graphs = CudaGraphRunner(tiny_model(), BLOCK, 96, settings)
    # The widest chain step holds 8 x 4 = 32 tokens: (4, 9) and (2, 21) would not fit.
    assert graphs.tree_buckets == {(1, 9), (2, 9), (1, 21)}
    rows = [[1] * 7]
    assert graphs.bucket(rows, [5], [[0] * 20], tree=True) == (1, 9)
    assert graphs.bucket(rows, [5], [[0] * 20]) is None  # a chain step of 7 tokens: no chain bucket holds it
    assert graphs.bucket([[1] * 7, [1] * 3], [5, 3], [[0] * 20] * 2, tree=True) == (2, 9)
    assert graphs.bucket([[1] * 7, [1] * 3, [1] * 4], [5, 3, 2], [[0] * 20] * 3, tree=True) is None  # (4, 9)
    assert graphs.bucket([[1] * 7, [1]], [5, 3], [[0] * 20] * 2, tree=True) is None  # 18 padded for 8 tokens
    assert graphs.bucket([[1] * 15], [5], [[0] * 20], tree=True) == (1, 21)
    assert graphs.bucket([[1] * 22], [5], [[0] * 20], tree=True) is None  # longer than any tree bucket
    graphs.state_rows = lambda plan: ([0], [0])  # recurrent layers: their trees run eagerly
    assert graphs.bucket(rows, [5], [[0] * 20], tree=True) is None


@pytest.mark.parametrize("rows", [[TREE], [TREE, None], [TREE, TREE, None], [TREE[:3], None, TREE, TREE[:5]]],
                         ids=["one-tree", "tree+chain", "trees+chain", "four"])
def test_a_padded_tree_step_gives_the_eager_logits(rows):
    """Tree rows (whole and cut to a DFS prefix) beside chain rows, padded to a tree bucket's B x Q."""
    model = tiny_model()
    settings = GraphSettings(max_model_len=64, max_batch=4, query_lens=(1, 8), tree_lens=(8,), capture=False)
    lens = [9, 13, 6, 11][:len(rows)]
    runner, tables = prefilled(model, settings, lens)
    plan = mixed_step(tables, lens, rows)
    want = runner.run_eager(plan).logits
    runner.graphs.replays.clear()
    got = runner.run(plan)
    assert sum(runner.graphs.tree_replays.values()) == 1 and not runner.graphs.replays
    torch.testing.assert_close(got.logits, want, atol=2e-5, rtol=1e-4)
    argmax = runner.graphs.run(replace(plan, argmax=True))
    assert argmax.tokens == want.argmax(-1).tolist()


def test_a_padded_tree_step_writes_the_eager_steps_kv():
    """Nodes stored at start + row in both paths; padding writes only the scratch block."""
    model = tiny_model()
    settings = GraphSettings(max_model_len=64, max_batch=2, query_lens=(1, 8), tree_lens=(8,), capture=False)
    lens = [9, 13]
    caches = []
    for path in ("eager", "graph"):
        runner, tables = prefilled(model, settings, lens)
        plan = mixed_step(tables, lens, [TREE, None])
        runner.run_eager(plan) if path == "eager" else runner.graphs.run(plan)
        caches.append([k.values[:96].clone() for k, _ in runner.caches])
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- the engine

def static_tree_graphs(llm: LLM, ring: bool = False) -> CudaGraphRunner:
    """The engine's graph buckets (tree buckets included) as static batches run eagerly; ring: the
    drafter's taps go through a feature ring, as on the GPU."""
    engine = llm.engine
    runner = engine.runner
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                    replace(engine._graph_settings(), capture=False))
    if ring:
        prop = engine.speculator.proposer
        width = len(prop.capture_layers) * engine.loaded.config.hidden_size
        prop.feature_ring = FeatureRing(256, width, runner.model.dtype, runner.model.device)
        runner.set_feature_ring(prop.feature_ring)
    return runner.graphs


@pytest.mark.parametrize("ring", [False, True], ids=["features", "ring"])
def test_greedy_trees_through_tree_buckets_equal_plain_decoding(pair, plain_llm, ring):
    """Output equal to plain decoding, and every tree accepted as in eager tree steps: the drafter saw
    the same taps (with a ring: the accepted nodes' ring rows compacted, which greedy output alone
    could not tell, trees being lossless whatever the drafter sees)."""
    target, drafter = pair
    prompts = small_prompts(5, seed=11)
    eager = tree_llm(target, drafter, 12, device="cpu")
    want_taps = projected_taps(eager)
    want = eager.generate(prompts, GREEDY, use_tqdm=False)
    llm = tree_llm(target, drafter, 12, device="cpu", cuda_graphs=True)
    graphs = static_tree_graphs(llm, ring)
    taps = projected_taps(llm)
    assert graphs.tree_lens == [13]  # every depth: the budget's 12 (top-16 per depth)
    moved = []
    compact = llm.engine.committer.compact_ring_rows
    llm.engine.committer.compact_ring_rows = lambda f, at, rows: (moved.append(rows != list(range(len(rows)))),
                                                                   compact(f, at, rows))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == token_ids(plain_llm, prompts, GREEDY)
    assert sum(graphs.tree_replays.values()) > 0 and sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert [o.metrics.accepted_per_position for o in outs] == [o.metrics.accepted_per_position for o in want]
    assert any(moved) == ring
    assert len(taps) == len(want_taps)
    for got, expected in zip(taps, want_taps):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def projected_taps(llm: LLM) -> list[torch.Tensor]:
    """Every batch of taps the drafter projects into its context, in order (ring rows read out)."""
    prop, seen = llm.engine.speculator.proposer, []
    take = prop._take_pending

    def spy(seq):
        start, features = take(seq)
        if features is not None:
            seen.append(features.clone())
        return start, features
    prop._take_pending = spy
    return seen
    engine = llm.engine
    assert engine.scheduler.blocks.num_free_blocks == engine.runner.num_blocks


def test_trees_chains_and_decodes_share_a_tree_bucket(pair, plain_llm):
    """n-gram chains and a plain decode ride in the tree bucket of the drafter's trees (mask -1)."""
    target, drafter = pair
    prompts = small_prompts(5, seed=3) + [{"prompt_token_ids": [0, 1, 2, 0, 1, 2, 0, 1]}]
    params = [GREEDY] * 5 + [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]
    llm = tree_llm(target, drafter, 10, device="cpu", cuda_graphs=True,
                   spec={"ngram_first": True, "prompt_lookup_min": 1})
    graphs = static_tree_graphs(llm)
    mixed = []
    replay = graphs.replay
    graphs.replay = lambda plan, key: (mixed.append(plan.has_trees and any(r.parents is None for r in plan.rows)),
                                       replay(plan, key))[1]
    assert token_ids(llm, prompts, params) == token_ids(plain_llm, prompts, params)
    assert any(mixed) and sum(graphs.tree_replays.values()) > 0


# ----------------------------------------------------------------------------- real graphs (GPU)

@gpu
def test_tree_graph_replay_matches_eager_logits():
    model = tiny_model("cuda")
    settings = GraphSettings(max_model_len=64, max_batch=4, query_lens=(1, 8), tree_lens=(8,))
    lens = [9, 13, 6]
    runner, tables = prefilled(model, settings, lens)
    runner.capture_graphs()
    assert any(key[4] and graph is not None for key, (graph, _) in runner.graphs.graphs.items())
    # 7 + 6 + 3 tokens in the (4, 8) bucket: within the padding bound (MAX_PADDING), so it replays
    plan = mixed_step(tables, lens, [TREE, TREE[:6], None])
    assert runner.graphs.bucket(plan.token_ids, plan.start_positions, plan.block_tables, tree=True) == (4, 8)
    want = runner.run_eager(plan).logits
    got = runner.run(plan)
    assert sum(runner.graphs.tree_replays.values()) == 1
    torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-3)


@gpu
def test_greedy_trees_through_captured_tree_graphs_equal_plain_decoding(pair):
    target, drafter = pair
    prompts = small_prompts(5, seed=11)
    plain = LLM(str(target), block_size=4, device="cuda", dtype="float32")
    llm = tree_llm(target, drafter, 12, device="cuda", dtype="float32")
    assert token_ids(llm, prompts, GREEDY) == token_ids(plain, prompts, GREEDY)
    assert sum(llm.engine.runner.graphs.tree_replays.values()) > 0
