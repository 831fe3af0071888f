"""The real hermes and Open WebUI programs against a real `lucebox serve` on the bundled model, run only
where they are installed (`pip install hermes-agent`, `pip install open-webui`; CI installs neither):
hermes completes qualify's short form, and `lucebox launch openwebui` brings up Open WebUI, which lists
the served model and completes a chat through its own API, then stops it and the server."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from lucebox.agents.clients import CLIENTS
from lucebox.agents.launch import PACKAGE_ROOT
from lucebox.agents.qualify import SHORT_CHECKS, qualify_client
from lucebox.config import child_environment


def _require(name: str) -> None:
    c = CLIENTS[name]
    if shutil.which(c.binary) is None:
        pytest.skip(f"{c.binary} is not on PATH (install: {c.install_command}; too heavy for CI)")


def test_hermes_qualifies_on_the_bundled_model(tmp_path):
    _require("hermes")
    result = qualify_client("hermes", tmp_path / "hermes", model=None, max_model_len=65536, short=True,
                            install=False, timeout=900, log=lambda message: None)
    report = "\n".join(f"{check}: {status} {detail}" for check, (status, detail) in result.checks.items())
    assert set(result.checks) == set(SHORT_CHECKS) and result.passed, report


def _call(url: str, token: str | None = None, body: dict | None = None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=300) as r:
        return json.loads(r.read())


def test_open_webui_launch_lists_the_model_and_chats(tmp_path):
    _require("openwebui")
    log = tmp_path / "launch.log"
    with open(log, "w") as err:
        launch = subprocess.Popen([sys.executable, "-m", "lucebox.cli", "launch", "openwebui"], stderr=err,
                                  stdout=subprocess.DEVNULL, env=child_environment(PACKAGE_ROOT), cwd=tmp_path)
    try:
        deadline, ready = time.monotonic() + 600, None
        while ready is None and time.monotonic() < deadline and launch.poll() is None:
            ready = re.search(r"openwebui is ready: open (http://\S+)\]", log.read_text())
            time.sleep(1)
        assert ready, log.read_text()[-3000:]
        web = ready.group(1)
        token = _call(web + "/api/v1/auths/signin", body={"email": "", "password": ""})["token"]  # WEBUI_AUTH=False
        models = [m["id"] for m in _call(web + "/api/models", token)["data"]]
        assert models == ["default"]
        reply = _call(web + "/api/chat/completions", token, {"model": "default", "stream": False, "max_tokens": 8,
                                                             "messages": [{"role": "user", "content": "Say hello"}]})
        assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] > 0
    finally:
        launch.send_signal(signal.SIGTERM)
        code = launch.wait(60)
    assert "[lucebox serve stopped]" in log.read_text() and code != 0
    with pytest.raises(OSError):
        urllib.request.urlopen(web + "/health", timeout=5)
    assert list(tmp_path.iterdir()) == [log]  # nothing written where it ran
