"""The bundled default model pair: all three artifacts load offline and agree with each other."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lucebox import LLM, SamplingParams
from lucebox.bench.prompts import held_out_texts
from lucebox.convert import convert_hf_to_gguf
from lucebox.default_model import BUNDLED, BUNDLED_DRAFTER, MODELS

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason="models/ is not in this checkout")


@pytest.fixture(scope="module")
def hf():
    return LLM(str(BUNDLED), speculative_config=None)


@pytest.fixture(scope="module")
def snippets():
    return held_out_texts(6, 300, seed=11)


def test_bundle_stays_within_the_size_limit():
    total = sum(f.stat().st_size for f in Path(MODELS).rglob("*") if f.is_file())
    assert total <= 64 * 2**20, f"models/ holds {total / 2**20:.1f} MiB"


def test_tracked_tree_leaves_room_for_the_device_wheels():
    """The GPU machine takes the tracked tree plus the carried wheels (~2 MiB) up to 64 MiB in all."""
    root = Path(MODELS).parent
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    total = sum((root / name).stat().st_size for name in listed.decode().split("\0") if (root / name).is_file())
    assert total <= 60 * 2**20, f"the tracked tree holds {total / 2**20:.1f} MiB"


def test_default_model_writes_code(hf):
    out = hf.generate("def add(a, b):\n", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "return" in out.outputs[0].text


def test_q8_0_gguf_agrees_with_the_hf_weights(hf, snippets, tmp_path):
    """Teacher-forced over held-out code, the Q8_0 model's argmax equals the bf16 model's almost
    everywhere (quantisation moves only near-ties), and greedy continuations agree on average.
    The GGUF is converted here (2 s) rather than shipped: it would push the bundle past its limit."""
    gguf = LLM(str(convert_hf_to_gguf(BUNDLED, tmp_path / "default-q8_0.gguf", "q8_0")), speculative_config=None)
    same = total = 0
    for text in snippets:
        ids = hf.tokenizer.encode(text, add_special_tokens=False)
        assert ids == gguf.tokenizer.encode(text, add_special_tokens=False)  # the GGUF vocabulary is the same
        rows = []
        for llm in (hf, gguf):
            engine = llm.engine
            table: list[int] = []
            engine.scheduler.blocks.allocate(table, len(ids))
            rows.append(engine.runner.forward([ids], [0], [table], all_logits=True).argmax(-1))
            engine.scheduler.blocks.free_table(table)
        same += int((rows[0] == rows[1]).sum())
        total += len(ids)
    print(f"\nQ8_0 vs bf16 teacher-forced argmax agreement: {same / total:.3f} over {total} positions")
    assert same / total >= 0.95
    params = SamplingParams(temperature=0, max_tokens=16)
    a, b = hf.generate(snippets, params, use_tqdm=False), gguf.generate(snippets, params, use_tqdm=False)
    prefix = [next((i for i, (x, y) in enumerate(zip(p.outputs[0].token_ids, q.outputs[0].token_ids)) if x != y),
                   16) for p, q in zip(a, b)]
    print(f"greedy agreement before the first difference: {prefix}")
    assert sum(prefix) / len(prefix) >= 8


@pytest.mark.skipif(not (BUNDLED_DRAFTER / "config.json").is_file(), reason="the drafter is not bundled")
def test_drafter_reaches_tau_above_2_on_held_out_code(hf, snippets):
    spec = LLM(str(BUNDLED), speculative_config={"method": "dflash", "model": str(BUNDLED_DRAFTER),
                                                 "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = spec.generate(snippets, params, use_tqdm=False)
    plain = hf.generate(snippets, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    drafts = sum(o.metrics.num_drafts for o in outs)
    tau = (sum(o.metrics.num_accepted_tokens for o in outs) + drafts) / drafts
    print(f"\ndefault drafter tau on held-out code: {tau:.2f}")
    assert tau > 2


def test_cli_default_is_the_bundled_pair(capsys):
    from lucebox.cli import main
    assert main(["generate", "--prompt", "import os\n", "--max-tokens", "8", "--temperature", "0"]) == 0
    assert str(BUNDLED) in capsys.readouterr().err


def test_default_speculation_is_a_typed_config_of_the_bundled_drafter():
    from lucebox.config import SpeculativeConfig
    from lucebox.default_model import default_speculative_config
    want = (SpeculativeConfig(method="dflash", model=str(BUNDLED_DRAFTER), ngram_first=True)
            if (BUNDLED_DRAFTER / "config.json").is_file() else SpeculativeConfig(method="ngram"))
    assert default_speculative_config() == want


def test_default_model_with_speculation_turned_off_decodes_plainly():
    llm = LLM(speculative_config={}, max_model_len=256)
    assert llm.engine.speculator is None and llm.args.model == str(BUNDLED)


def test_default_llm_speculates_losslessly(hf, snippets):
    """No model given: the bundled model with speculation on (its drafter, else n-gram lookup), and
    greedy output identical to plain decoding."""
    default = LLM()
    assert default.engine.speculator is not None
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = default.generate(snippets[:3], params, use_tqdm=False)
    plain = hf.generate(snippets[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_drafts for o in outs) > 0
