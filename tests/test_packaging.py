"""The wheel: `python -m build --wheel` makes one that installs into a new venv and runs
`lucebox generate` and `lucebox serve` with the bundled default model it carries.

By default the venv sees the system site-packages, so that torch and the other heavy dependencies
are not installed again (a fully separate venv costs ~65 s of installs here); lucebox itself is
installed from the wheel into the venv and every command runs from an empty directory, so the
checkout cannot leak in (the tests check lucebox.__file__ and the model path). Set
LUCEBOX_TEST_ISOLATED_VENV=1 for a venv without system site-packages, which also proves that the
wheel's dependency list is complete (torch is pinned to the running version: pip then takes the
local CPU build instead of fetching a CUDA one).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

from tests.server_helpers import free_port, wait_until_healthy

pytest.importorskip("build", reason="the wheel test needs `build` (pip install build)")

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", "lucebox", "models"]  # what the wheel is made of
PROMPT = "def fibonacci(n):"
ISOLATED = os.environ.get("LUCEBOX_TEST_ISOLATED_VENV") == "1"


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


class Installed:
    def __init__(self, root: Path):
        self.root = root
        self.venv = root / "venv"
        self.bin = self.venv / "bin"
        self.cwd = root / "elsewhere"  # an empty working directory: no checkout on sys.path
        self.cwd.mkdir()
        # no PYTHONPATH into the checkout; a fallback demo model would be built under this cache
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env.update(LUCEBOX_CACHE=str(root / "cache"), OMP_NUM_THREADS="1")

    def run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return _run(args, timeout, cwd=self.cwd, env=self.env)

    @property
    def site_packages(self) -> Path:
        out = self.run([str(self.bin / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
        return Path(out.stdout.strip())


def _build_wheel(root: Path) -> Path:
    # a copy of the inputs: setuptools' build/ directory in the checkout could hold stale files
    src = root / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(root / "dist"), str(src)], timeout=300)
    (wheel,) = (root / "dist").glob("lucebox-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed():
    with tempfile.TemporaryDirectory(prefix="lucebox-wheel-") as tmp:  # removed at once: a venv is big
        root = Path(tmp)
        wheel = _build_wheel(root)
        box = Installed(root)
        venv.EnvBuilder(system_site_packages=not ISOLATED).create(box.venv)
        # this pip, run against the venv's Python: saves seeding the venv with a pip of its own
        pip = [sys.executable, "-m", "pip", "--python", str(box.bin / "python"), "install", "-q",
               "--disable-pip-version-check"]
        if ISOLATED:
            import torch
            box.run(pip + [f"torch=={torch.__version__.split('+')[0]}"], timeout=600)
        else:  # the checkout's lucebox may be installed in the system site-packages: put the wheel's first
            box.run(pip + ["--no-deps", "--force-reinstall", str(wheel)], timeout=300)
        box.run(pip + [f"{wheel}[server]"], timeout=600)
        box.wheel = wheel
        yield box


def test_wheel_carries_the_bundled_model_and_static_files(installed):
    import zipfile
    names = set(zipfile.ZipFile(installed.wheel).namelist())

    def files(folder: Path) -> list[str]:  # paths from the repository root
        return [p.relative_to(ROOT).as_posix() for p in folder.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts]

    for path in files(ROOT / "models" / "default") + files(ROOT / "models" / "default-dflash"):
        assert "lucebox/bundled_" + path in names  # models/x -> lucebox/bundled_models/x
    for path in files(ROOT / "lucebox" / "server" / "static"):
        assert path in names
    assert not any(n.startswith(("tests/", "models/", "scripts/")) or n.endswith(".gguf") for n in names)
    print(f"\nwheel: {installed.wheel.stat().st_size / 2**20:.1f} MiB")


def test_lucebox_is_imported_from_the_wheel(installed):
    out = installed.run([str(installed.bin / "python"), "-c",
                         "import lucebox, lucebox.default_model as d; print(lucebox.__file__); print(d.BUNDLED)"])
    package, bundled = out.stdout.split()
    site = installed.site_packages
    assert Path(package) == site / "lucebox" / "__init__.py"
    assert Path(bundled) == site / "lucebox" / "bundled_models" / "default"


def test_generate_uses_the_bundled_trained_model(installed):
    out = installed.run([str(installed.bin / "lucebox"), "generate", "--max-tokens", "8", "--temperature", "0",
                         "--prompt", PROMPT])
    assert str(installed.site_packages / "lucebox" / "bundled_models" / "default") in out.stderr
    assert "random weights" not in out.stderr and not (installed.root / "cache").exists()
    assert "[8 tokens in" in out.stderr
    # the same greedy continuation as the checkout's own default model gives
    from lucebox import LLM, SamplingParams
    reference = LLM().generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.stdout.strip() == (PROMPT + reference.outputs[0].text).strip()


def test_docker_entrypoint_serves_the_openai_sdk(installed):
    """docker/entrypoint.sh, the images' command, with the venv in place of the image's Python: a
    model directory named by LUCEBOX_MODEL (as one under /models), the later --host/--port winning."""
    from openai import OpenAI
    port = free_port()
    model_dir = installed.site_packages / "lucebox" / "bundled_models" / "default"
    env = dict(installed.env, PATH=f"{installed.bin}{os.pathsep}{os.environ['PATH']}", LUCEBOX_MODEL=str(model_dir))
    command = ["sh", str(ROOT / "docker" / "entrypoint.sh"), "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "1024"]
    log = open(installed.root / "serve.log", "w+")
    proc = subprocess.Popen(command, cwd=installed.cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, 120, lambda: (log.seek(0), log.read()[-3000:])[1])
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        (model,) = client.models.list().data
        assert model.id == "default"  # LUCEBOX_MODEL's directory name
        reply = client.chat.completions.create(model=model.id, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Write a Python add function."}])
        choice = reply.choices[0]
        assert choice.message.role == "assistant" and choice.message.content
        assert choice.finish_reason in ("stop", "length") and 0 < reply.usage.completion_tokens <= 8
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        log.close()
    assert code in (0, -signal.SIGTERM)  # uvicorn may re-raise the signal it handled
