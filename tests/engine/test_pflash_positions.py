"""PFlash position map: kept tokens at their original positions, the rest shifted by what was dropped."""
from __future__ import annotations

import pytest
import torch

from lucebox.engine.pflash.positions import PromptCompression
from lucebox.kernels.forward_batch import ForwardBatch


def test_positions_of_prompt_output_and_tree_rows():
    c = PromptCompression(list(range(100, 110)), [0, 1, 5, 9])  # 10 tokens, 4 kept: shift 6
    assert c.kept_ids == [100, 101, 105, 109] and c.shift == 6
    assert c.positions(0, 4) == [0, 1, 5, 9]
    assert c.positions(2, 4) == [5, 9, 10, 11]  # the prompt's end, then its output
    assert c.positions(5, 4, depths=[0, 1, 1, 2]) == [11, 12, 12, 13]  # a tree row: rotated at start + depth


@pytest.mark.parametrize("kept", [[], [3, 2], [0, 10], [-1, 2]])
def test_bad_kept_positions_are_refused(kept):
    with pytest.raises(ValueError, match="ascending original positions"):
        PromptCompression(list(range(10)), kept)


def test_forward_batch_takes_rope_positions_apart_from_storage():
    batch = ForwardBatch.build([[1, 2, 3], [4, 5]], [0, 6], [[0, 1], [2, 3]], 4,
                               rope_positions=[[0, 7, 9], None])
    assert batch.positions.tolist() == [0, 7, 9, 6, 7]
    assert batch.slot_mapping.tolist() == [0, 1, 2, 14, 15]  # storage stays contiguous
    assert batch.seq_lens.tolist() == [3, 8] and batch.position_bound == 10
    with pytest.raises(ValueError, match="2 rope positions for 3 tokens"):
        ForwardBatch.build([[1, 2, 3]], [0], [[0]], 4, rope_positions=[[0, 1]])
    assert torch.equal(ForwardBatch.build([[1, 2]], [0], [[0]], 4).positions, torch.tensor([0, 1]))
