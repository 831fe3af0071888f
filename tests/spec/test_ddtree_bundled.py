"""Draft trees on the bundled pair (models/default + its DFlash2 drafter) at T = 0: the same tokens as the
chain, and more tokens per target pass (tau), printed for the record (scripts/tree_tau.py: all budgets)."""
from __future__ import annotations

import pytest

from lucebox import LLM, SamplingParams
from lucebox.default_model import BUNDLED, BUNDLED_DRAFTER

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef softmax(x):", "class Stack:\n    def __init__(self):",
           "def quicksort(arr):"]


def tau_and_tokens(tree_budget: int | None) -> tuple[float, list[list[int]]]:
    config = {"method": "dflash", "model": str(BUNDLED_DRAFTER), "adaptive": False}
    if tree_budget is not None:
        config["tree_budget"] = tree_budget
    llm = LLM(str(BUNDLED), speculative_config=config)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    verifies = sum(o.metrics.num_drafts for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return 1 + accepted / verifies, [o.outputs[0].token_ids for o in outs]


@pytest.mark.skipif(not (BUNDLED_DRAFTER / "config.json").is_file(), reason="the drafter is not bundled")
def test_trees_commit_more_tokens_per_pass_than_the_chain():
    chain_tau, chain_tokens = tau_and_tokens(None)
    tree_tau, tree_tokens = tau_and_tokens(32)
    print(f"\nbundled pair, T = 0: tau chain {chain_tau:.2f}, tree (32 nodes) {tree_tau:.2f}")
    assert tree_tokens == chain_tokens
    # DFlash2 (lattice trees, the selector's walk): 3.69 against 2.95; the DFlash drafter had 3.59 against 2.74
    assert tree_tau >= 1.2 * chain_tau
