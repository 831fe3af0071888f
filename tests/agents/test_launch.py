"""`lucebox launch` with a stand-in program on PATH: the server is up and answers with the key the client
was given, the client's configuration is in its private home, and afterwards the server is gone and the
home removed. A missing client is a clear error with its install command."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lucebox.agents.launch import launch
from lucebox.cli import main
from lucebox.errors import LuceboxError

# Stands in for `codex`: records what it was given and asks the server for its models with the key.
FAKE_CODEX = f"""#!{sys.executable}
import json, os, sys, tomllib, urllib.request
home = os.environ["CODEX_HOME"]
config = tomllib.load(open(os.path.join(home, "config.toml"), "rb"))
provider = config["model_providers"][config["model_provider"]]
key = os.environ[provider["env_key"]]
request = urllib.request.Request(provider["base_url"] + "/models", headers={{"Authorization": "Bearer " + key}})
models = json.loads(urllib.request.urlopen(request, timeout=30).read())
try:
    urllib.request.urlopen(provider["base_url"] + "/models", timeout=30)
    without_key = 200
except urllib.error.HTTPError as e:
    without_key = e.code
json.dump({{"argv": sys.argv[1:], "home": home, "HOME": os.environ["HOME"], "config": config,
           "models": models, "without_key": without_key, "pid": os.getpid()}}, open(os.environ["FAKE_REPORT"], "w"))
if os.environ.get("FAKE_HANG"):
    import time
    time.sleep(600)
sys.exit(7)
"""


@pytest.fixture
def fake_codex(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "codex"
    program.write_text(FAKE_CODEX)
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_REPORT", str(tmp_path / "report.json"))
    return tmp_path / "report.json"


def _port_open(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def test_launch_runs_the_client_on_a_served_model_and_stops_the_server(fake_codex, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert launch("codex", ["exec", "hello"], max_model_len=4096) == 7  # the client's own status
    report = json.loads(fake_codex.read_text())
    assert report["argv"] == ["exec", "hello"]
    assert report["models"]["data"][0]["max_model_len"] == 4096  # launch's --max-model-len reached the server
    assert report["config"]["model"] == report["models"]["data"][0]["id"]
    assert report["without_key"] == 401  # the server launch started takes only the client's key
    assert Path(report["home"]).parent == Path(report["HOME"])
    assert not Path(report["HOME"]).exists()  # the private home is gone
    assert not _port_open(report["config"]["model_providers"]["lucebox"]["base_url"].removesuffix("/v1"))


def test_missing_client_names_its_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LuceboxError, match=r"npm install -g @openai/codex"):
        launch("codex", [])


def test_cli_reports_a_missing_client_without_a_traceback(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["launch", "opencode", "--", "run", "hi"]) == 1
    err = capsys.readouterr().err
    assert "opencode is not installed" in err and "npm install -g opencode-ai" in err and "Traceback" not in err


def test_sigterm_to_launch_stops_the_client_and_the_server(fake_codex, monkeypatch, tmp_path):
    env = dict(os.environ, FAKE_HANG="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    launcher = subprocess.Popen([sys.executable, "-m", "lucebox.cli", "launch", "codex", "--max-model-len", "4096"],
                                env=env, cwd=tmp_path, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not fake_codex.exists():
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.stderr.read()
        time.sleep(0.2)
    time.sleep(0.5)  # the report is complete
    report = json.loads(fake_codex.read_text())
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 128 + signal.SIGTERM
    assert not _port_open(report["config"]["model_providers"]["lucebox"]["base_url"].removesuffix("/v1"))
    with pytest.raises(ProcessLookupError):
        os.kill(report["pid"], 0)  # the client is gone too


def test_launch_flags_before_the_separator_and_client_arguments_after_it():
    from lucebox.agents.cli import split_client_args
    from lucebox.cli import build_parser
    argv, client_args = split_client_args(["-v", "launch", "codex", "--max-output", "256", "--", "exec", "--model", "x"])
    args = build_parser().parse_args(argv)
    assert (args.client, args.max_output, client_args) == ("codex", 256, ["exec", "--model", "x"])
    assert split_client_args(["serve", "--", "x"]) == (["serve", "--", "x"], None)  # only launch takes them
