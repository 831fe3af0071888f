"""Mutated gemma4 GGUF files (tests/gemma4_mutations.py): each mutation gives a LuceboxError naming the key
or tensor at fault, fast and without big allocations; random byte flips give a clean load or a LuceboxError."""
from __future__ import annotations

import re

import pytest

from lucebox.errors import LuceboxError
from tests import gemma4_mutations
from tests.weights.test_mutated_files import PEAK_BYTES, SECONDS_PER_CASE, imports_done, load_bounded  # noqa: F401


def test_the_unmutated_gemma4_gguf_loads_with_quantised_experts(tmp_path):
    loaded, peak, _ = load_bounded(gemma4_mutations.write_gemma4_gguf(tmp_path / "ok.gguf"))
    assert not isinstance(loaded, Exception), loaded
    cfg = loaded.config
    assert cfg.layer_types == ["sliding_attention", "full_attention", "full_attention"] and cfg.kv_sources == [0, 1, 1]
    assert cfg.attention_k_eq_v and cfg.layer_head_dims == [8, 16, 16] and cfg.layer_kv_heads == [2, 1, 1]
    assert int(cfg.rotary["full_attention"].fraction * 16) // 2 == 2 and peak < PEAK_BYTES
    assert type(loaded.model.layers[2].experts.gate_up_proj).__name__ == "QuantTensor"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the", add_special_tokens=False)) == "the"


@pytest.mark.parametrize("case", gemma4_mutations.gemma4_cases(), ids=lambda c: c.id)
def test_mutated_gemma4_gguf_fails_with_an_error_naming_the_field(case, tmp_path):
    outcome, peak, seconds = load_bounded(case.build(tmp_path))
    assert isinstance(outcome, LuceboxError), f"{case.id} loaded: {outcome}"
    assert seconds < SECONDS_PER_CASE and peak < PEAK_BYTES, f"{case.id}: {peak} bytes traced"
    assert re.search(case.expected, str(outcome)), f"{case.id}: {outcome}"


@pytest.mark.parametrize("case", gemma4_mutations.gemma4_flip_cases(), ids=lambda c: c.id)
def test_random_byte_flips_of_a_gemma4_gguf_load_cleanly_or_fail_with_a_lucebox_error(case, tmp_path):
    outcome, peak, _ = load_bounded(case.build(tmp_path))
    assert peak < PEAK_BYTES, f"{case.id}: {peak} bytes traced"
    if isinstance(outcome, LuceboxError):
        assert str(outcome)
