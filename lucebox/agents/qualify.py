"""`lucebox qualify CLIENT...`: scripted sessions through the real clients against a real `lucebox serve`.

The model's output is scripted (`lucebox serve --script`, agents/script.py): asked with the marker
QUALIFY-TOOL it calls the client's shell tool with a command whose output (qualify-42) exists only
once the command has run; given that output back it streams a <think> block and a final answer. The
checks read the server's log of every request and the client's own JSON output:

  tool round trip   the client sent tools, ran the forced call and sent its output back
  streaming         every scripted request streamed, and the final answer reached the client
  reasoning         the <think> text reached the client as reasoning, not inside the answer
  long prompt       ~8K tokens more in the first prompt arrived whole (full form only)
  interrupted       the client killed mid-stream: the server aborts the request, stays healthy and
                    answers the next one (full form only)

Transcripts (requests, client output, server log, results.json) stay in --out."""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LuceboxError
from .clients import Client, Setup, client
from .launch import Server, client_env, exit_on_sigterm, find_binary, served_model

TOOL_MARKER, SLOW_MARKER, LONG_END = "QUALIFY-TOOL", "QUALIFY-SLOW", "QUALIFY-LONG-END"
COMMAND, RESULT = "printf 'qualify-%s' $((20+22))", "qualify-42"  # RESULT appears only when the command ran
REASONING, ANSWER = "QUALIFY-REASONING", "QUALIFY-DONE"
CHECKS = ("tool round trip", "streaming", "reasoning", "long prompt", "interrupted")
SHORT_CHECKS = CHECKS[:3]
PROMPT = f"{TOOL_MARKER}: run the shell command {COMMAND} and tell me what it printed."


@dataclass(frozen=True)
class Recipe:
    """How one client runs a scripted, non-interactive session."""
    argv: Callable[[str], list[str]]  # prompt -> the client's arguments
    tool: str  # the client's shell tool
    arguments: Callable[[str], dict]  # command -> that tool's arguments
    extra_env: dict = field(default_factory=dict)


RECIPES = {
    "codex": Recipe(lambda p: ["exec", "--skip-git-repo-check", "--json", "--dangerously-bypass-approvals-and-sandbox", p],
                    "exec_command", lambda c: {"cmd": c}),
    "opencode": Recipe(lambda p: ["run", "--format", "json", "--thinking", "--auto", p],
                       "bash", lambda c: {"command": c, "description": "Print the qualification marker"}),
    "pi": Recipe(lambda p: ["-p", "--mode", "json", p], "bash", lambda c: {"command": c}),
    # the prompt first: --allowedTools takes every argument after it
    "claude-code": Recipe(lambda p: ["-p", p, "--output-format", "stream-json", "--verbose", "--allowedTools", "Bash"],
                          "Bash", lambda c: {"command": c, "description": "Print the qualification marker"}),
    # -z: one shot, approvals bypassed, only the final answer on stdout (its session lands in $HERMES_HOME)
    "hermes": Recipe(lambda p: ["-z", p], "terminal", lambda c: {"command": c}),
    # one headless embedded turn (no gateway); --json: its result envelope on stdout
    "openclaw": Recipe(lambda p: ["agent", "exec", "--json", p], "exec", lambda c: {"command": c}),
}


def tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def script_for(recipe: Recipe, log: str) -> dict:
    return {"log": log, "rules": [
        {"last": SLOW_MARKER, "tools": True, "output": "slowly " * 400, "token_delay": 0.25},
        {"last": TOOL_MARKER, "tools": True, "output": tool_call(recipe.tool, recipe.arguments(COMMAND))},
        {"last": RESULT, "tools": True, "output": f"<think>\n{REASONING}: the command printed {RESULT}.\n</think>\n\n"
                                                    f"{ANSWER}: the command printed {RESULT}."},
        {"output": "lucebox qualification"},  # the clients' side requests (titles, summaries)
    ]}


def long_text(lines: int = 700) -> str:
    """~8K tokens of numbered lines, ending in LONG_END."""
    words = "the engine keeps every sequence's cache in paged blocks and frees them at once"
    return "\n".join(f"{i:04d} {words}" for i in range(lines)) + f"\n{LONG_END}"


def _walk(value):
    """Every JSON object in a parsed JSON value, outermost first."""
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)


def _objects(stdout: str):
    """Every JSON object (recursively) in JSON or JSON-lines text."""
    try:
        yield from _walk(json.loads(stdout))
        return
    except json.JSONDecodeError:
        pass
    for line in stdout.splitlines():
        try:
            yield from _walk(json.loads(line))
        except json.JSONDecodeError:
            continue


