"""Scripted model output for qualifying real clients (`lucebox serve --script FILE`, hidden, test only).

A small model cannot be trusted to call a client's tools, so a qualification run scripts what the
model says: each request is matched against rules (first match wins) and its output is forced token
by token, while the templates, parsers, streaming and engine stay the production ones. The file:

    {"rules": [{"last": "QUALIFY-TOOL", "tools": true, "output": "<tool_call>...</tool_call>"},
               {"last": "qualify-42", "output": "<think>...</think>The answer."},
               {"output": "ok", "token_delay": 0.0}],
     "log": "requests.jsonl"}

`last`: a substring of the request's last input item (a message, or a Responses input item; system
turns and OpenClaw's appended internal-context turns skipped), as JSON; `tools`: whether the request must declare tools (true) or must not (false); a rule without
conditions matches every request. Requests no rule matches get the model's own output. `log`: every
request body, one JSON line each, with the rule it matched (the run's transcript of the wire)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LuceboxError

RULE_KEYS = {"last", "tools", "output", "token_delay"}
CLIENT_CONTEXT = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"  # OpenClaw appends such a user turn after the user's own


@dataclass
class Rule:
    output: str
    last: str | None = None
    tools: bool | None = None
    token_delay: float = 0.0  # seconds before each forced token: a slow stream a client can be interrupted in

    def matches(self, body: dict) -> bool:
        if self.tools is not None and bool(body.get("tools")) != self.tools:
            return False
        return self.last is None or self.last in json.dumps(last_item(body), ensure_ascii=False)


def last_item(body: dict):
    """The newest input of a chat / Responses / Anthropic / completions request that is not a system turn
    (Claude Code appends system turns after the user's message)."""
    for key in ("messages", "input", "prompt"):
        value = body.get(key)
        if isinstance(value, list):
            turns = [item for item in value if not (isinstance(item, dict) and item.get("role") in ("system", "developer"))
                     and not _client_context(item)]
            return turns[-1] if turns else None
        if isinstance(value, str):
            return value
    return None


def _client_context(item) -> bool:
    content = item.get("content") if isinstance(item, dict) else None
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return isinstance(content, str) and content.lstrip().startswith(CLIENT_CONTEXT)


def load_script(path: str | Path) -> tuple[list[Rule], Path | None]:
    """The rules and the log path of a script file; a malformed file is an error naming what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise LuceboxError(f"--script {path}: cannot read the script: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise LuceboxError(f"--script {path}: expected an object with a 'rules' list")
    rules = []
    for i, raw in enumerate(data["rules"]):
        if not isinstance(raw, dict) or not isinstance(raw.get("output"), str) or set(raw) - RULE_KEYS:
            raise LuceboxError(f"--script {path}: rules[{i}] must be an object with a string 'output' and only "
                               f"the keys {', '.join(sorted(RULE_KEYS))}")
        rules.append(Rule(**raw))
    log = data.get("log")
    return rules, (path.parent / log if log else None)


class ForcedOutput:
    """Logits processor: the output is exactly `ids` (the text, then EOS)."""

    def __init__(self, ids: list[int], token_delay: float):
        self.ids, self.token_delay = ids, token_delay

    def __call__(self, history, logits):
        if self.token_delay:
            time.sleep(self.token_delay)
        out = torch.full_like(logits, float("-inf"))
        out[self.ids[min(len(history), len(self.ids) - 1)]] = 0.0
        return out


class Script:
    """The server's request_processors hook for a script file (see the module's docstring)."""

    def __init__(self, path: str | Path, tokenizer):
        self.rules, self.log = load_script(path)
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        self.lock = threading.Lock()

    def __call__(self, api: str, body: dict) -> list:
        index = next((i for i, rule in enumerate(self.rules) if rule.matches(body)), None)
        if self.log is not None:
            with self.lock, open(self.log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"time": time.time(), "api": api, "rule": index, "body": body}, default=str) + "\n")
        if index is None:
            return []
        rule = self.rules[index]
        return [ForcedOutput(self.tokenizer.encode(rule.output, add_special_tokens=False) + [self.eos],
                             rule.token_delay)]
