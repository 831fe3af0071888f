"""config.py: EngineArgs, the typed SpeculativeConfig parsed from vLLM's dict shape, and the one reader
of each LUCEBOX_* environment variable."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lucebox import config
from lucebox.config import EngineArgs, SpeculativeConfig
from lucebox.errors import RequestError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lucebox"


# ---------------------------------------------------------------------- SpeculativeConfig
def test_a_dict_becomes_a_typed_config_with_the_defaults_of_the_dataclass():
    spec = EngineArgs(speculative_config={"method": "ngram"}).speculative_config
    assert spec == SpeculativeConfig(method="ngram")
    assert (spec.adaptive, spec.ngram_first, spec.prompt_lookup_min, spec.prompt_lookup_max) == (True, False, 3, 5)
    assert spec.num_speculative_tokens is None and spec.draft_dtype is None


def test_a_typed_config_passes_through_unchanged():
    spec = SpeculativeConfig(method="dflash", model="drafter", num_speculative_tokens=7)
    assert EngineArgs(speculative_config=spec).speculative_config is spec


def test_a_model_without_a_method_is_a_draft_model_as_in_vllm():
    assert SpeculativeConfig.parse({"model": "small"}).method == "draft_model"


def test_unset_stays_none_and_an_empty_dict_turns_speculation_off():
    assert EngineArgs().speculative_config is None
    off = EngineArgs(speculative_config={}).speculative_config
    assert off == SpeculativeConfig() and not off.enabled
    assert SpeculativeConfig(method="ngram").enabled


@pytest.mark.parametrize("method, block, want", [("ngram", None, 5), ("draft_model", None, 4), ("dflash", 16, 15)])
def test_draft_tokens_default_per_method(method, block, want):
    spec = SpeculativeConfig(method=method, model=None if method == "ngram" else "m")
    assert spec.draft_tokens(block) == want
    assert SpeculativeConfig(method=method, model=spec.model, num_speculative_tokens=2).draft_tokens(block) == 2


def test_an_unknown_key_is_named_with_the_known_ones():
    with pytest.raises(RequestError, match="num_spec_tokens.*known: adaptive, draft_dtype, method"):
        SpeculativeConfig.parse({"method": "ngram", "num_spec_tokens": 3})


@pytest.mark.parametrize("key, value, allowed", [
    ("method", "eagle9", "dflash, draft_model, ngram"),
    ("num_speculative_tokens", 0, "positive integer"),
    ("num_speculative_tokens", "4", "positive integer"),
    ("num_speculative_tokens", True, "positive integer"),
    ("adaptive", "no", "true or false"),
    ("ngram_first", 1, "true or false"),
    ("prompt_lookup_min", 0, "positive integer"),
    ("prompt_lookup_max", 2.5, "positive integer"),
    ("draft_dtype", "int4", "float32, bfloat16"),
])
def test_a_bad_value_names_its_key_and_the_allowed_values(key, value, allowed):
    with pytest.raises(RequestError) as error:
        SpeculativeConfig.parse({"method": "draft_model", "model": "small", key: value})
    assert f"['{key}']" in str(error.value) and allowed in str(error.value)


@pytest.mark.parametrize("config, message", [
    ({"method": "dflash"}, "needs a draft model"),
    ({"method": "ngram", "ngram_first": True}, "ngram_first"),
    ({"num_speculative_tokens": 3}, "needs a method"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
])
def test_inconsistent_settings_are_refused(config, message):
    with pytest.raises(RequestError, match=message):
        SpeculativeConfig.parse(config)


def test_speculative_config_of_another_type_is_refused():
    with pytest.raises(RequestError, match="dict or a SpeculativeConfig"):
        EngineArgs(speculative_config="ngram")


# ---------------------------------------------------------------------- environment
@pytest.mark.parametrize("raw, want", [(None, None), ("1", True), (" TRUE ", True), ("on", True), ("0", False),
                                       ("no", False), ("Off", False), ("2", None), ("", None)])
def test_triton_setting_reads_a_three_way_switch(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("LUCEBOX_TRITON", raising=False)
    else:
        monkeypatch.setenv("LUCEBOX_TRITON", raw)
    assert config.triton_setting() is want


@pytest.mark.parametrize("reader, name, unset, on, off", [
    (config.pdl_enabled, "LUCEBOX_PDL", True, True, False),
    (config.pdl_tiles, "LUCEBOX_PDL_TILES", False, True, False),
    (config.int8_activations_setting, "LUCEBOX_INT8_ACTIVATIONS", None, True, False),
    (config.triton_interpret, "TRITON_INTERPRET", False, True, False),
])
def test_each_switch_has_its_default_and_reads_the_environment_at_each_call(monkeypatch, reader, name, unset, on,
                                                                             off):
    monkeypatch.delenv(name, raising=False)
    assert reader() is unset
    monkeypatch.setenv(name, "1")
    assert reader() is on
    monkeypatch.setenv(name, "0")
    assert reader() is off


def test_cache_dir_defaults_to_the_user_cache_and_follows_lucebox_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("LUCEBOX_CACHE", raising=False)
    assert config.cache_dir() == Path.home() / ".cache" / "lucebox"
    monkeypatch.setenv("LUCEBOX_CACHE", str(tmp_path))
    assert config.cache_dir() == tmp_path


def _reads_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
    return False


def test_only_config_reads_the_environment():
    readers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if _reads_environment(ast.parse(p.read_text()))]
    assert readers == ["config.py"]


def test_readme_documents_every_variable_config_reads():
    read = set(re.findall(r'os\.environ\.get\("(LUCEBOX_\w+)"', (PACKAGE / "config.py").read_text()))
    table = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `LUCEBOX_")]
    documented = {re.match(r"\| `(LUCEBOX_\w+)`", line).group(1) for line in table}
    assert read == {"LUCEBOX_TRITON", "LUCEBOX_PDL", "LUCEBOX_PDL_TILES", "LUCEBOX_INT8_ACTIVATIONS", "LUCEBOX_CACHE",
                    "LUCEBOX_BUCKET_CHUNKS", "LUCEBOX_DP4A_RUNS"}
    assert documented == read