def client_records(stdout: str, home: Path | None) -> list[dict]:
    """The objects of the client's JSON output and of the session files it kept in its home: JSON, JSON
    lines, and SQLite databases (hermes), whose text cells count as objects typed by their column."""
    records = list(_objects(stdout))
    for path in sorted(home.rglob("*")) if home else []:
        if not path.is_file() or path.stat().st_size >= 50 << 20:
            continue
        if path.suffix in (".json", ".jsonl"):
            records += _objects(path.read_text(errors="replace"))
        elif path.suffix == ".db":
            records += _sqlite_cells(path)
    return records


def _sqlite_cells(path: Path) -> list[dict]:
    cells = []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            for table_name in tables:
                cursor = db.execute(f'SELECT * FROM "{table_name}"')
                columns = [d[0] for d in cursor.description]
                for row in cursor:
                    for column, value in zip(columns, row):
                        if isinstance(value, str):
                            cells += _cell_objects(column, value)
        finally:
            db.close()
    except sqlite3.DatabaseError:  # not a database after all, or locked: it holds nothing to check
        return []
    return cells


def _cell_objects(column: str, value: str) -> list[dict]:
    """A cell holding a JSON document (opencode keeps each message part as JSON in a `data` column)
    counts as its objects, typed by themselves; any other text as one object typed by its column."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    objects = list(_walk(parsed)) if isinstance(parsed, (dict, list)) else []
    return objects or [{"type": column, "text": value}]


def _holding(objects: list[dict], text: str) -> list[str]:
    """The `type` of each object one of whose own string fields holds `text`."""
    return [str(o.get("type")) for o in objects if any(isinstance(v, str) and text in v for v in o.values())]


def reasoning_seen(objects: list[dict]) -> tuple[bool, str]:
    reasoning, answer = _holding(objects, REASONING), _holding(objects, ANSWER)
    as_reasoning = [t for t in reasoning if "reason" in t or "think" in t]
    leaked = [t for t in answer if t in reasoning]
    if not as_reasoning:
        return False, f"the reasoning reached the client as {reasoning or 'nothing'}"
    if leaked:
        return False, f"the reasoning leaked into the answer ({leaked})"
    return True, f"as {as_reasoning[0]!r}"


def requests(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@dataclass
class Result:
    client: str
    checks: dict[str, tuple[str, str]] = field(default_factory=dict)  # check -> (PASS | FAIL | SKIP, detail)
    seconds: float = 0.0

    def mark(self, check: str, ok: bool, detail: str = "") -> None:
        self.checks[check] = ("PASS" if ok else "FAIL", detail)

    @property
    def passed(self) -> bool:
        return all(status != "FAIL" for status, _ in self.checks.values())


def _metric(url: str, key: str, name: str) -> float:
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _run(argv, env, cwd, out: Path, timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    with open(out.with_suffix(".stdout"), "w") as o, open(out.with_suffix(".stderr"), "w") as e:
        try:
            code = subprocess.run(argv, env=env, cwd=cwd, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = -1
    return code, out.with_suffix(".stdout").read_text(), time.monotonic() - start


def qualify_client(name: str, out: Path, model: str | None, max_model_len: int, short: bool, install: bool,
                   timeout: float, log=print) -> Result:
    c: Client = client(name)
    if name not in RECIPES:
        raise LuceboxError(f"no qualification recipe for {name}; qualify one of {', '.join(RECIPES)}")
    recipe, result = RECIPES[name], Result(name)
    binary = find_binary(c, install)
    out.mkdir(parents=True, exist_ok=True)
    (out / "script.json").write_text(json.dumps(script_for(recipe, "requests.jsonl"), indent=1))
    work = out / "work"
    work.mkdir(exist_ok=True)
    start = time.monotonic()
    key = "qualify"
    home = out / "home"  # kept: the client's own session files are part of the transcript
    with Server(model, max_model_len, key, script=out / "script.json", log=out / "server.log") as server:
        served, context = served_model(server.url, key)
        env = client_env(c, Setup(home, server.url, key, served, context or max_model_len, workdir=work))
        env.update(recipe.extra_env)
        prompt = PROMPT if short else PROMPT + "\n\nA long appendix follows; ignore it.\n" + long_text()
        log(f"[{name}] session 1: tool round trip{'' if short else ' with a long prompt'}")
        code, stdout, seconds = _run([binary, *recipe.argv(prompt)], env, work, out / "session1", timeout)
        _check_session(result, requests(out / "requests.jsonl"), code, stdout, seconds, short, home)
        if not short:
            log(f"[{name}] session 2: interrupted request")
            _check_interrupt(result, [binary, *recipe.argv(f"{SLOW_MARKER}: answer slowly.")], env, work, out,
                             server, key, served)
    result.seconds = time.monotonic() - start
    (out / "results.json").write_text(json.dumps({"client": name, "seconds": result.seconds,
                                                  "checks": result.checks}, indent=1))
    return result


def _check_session(result: Result, reqs: list[dict], code: int, stdout: str, seconds: float, short: bool,
                   home: Path) -> None:
    scripted = [r for r in reqs if r["rule"] is not None and r["rule"] in (1, 2)]
    called = any(r["rule"] == 1 for r in reqs)
    answered = [r for r in reqs if r["rule"] == 2]
    exit_note = f"exit {code}, {seconds:.0f} s"
    result.mark("tool round trip", called and bool(answered) and code == 0,
                f"{exit_note}; tool call forced: {called}; its output sent back: {bool(answered)}")
    streamed = bool(scripted) and all(r["body"].get("stream") for r in scripted)
    result.mark("streaming", streamed and ANSWER in stdout,
                f"streamed requests: {streamed}; answer reached the client: {ANSWER in stdout}")
    ok, detail = reasoning_seen(client_records(stdout, home)) if answered else (False, "no final turn")
    result.mark("reasoning", ok, detail)
    if not short:
        first = next((r for r in reqs if r["rule"] == 1), None)
        whole = first is not None and LONG_END in json.dumps(first["body"])
        result.mark("long prompt", whole and called, "the appendix's last line arrived" if whole else "it did not")


def _check_interrupt(result, argv, env, work, out: Path, server: Server, key: str, served: str) -> None:
    abort_metric = f'vllm:request_success_total{{model_name="{served}",finished_reason="abort"}}'
    aborted_before = _metric(server.url, key, abort_metric)
    with open(out / "session2.stdout", "w") as o, open(out / "session2.stderr", "w") as e:
        process = subprocess.Popen(argv, env=env, cwd=work, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            arrived = _wait_for_slow_request(out / "requests.jsonl", process)
            if arrived:
                time.sleep(8)  # the cached prefix prefills; the slow answer starts streaming
                process.send_signal(signal.SIGINT)
                process.wait(15)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if not arrived:
        result.mark("interrupted", False, f"the client exited ({process.returncode}) before its request arrived")
        return
    aborted = False
    for _ in range(60):
        aborted = _metric(server.url, key, abort_metric) > aborted_before
        if aborted:
            break
        time.sleep(0.5)
    healthy = _follow_up(server.url, key, served)
    result.mark("interrupted", aborted and healthy, f"server aborted it: {aborted}; next request answered: {healthy}")


def _wait_for_slow_request(log: Path, process: subprocess.Popen, timeout: float = 900) -> bool:
    deadline = time.monotonic() + timeout
    while not any(r["rule"] == 0 for r in requests(log)):
        if time.monotonic() > deadline or process.poll() is not None:
            return False
        time.sleep(0.5)
    return True


def _follow_up(url: str, key: str, model: str) -> bool:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        return bool(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"])
    except (OSError, ValueError, KeyError):
        return False


def table(results: list[Result], short: bool) -> str:
    checks = SHORT_CHECKS if short else CHECKS
    rows = ["| client | " + " | ".join(checks) + " | time |", "|---" * (len(checks) + 2) + "|"]
    for r in results:
        cells = [r.checks.get(c, ("SKIP", ""))[0] for c in checks]
        rows.append(f"| {r.client} | " + " | ".join(cells) + f" | {r.seconds:.0f} s |")
    return "\n".join(rows)


def main(args) -> int:
    exit_on_sigterm()
    out = Path(args.out or f"qualify-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    results = []
    for name in args.clients:
        try:
            r = qualify_client(name, out / name, args.model, args.max_model_len, args.short, args.install, args.timeout,
                               log=lambda m: print(m, flush=True))
        except LuceboxError as e:
            print(f"[{name}] not qualified: {e}", flush=True)
            r = Result(name)
            r.mark(CHECKS[0], False, str(e))
        results.append(r)
        for check, (status, detail) in r.checks.items():
            print(f"  {name:12s} {check:16s} {status}  {detail}", flush=True)
    print(table(results, args.short))
    print(f"transcripts: {out}")
    return 0 if all(r.passed for r in results) else 1
