"""A tree verify through a whole model (DDTree's target pass): each node's logits equal a chain
verify of its root-to-node path, rope positions by depth and K/V stored by row; after the
accepted path's K/V are compacted, decoding continues as if that path had been verified as a chain."""
from __future__ import annotations

import pytest
import torch

from lucebox.engine.block_manager import BlockManager
from lucebox.engine.runner import ModelRunner
from lucebox.kernels.forward_batch import ForwardBatch
from lucebox.kernels.kv_compact import compact_rows, compaction_slots
from lucebox.model.loader import load_model

BLOCK_SIZE = 4
#        0
#     1     4     7
#   2   3   5
#           6
PARENTS = [-1, 0, 1, 1, 0, 4, 5, 0]
# Families whose layers all attend fully (mistral's and qwen2's test windows are shorter than a tree row).
FULL_ATTENTION = ["llama", "qwen3"]


def path_to(i: int) -> list[int]:
    path = [i]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def chain_logits(runner, blocks, tokens: list[int]) -> torch.Tensor:
    """The logits after the last of `tokens`, from one prefill of them all."""
    table: list[int] = []
    blocks.allocate(table, len(tokens))
    return runner.forward([tokens], [0], [table])[0]


@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_tree_verify_equals_chain_verifies_and_compaction_continues_the_accepted_path(family, hf_models,
                                                                                      monkeypatch):
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    loaded = load_model(str(hf_models[family]), dtype="float32")
    model = loaded.model
    g = torch.Generator().manual_seed(3)
    vocab = loaded.config.vocab_size
    committed = torch.randint(0, vocab, (9,), generator=g).tolist()
    tree = torch.randint(0, vocab, (len(PARENTS),), generator=g).tolist()  # tree[0]: the pending token
    other = torch.randint(0, vocab, (6,), generator=g).tolist()  # a plain decode row beside the tree
    follow = torch.randint(0, vocab, (1,), generator=g).tolist()

    ref_runner, ref_blocks = ModelRunner(model, 128, BLOCK_SIZE), BlockManager(128, BLOCK_SIZE)
    want = [chain_logits(ref_runner, ref_blocks, committed + [tree[j] for j in path_to(i)])
            for i in range(len(PARENTS))]
    want_other = chain_logits(ref_runner, ref_blocks, other)
    accepted = path_to(5)  # [0, 4, 5]
    want_next = chain_logits(ref_runner, ref_blocks, committed + [tree[j] for j in accepted] + follow)

    runner, blocks = ModelRunner(model, 64, BLOCK_SIZE), BlockManager(64, BLOCK_SIZE)
    tables: list[list[int]] = [[], []]
    blocks.allocate(tables[0], len(committed) + len(tree))
    blocks.allocate(tables[1], len(other))
    runner.forward([committed, other[:-1]], [0, 0], tables)  # the committed prefixes (installs the caches)
    batch = ForwardBatch.build([tree, other[-1:]], [len(committed), len(other) - 1], tables, BLOCK_SIZE,
                               model.device, tree_parents=[PARENTS, None])
    with torch.inference_mode():
        got = model.compute_logits(model(batch))
    for i in range(len(PARENTS)):
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-4, msg=f"tree node {i}")
    torch.testing.assert_close(got[-1], want_other, rtol=1e-4, atol=1e-4)

    src, dst = compaction_slots(tables[:1], BLOCK_SIZE, [len(committed)], [accepted], model.device)
    compact_rows([cache for pair in runner.caches for cache in pair], src, dst)
    start = len(committed) + len(accepted)
    got_next = runner.forward([follow], [start], tables[:1])[0]
    torch.testing.assert_close(got_next, want_next, rtol=1e-4, atol=1e-4)
