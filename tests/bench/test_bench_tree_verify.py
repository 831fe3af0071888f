"""`bench speed --tree-nodes`: the DDTree verify row it times is a real tree verify, and it is reported."""
from __future__ import annotations

import pytest
import torch

from lucebox.bench import shapes, speed, speed_report, tree_verify
from lucebox.engine.engine import LLMEngine
from lucebox.spec.tree import depths_of, path_tokens

CPU = torch.device("cpu")


@pytest.mark.parametrize("nodes", [22, 32, 63])
def test_the_drafter_like_tree_is_deep_on_its_spine_and_bushy_at_the_root(nodes):
    tree = tree_verify.drafter_like_tree(nodes)
    depths = depths_of(tree.parents)
    assert len(tree.tokens) == nodes and all(p <= i for i, p in enumerate(tree.parents))
    assert depths.count(1) > 1  # siblings below the pending token
    assert max(depths) > nodes ** 0.5  # deeper than a balanced tree of that size
    assert tree.tokens[depths.index(max(depths))] == 0  # the deepest node ends the top-1 spine


def test_a_tree_plan_gives_each_node_the_logits_of_its_own_path():
    """A node's logits equal a chain forward of the pending token and the node's ancestors' tokens."""
    loaded = shapes.build_random_model("tiny", "f32", CPU)
    args = speed.default_args(shape="tiny", device="cpu")
    context = 24
    engine = LLMEngine.from_args(speed.engine_args(args, context + 2 * 64, loaded), loaded)
    table, windows = speed.kv_tables.allocate(engine, context + 64, context)
    runner = engine.runner
    prompt = list(range(3, 3 + context))
    runner.forward([prompt], [0], [table])  # a context the tree and the chains attend to
    tree = tree_verify.drafter_like_tree(22)
    tree_logits = runner.run(tree_verify.tree_plan(tree, context, table, windows, recurrent=False)).logits
    plan_tokens = [row + 1 for row in range(1, len(tree.parents) + 1)]  # the plan's row r holds token r + 1
    for row in (3, 11, 22):
        path = [1] + path_tokens(plan_tokens, tree.parents, row)
        chain = runner.forward([path], [context], [table], logits_rows=list(range(len(path))))
        torch.testing.assert_close(tree_logits[row], chain[-1], rtol=1e-4, atol=1e-4)


def test_bench_speed_reports_tree_verifies_beside_the_chain_verify():
    result = speed.run(speed.default_args(shape="tiny", quant="f32", device="cpu", contexts=[32], decode_tokens=4,
                                          repeats=1, tree_nodes=[8, 32], skip=["prefill", "forced", "spec", "peer"]))
    trees = result["verify"]["trees"]
    assert [t["nodes"] for t in trees] == [8, 32] and not any(t["cuda_graph"] for t in trees)
    for t in trees:
        assert t["ratio"] == pytest.approx(t["verify_step_s"] / result["verify"]["decode_step_s"]) and t["ratio"] > 0
    rows = {row[0]: row for row in speed_report.report_rows(result)}
    goal = rows[f"DDTree verify of 32 nodes (depth {trees[1]['depth']}, eager) / decode forward"][-1]
    assert "1.6x" in goal
