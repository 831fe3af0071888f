"""The scripted-output hook of `lucebox serve --script`: rules match a request's last input and tools,
the forced text goes through the production parsers (a tool call, a reasoning block), and every
request is logged. Checked with the official openai SDK against a real server on a tiny model."""
from __future__ import annotations

import json

import openai
import pytest

from lucebox import LLM
from lucebox.agents.script import Rule, Script, load_script
from lucebox.cli import main
from lucebox.engine.async_engine import AsyncEngine
from lucebox.errors import LuceboxError
from lucebox.server.app import ServerConfig, create_app
from tests.server_helpers import ServerThread

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
SCRIPT = {"log": "requests.jsonl", "rules": [
    {"last": "CALL-A-TOOL", "tools": True, "output": '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'},
    {"last": "tool-output-7", "output": "<think>\nthe tool said 7\n</think>\n\nSeven."},
    {"tools": False, "output": "a title"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("script")
    (root / "script.json").write_text(json.dumps(SCRIPT))
    llm = LLM(str(tiny_model_dir), max_model_len=1024)
    script = Script(root / "script.json", llm.tokenizer)
    thread = ServerThread(create_app(AsyncEngine(llm.engine), ServerConfig(), "tiny", request_processors=script)).start()
    yield thread, root
    thread.stop()


def test_a_rule_forces_a_tool_call_through_the_streaming_parser(server):
    thread, _ = server
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x")
    stream = client.chat.completions.create(model="tiny", stream=True, tools=TOOLS, messages=[
        {"role": "user", "content": "please CALL-A-TOOL now"}])
    calls = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert calls[0].function.name == "run"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"cmd": "ls"}


def test_the_tool_result_turn_streams_reasoning_then_the_answer(server):
    thread, _ = server
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x")
    response = client.responses.create(model="tiny", tools=[{"type": "function", "name": "run", "parameters":
                                                             TOOLS[0]["function"]["parameters"]}], input=[
        {"role": "user", "content": "CALL-A-TOOL"},
        {"type": "function_call", "call_id": "c1", "name": "run", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "tool-output-7"}])
    reasoning = [i for i in response.output if i.type == "reasoning"]
    assert reasoning and reasoning[0].content[0].text == "the tool said 7"
    assert response.output_text == "Seven."


def test_rules_check_tools_and_unmatched_requests_are_the_models_own(server):
    thread, root = server
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x")
    # the marker without tools matches no tool rule: the tools=False rule answers
    titled = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "CALL-A-TOOL"}])
    assert titled.choices[0].message.content == "a title"
    free = client.chat.completions.create(model="tiny", tools=TOOLS, max_tokens=3, tool_choice="none",
                                          messages=[{"role": "user", "content": "hello"}])
    assert free.choices[0].message.content != "a title"
    logged = [json.loads(line) for line in (root / "requests.jsonl").read_text().splitlines()]
    assert [r["rule"] for r in logged][-2:] == [2, None] and logged[-1]["api"] == "chat"


def test_last_item_of_each_api_shape():
    rule = Rule(output="x", last="needle")
    assert rule.matches({"messages": [{"role": "user", "content": "needle"}]})
    assert rule.matches({"input": [{"type": "function_call_output", "output": "a needle"}]})
    assert rule.matches({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "needle"}]}]})
    assert not rule.matches({"messages": [{"role": "user", "content": "needle"}, {"role": "user", "content": "hay"}]})
    assert rule.matches({"input": "needle in a string"})
    # Claude Code's system turn after the user's message is not the newest input
    assert rule.matches({"messages": [{"role": "user", "content": "needle"}, {"role": "system", "content": "hay"}]})


@pytest.mark.parametrize("text, message", [
    ("not json", "cannot read the script"),
    ('{"rules": {}}', "a 'rules' list"),
    ('{"rules": [{"output": "x", "when": 1}]}', r"rules\[0\] must be an object"),
    ('{"rules": [{"last": "x"}]}', r"rules\[0\] must be an object with a string 'output'"),
])
def test_a_malformed_script_is_named(tmp_path, text, message):
    (tmp_path / "s.json").write_text(text)
    with pytest.raises(LuceboxError, match=message):
        load_script(tmp_path / "s.json")


def test_serve_refuses_a_malformed_script_before_loading_a_model(tmp_path, capsys):
    (tmp_path / "s.json").write_text('{"rules": 3}')
    assert main(["serve", "--model", str(tmp_path / "no-such-model"), "--script", str(tmp_path / "s.json")]) == 1
    assert "a 'rules' list" in capsys.readouterr().err


def test_openclaws_appended_context_turn_is_not_the_last_item():
    from lucebox.agents.script import last_item
    body = {"messages": [{"role": "user", "content": "QUALIFY-TOOL: run it"},
                         {"role": "user", "content": [{"type": "text", "text": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nnone"}]}]}
    assert last_item(body) == {"role": "user", "content": "QUALIFY-TOOL: run it"}
