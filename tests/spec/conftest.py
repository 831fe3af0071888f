"""Fixtures of the speculative-decoding tests."""
from __future__ import annotations

import pytest

from tests.model.test_gemma4 import DENSE, MOE, build
from tests.model.test_laguna import build_laguna


@pytest.fixture(scope="session")
def targets(tmp_path_factory, tokenizer_dir) -> dict:
    """Mixed-window targets, built on first use: "gemma4" (dense: windows of 5, KV-shared layers,
    per-layer inputs), "gemma4-moe" or "laguna" -> checkpoint directory."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            if family == "laguna":
                made[family] = build_laguna(tmp_path_factory.mktemp("laguna"), tokenizer_dir)
            else:
                made[family] = build(tmp_path_factory, tokenizer_dir, family, DENSE if family == "gemma4" else MOE)[0]
        return made[family]
    return get
