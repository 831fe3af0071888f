"""`lucebox launch CLIENT`: start `lucebox serve` (or use --url), write the client's configuration in a
private temporary home, run the real client, and stop the server after it exits."""
from __future__ import annotations

import json
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..config import cache_dir, child_environment, client_environment
from ..errors import LuceboxError
from .cli import DEFAULT_CONTEXT
from .clients import Client, Setup, client

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding this lucebox package


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, api_key: str | None = None, timeout: float = 10.0):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class Server:
    """`lucebox serve` as a child process on a free local port, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, model: str | None = None, max_model_len: int = DEFAULT_CONTEXT, api_key: str | None = None,
                 script: Path | None = None, log: Path | None = None, extra_args: list[str] | None = None,
                 start_timeout: float = 300.0):
        self.port, self.api_key, self.start_timeout = free_port(), api_key, start_timeout
        self.argv = [sys.executable, "-m", "lucebox.cli", "serve", "--port", str(self.port),
                     "--max-model-len", str(max_model_len)]
        self.argv += (["--model", model] if model else []) + (["--api-key", api_key] if api_key else [])
        self.argv += (["--script", str(script)] if script else []) + list(extra_args or [])
        self.log = log
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        # the child imports this same lucebox, wherever it was imported from
        env = child_environment(PACKAGE_ROOT)
        self._log_file = open(self.log, "ab") if self.log else tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)  # the client's Ctrl-C is not the server's
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.process.poll() is not None:
                raise LuceboxError(f"lucebox serve exited with status {self.process.returncode} before it was "
                                   f"ready:\n{self.log_tail()}")
            try:
                http_json(self.url + "/health", timeout=2)
                return self
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise LuceboxError(f"lucebox serve was not ready after {self.start_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 20) -> str:
        self._log_file.flush()
        self._log_file.seek(0)
        return "\n".join(self._log_file.read().decode("utf-8", "replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log_file.close()
        return self.process.returncode

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def served_model(url: str, api_key: str | None) -> tuple[str, int | None]:
    """The id and context window the server at `url` reports."""
    try:
        card = http_json(url.rstrip("/") + "/v1/models", api_key)["data"][0]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        raise LuceboxError(f"no lucebox server answered at {url}/v1/models ({e}); start one with `lucebox serve` "
                           f"or leave out --url") from e
    return card["id"], card.get("max_model_len")


def find_binary(c: Client, install: bool = False) -> str:
    """The client's program on PATH; installed first with --install; else an error naming the command."""
    path = shutil.which(c.binary)
    if path is None and install:
        print(f"[installing {c.name}: {c.install_command}]", file=sys.stderr)
        if subprocess.run(list(c.install)).returncode != 0:
            raise LuceboxError(f"installing {c.name} failed: {c.install_command}")
        path = shutil.which(c.binary)
    if path is None:
        raise LuceboxError(f"{c.name} is not installed ({c.binary!r} is not on PATH). Install it with:\n"
                           f"    {c.install_command}\nor run `lucebox launch {c.name} --install`")
    return path


def client_env(c: Client, setup: Setup) -> dict[str, str]:
    return client_environment(**c.configure(setup))


def launch(name: str, client_args: list[str], model: str | None = None, url: str | None = None,
           max_model_len: int = DEFAULT_CONTEXT, api_key: str | None = None, install: bool = False,
           max_output: int = 4096, serve_args: list[str] | None = None) -> int:
    """Run client `name` against lucebox; returns the client's exit status."""
    c = client(name)
    binary = find_binary(c, install)
    exit_on_sigterm()
    server = None
    if url is None:
        api_key = api_key or secrets.token_hex(16)  # only this client may use the server
        # clients that set no output limit (Codex) would otherwise let a small model write until the context is full
        server = Server(model, max_model_len, api_key,
                        extra_args=["--default-max-tokens", str(max_output), *(serve_args or [])])
        print(f"[starting lucebox serve on port {server.port} (--max-model-len {max_model_len})]", file=sys.stderr)
        server.start()
        url = server.url
    try:
        served, context = served_model(url, api_key)
        homes = cache_dir() / "agents"  # not under /tmp, where Codex refuses to put its helper programs
        homes.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{c.name}-", dir=homes) as home:
            setup = Setup(Path(home), url, api_key or "lucebox", served, context or max_model_len, max_output,
                          workdir=Path.cwd())
            env = client_env(c, setup)
            print(f"[{c.name} -> {url} ({served}); its configuration lives in {home} until it exits]", file=sys.stderr)
            web_args = web_arguments(c)
            return _run_client([binary, *c.args, *web_args, *client_args], env)
    finally:
        if server is not None:
            server.stop()
            print("[lucebox serve stopped]", file=sys.stderr)


def web_arguments(c: Client) -> list[str]:
    """A web app's arguments for a free local port; a thread prints its URL once it answers there."""
    if not c.web_args:
        return []
    port = free_port()
    web_url = f"http://127.0.0.1:{port}"
    threading.Thread(target=_announce_when_up, args=(c.name, web_url, c.web_ready), daemon=True).start()
    print(f"[{c.name} starting on {web_url}; Ctrl-C stops it and the server]", file=sys.stderr)
    return [a.replace("{port}", str(port)) for a in c.web_args]


def _announce_when_up(name: str, web_url: str, ready_path: str, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(web_url + ready_path, timeout=2).close()
            print(f"[{name} is ready: open {web_url}]", file=sys.stderr, flush=True)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(1)


def exit_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a closed terminal) unwinds like Ctrl-C, so the server and client are stopped."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _run_client(argv: list[str], env: dict[str, str]) -> int:
    process = subprocess.Popen(argv, env=env)
    try:
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:  # the client got the Ctrl-C too and decides; keep waiting for it
                continue
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
