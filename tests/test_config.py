"""config.py: the one reader of each LUCEBOX_* environment variable."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lucebox import config

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lucebox"


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
    assert read == {"LUCEBOX_TRITON", "LUCEBOX_PDL", "LUCEBOX_PDL_TILES", "LUCEBOX_INT8_ACTIVATIONS", "LUCEBOX_CACHE"}
    assert documented == read
