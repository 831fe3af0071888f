"""Mutated checkpoints (tests/mutations.py, hf_mutations.py): every mutation of a GGUF or safetensors
checkpoint gives a LuceboxError naming the field at fault, fast and without big allocations; random byte
flips give a clean load or a LuceboxError, never another exception, a hang or a memory blow-up."""
from __future__ import annotations

import re
import signal
import time
import tracemalloc
from contextlib import contextmanager

import pytest
from lucebox.errors import LuceboxError
from lucebox.model.loader import load_model
from tests import hf_mutations, hybrid_mutations, mutations

SECONDS_PER_CASE = 30  # a hang, not a slow host: a full GC under tracemalloc late in a CI run took > 5 s
PEAK_BYTES = 64 << 20  # the valid tiny checkpoints load with a few MB


@pytest.fixture(scope="module", autouse=True)
def imports_done(tmp_path_factory):
    """Load each format once untraced, so that first-time imports do not count against a case's time."""
    directory = tmp_path_factory.mktemp("warm")
    load_model(str(mutations.write_gguf(directory / "ok.gguf")), device="cpu")
    load_model(str(hf_mutations.write_hf(directory / "hf")), device="cpu")


@contextmanager
def time_limit(seconds: float):
    """Fail a case that runs longer than `seconds` (SIGALRM: the test runs on the main thread)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load_bounded(path):
    """load_model on CPU under a time limit, returning (result or exception, peak traced bytes)."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        with time_limit(SECONDS_PER_CASE):
            try:
                outcome = load_model(str(path), device="cpu")
            except LuceboxError as e:
                outcome = e
        return outcome, tracemalloc.get_traced_memory()[1], time.monotonic() - start
    finally:
        tracemalloc.stop()


def test_the_unmutated_gguf_and_safetensors_checkpoints_load(tmp_path):
    gguf = mutations.write_gguf(tmp_path / "ok.gguf")
    hf = hf_mutations.write_hf(tmp_path / "hf")
    for path in (gguf, hf):
        loaded, peak, _ = load_bounded(path)
        assert not isinstance(loaded, Exception), loaded
        assert loaded.config.num_layers == mutations.LAYERS and loaded.config.vocab_size == mutations.VOCAB
        assert peak < PEAK_BYTES


def test_the_mutation_parser_finds_every_tensor_of_the_valid_gguf(tmp_path):
    data = mutations.write_gguf(tmp_path / "ok.gguf").read_bytes()
    fields = mutations.parse_gguf(data)
    assert set(fields.tensors) == {mutations.gguf_name(n) for n in mutations.tensor_shapes()}
    assert "tokenizer.ggml.tokens" in fields.values


def test_the_unmutated_hybrid_gguf_loads_with_quantised_experts(tmp_path):
    loaded, peak, _ = load_bounded(hybrid_mutations.write_hybrid_gguf(tmp_path / "ok.gguf"))
    assert not isinstance(loaded, Exception), loaded
    assert loaded.config.layer_types == ["linear_attention", "full_attention"] and peak < PEAK_BYTES
    assert type(loaded.model.layers[1].mlp.experts.down_proj).__name__ == "QuantTensor"


@pytest.mark.parametrize("case", [*mutations.gguf_cases(), *hf_mutations.safetensors_cases(),
                                  *hybrid_mutations.hybrid_cases()], ids=lambda c: c.id)
def test_mutated_checkpoint_fails_with_an_error_naming_the_field(case, tmp_path):
    path = case.build(tmp_path)
    outcome, peak, seconds = load_bounded(path)
    assert isinstance(outcome, LuceboxError), f"{case.id} loaded: {outcome}"
    assert seconds < SECONDS_PER_CASE
    assert peak < PEAK_BYTES, f"{case.id}: {peak} bytes traced"
    assert re.search(case.expected, str(outcome)), f"{case.id}: {outcome}"


@pytest.mark.parametrize("case", mutations.gguf_flip_cases() + hybrid_mutations.hybrid_flip_cases(), ids=lambda c: c.id)
def test_random_byte_flips_load_cleanly_or_fail_with_a_lucebox_error(case, tmp_path):
    outcome, peak, _ = load_bounded(case.build(tmp_path))
    assert peak < PEAK_BYTES, f"{case.id}: {peak} bytes traced"
    if isinstance(outcome, LuceboxError):
        assert str(outcome)
