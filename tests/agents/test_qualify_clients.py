"""CI's short qualification: the REAL Codex and OpenCode programs (npm; .ci/run installs them) against a
real `lucebox serve` on the bundled model: each sends its tools, runs the scripted call, sends the
output back and receives the streamed reasoning and answer. Skipped when the program is absent."""
from __future__ import annotations

import shutil

import pytest

from lucebox.agents.clients import CLIENTS
from lucebox.agents.qualify import SHORT_CHECKS, qualify_client


@pytest.mark.parametrize("name", ["codex", "opencode"])
def test_client_qualifies_on_the_bundled_model(name, tmp_path):
    c = CLIENTS[name]
    if shutil.which(c.binary) is None:
        pytest.skip(f"{c.binary} is not on PATH (install: {c.install_command}; .ci/run installs it)")
    result = qualify_client(name, tmp_path / name, model=None, max_model_len=65536, short=True, install=False,
                            timeout=900, log=lambda message: None)
    report = "\n".join(f"{check}: {status} {detail}" for check, (status, detail) in result.checks.items())
    assert set(result.checks) == set(SHORT_CHECKS), report
    assert result.passed, report + f"\ntranscripts: {tmp_path / name}"
