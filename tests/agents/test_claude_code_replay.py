"""Claude Code's real request shapes, replayed in CI. Its ~38K-token first prompt takes minutes to prefill
on two CPU cores, so CI does not run the program (scripts/qualify_claude_code.sh does); instead the
requests it sent in that qualification go to a real server on a tiny model with the same script, and each
must get what the program received: the Bash tool_use (streamed, and in the non-streaming fallback Claude
Code retried with), then a thinking block and the final text. The fixture, data/claude_code_requests.json,
is Claude Code 2.1.197's requests as the server's script log holds them (long strings cut, nulls dropped)."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from lucebox import LLM
from lucebox.agents.qualify import ANSWER, COMMAND, REASONING, RECIPES, script_for
from lucebox.agents.script import Script
from lucebox.engine.async_engine import AsyncEngine
from lucebox.server.app import ServerConfig, create_app
from tests.server_helpers import ServerThread

REQUESTS = json.loads((Path(__file__).parent / "data" / "claude_code_requests.json").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("claude-replay")
    (root / "script.json").write_text(json.dumps(script_for(RECIPES["claude-code"], "requests.jsonl")))
    llm = LLM(str(tiny_model_dir), max_model_len=32768)
    script = Script(root / "script.json", llm.tokenizer)
    thread = ServerThread(create_app(AsyncEngine(llm.engine), ServerConfig(), "tiny", request_processors=script)).start()
    yield thread
    thread.stop()


def _blocks(response: httpx.Response) -> list[dict]:
    """The content blocks of an Anthropic SSE stream, deltas applied."""
    blocks = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"], partial=""))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[delta["type"]]
            blocks[-1][key] = blocks[-1].get(key, "") + delta.get(key if key != "partial" else "partial_json", "")
    return blocks


def test_the_fixture_holds_both_turns_of_the_round_trip():
    assert {row["rule"] for row in REQUESTS} >= {1, 2}


def _reply(url: str, body: dict) -> list[dict]:
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "x"}
    if body.get("stream"):
        with httpx.stream("POST", url + "/v1/messages", json=body, headers=headers, timeout=300) as response:
            assert response.status_code == 200, response.read()
            return _blocks(response)
    response = httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    return [dict(b, partial=json.dumps(b["input"])) if b["type"] == "tool_use" else b for b in response.json()["content"]]


@pytest.mark.parametrize("row", REQUESTS, ids=lambda row: f"rule{row['rule']}-{'stream' if row['body'].get('stream') else 'plain'}")
def test_claude_code_request_gets_what_the_program_got(server, row):
    blocks = _reply(server.url, row["body"])
    if row["rule"] == 1:
        calls = [b for b in blocks if b["type"] == "tool_use"]
        assert calls and calls[0]["name"] == "Bash"
        assert json.loads(calls[0]["partial"])["command"] == COMMAND
    elif row["rule"] == 2:
        assert [b["type"] for b in blocks] == ["thinking", "text"]
        assert REASONING in blocks[0]["thinking"] and blocks[1]["text"].startswith(ANSWER)
