"""`lucebox bench serve`: load-test an OpenAI-compatible server (lucebox, vLLM, llama.cpp, ...) the
way vLLM's `bench serve` does: streaming requests at a Poisson request rate and/or a concurrency
cap (a sweep when given several values), reporting throughput and TTFT / TPOT / ITL / E2EL
percentiles under vLLM's names, plus the prefix-cache hit rate and speculation acceptance from the
server's /metrics counters over the run. `--url` measures a running server; `--model` (or neither:
the bundled default model) starts `lucebox serve` on a free port for the run."""
from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from ..config import child_environment, openai_api_key
from ..errors import LuceboxError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def _number_list(kind, what: str, allow_inf: bool = False):
    def parse(text: str) -> list:
        values = []
        for item in text.split(","):
            try:
                value = float(item) if kind is float else int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item.strip()!r} is not a {what} (give one or a comma list, e.g. 1,4,16)")
            if not value > 0 or (math.isinf(value) and not allow_inf):
                raise argparse.ArgumentTypeError(f"{item.strip()!r}: a {what} must be > 0")
            values.append(value)
        return values
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("server")
    target.add_argument("--url", default=None, help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", default=None, help="start `lucebox serve --model MODEL` for the run instead "
                                                      "(default without --url: the bundled default model)")
    target.add_argument("--serve-args", default="", help="extra flags for the started server, e.g. "
                                                         "'--max-num-seqs 64 --no-spec' (one flag: --serve-args=--no-spec)")
    target.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for the started "
                                                                            "server's /health")
    target.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS, help="API to stream from")
    target.add_argument("--served-model-name", default=None, help="model name to send (default: the server's first "
                                                                  "in /v1/models)")
    target.add_argument("--api-key", default=None, help="bearer token (unset: $OPENAI_API_KEY, if set)")
    target.add_argument("--tokenizer", default=None, help="model dir or GGUF whose tokenizer sizes prompts with "
                                                          "--url (default: the server's /tokenize, else 4 chars/token)")
    data = p.add_argument_group("prompts")
    data.add_argument("--dataset", default="random", help="random, agent (long shared prefix + growing turns), or a "
                                                          "JSONL / ShareGPT JSON file")
    data.add_argument("--num-prompts", type=int, default=100, help="requests per run")
    data.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    data.add_argument("--random-output-len", type=int, default=128, help="random, and file lines without max_tokens: "
                                                                         "tokens to generate")
    data.add_argument("--prefix-len", type=int, default=1024, help="agent: shared system prompt + tools, in tokens")
    data.add_argument("--suffix-len", type=int, default=64, help="agent: tokens of each user message / tool result")
    data.add_argument("--turns", type=int, default=4, help="agent: turns per conversation")
    data.add_argument("--agent-output-len", type=int, default=64, help="agent: tokens to generate per turn")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_number_list(float, "request rate", allow_inf=True), default=[math.inf],
                      help="requests per second, Poisson arrivals (inf: all at once); a comma list sweeps")
    load.add_argument("--max-concurrency", type=_number_list(int, "concurrency"), default=[None],
                      help="most requests in flight (default: no cap); a comma list sweeps, e.g. 1,4,16")
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")
    load.add_argument("--ignore-eos", action="store_true", help="generate every requested token (vLLM's extension)")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    out = p.add_argument_group("report")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics whose percentiles print")
    out.add_argument("--metric-percentiles", default="50,90,99", help="percentiles to report")
    out.add_argument("--save-result", action="store_true", help="write each run's JSON under --result-dir "
                                                                "(vLLM's file names)")
    out.add_argument("--result-dir", default=".", help="directory of --save-result")
    out.add_argument("--json", default=None, help="write the result JSON here (a list of results for a sweep)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def check_arguments(args) -> tuple[list[str], list[float]]:
    """Flag combinations argparse cannot check; returns the parsed metric names and percentiles."""
    if args.url and args.model:
        raise LuceboxError("give --url (a running server) or --model (start one), not both")
    for name in ("num_prompts", "random_input_len", "random_output_len", "prefix_len", "suffix_len", "turns",
                 "agent_output_len"):
        if getattr(args, name) < 1:
            raise LuceboxError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    names = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in names if m not in ("ttft", "tpot", "itl", "e2el")]
    if unknown:
        raise LuceboxError(f"--percentile-metrics: unknown {unknown} (choose from ttft, tpot, itl, e2el)")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise LuceboxError(f"--metric-percentiles {args.metric_percentiles!r}: give numbers like 50,90,99") from None
    if not all(0 < p <= 100 for p in percentiles):
        raise LuceboxError(f"--metric-percentiles {args.metric_percentiles!r}: each must be in (0, 100]")
    if args.url and not args.url.startswith(("http://", "https://")):
        raise LuceboxError(f"--url {args.url!r}: give the server's base URL, e.g. http://127.0.0.1:8000")
    return names, percentiles


def load_tokenizer(model: str):
    """The tokenizer of a HF model directory or GGUF file (or hub id), without loading weights."""
    from ..model.loader import resolve_path
    from ..text.tokenizer import Tokenizer
    from ..weights.gguf import open_gguf

    path = resolve_path(model)
    return Tokenizer.from_gguf(open_gguf(path), path) if path.is_file() else Tokenizer.from_hf_dir(path)


class LocalServer:
    """`lucebox serve` in a subprocess on a free local port, for the duration of a `with` block."""

    def __init__(self, model: str, serve_args: str, timeout: float):
        self.model, self.extra, self.timeout = model, shlex.split(serve_args), timeout
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalServer:
        import httpx

        package_root = str(Path(__file__).resolve().parents[2])  # the same lucebox in the child as here
        env = child_environment(package_root)
        cmd = [sys.executable, "-m", "lucebox.cli", "serve", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), *self.extra]
        print(f"[bench serve: starting {shlex.join(cmd[1:])}]", file=sys.stderr)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise LuceboxError(f"the started server exited with status {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise LuceboxError(f"the started server was not healthy after {self.timeout:.0f} s "
                                   f"(--server-timeout):\n{self.tail()}")
            time.sleep(0.25)

    def tail(self, lines: int = 20) -> str:
        self.log.seek(0)
        return "".join(self.log.readlines()[-lines:]).rstrip()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def main(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        raise LuceboxError("lucebox bench serve needs httpx: pip install 'lucebox[bench]'") from e
    from .serve_run import run_sweep

    names, percentiles = check_arguments(args)
    args.api_key = args.api_key or openai_api_key()
    tokenizer_source = args.tokenizer
    server = nullcontext()
    if not args.url:
        if args.model is None:
            from ..default_model import default_model_path
            args.model = str(default_model_path())
        tokenizer_source = tokenizer_source or args.model
        server = LocalServer(args.model, args.serve_args, args.server_timeout)
    tokenizer = load_tokenizer(tokenizer_source) if tokenizer_source else None
    with server as started:
        url = args.url or started.url
        results = asyncio.run(run_sweep(args, url, tokenizer, names, percentiles))
    return 0 if all(r["completed"] for r in results) else 1
