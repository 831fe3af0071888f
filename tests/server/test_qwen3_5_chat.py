"""A Qwen 3.5 / 3.6 hybrid served with its own chat template (tests/fixtures/qwen3_5_chat_template.jinja,
the template the Qwen3.5 checkpoints ship, as llama.cpp keeps it in models/templates/Qwen3.5-4B.jinja):
the prompt opens a <think> block unless thinking is off, reasoning comes back split out, and
Qwen3-Coder XML tool calls come back as tool calls, through the official SDKs of both APIs."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import anthropic
import openai
import pytest

from lucebox.server.config import ServerConfig
from lucebox.server.generate import render_chat
from lucebox.server.openai_chat import chat_job
from lucebox.server.protocol import ChatCompletionRequest
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import HYBRID
from tests.server_helpers import build_model, start_server

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen3_5_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
# What a Qwen3.6 model writes after the template's "<think>\n": reasoning, then an XML tool call.
REPLY = ("The user wants the weather in Paris.\n</think>\n\nLet me check."
         "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5-chat")
    tok_dir = build_model(root).parent / "tok"  # the tag-aware tokenizer of the server tests
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=TEMPLATE)))
    model_dir = build_hf_model("qwen3", root / "hybrid", tok_dir, **dict(HYBRID, max_position_embeddings=4096))
    srv, llm, forcing = start_server(model_dir, ServerConfig(keepalive=0.3), block_size=16, max_num_seqs=4)
    forcing.scripts["weather"] = REPLY
    srv.llm = llm
    yield srv
    srv.stop()


def test_the_served_model_is_the_hybrid(server):
    layers = server.llm.engine.model.layers
    assert [layer.kind for layer in layers] == HYBRID["layer_types"]


def test_chat_completions_split_reasoning_and_parse_xml_tool_calls(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "weather in Paris for 3 days?"}]
    reply = client.chat.completions.create(model="force:weather", messages=messages, tools=[WEATHER], max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content.strip() == "The user wants the weather in Paris."
    assert choice.message.content.strip() == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # typed by the schema

    streamed = client.chat.completions.create(model="force:weather", messages=messages, tools=[WEATHER],
                                              max_tokens=200, stream=True)
    reasoning, names, arguments = "", [], ""
    for chunk in streamed:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            names += [tc.function.name] if tc.function.name else []
            arguments += tc.function.arguments or ""
    assert reasoning.strip() == "The user wants the weather in Paris."
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris", "days": 3}


def test_the_tool_turn_renders_back_through_the_template(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=2)
    assert reply.usage.prompt_tokens > 0
    request = ChatCompletionRequest.model_validate(dict(model="tiny", messages=history, tools=[WEATHER], max_tokens=2))
    prepared = render_chat(SimpleNamespace(tokenizer=server.llm.tokenizer), chat_job(request))
    prompt = prepared.prompt_text
    assert reply.usage.prompt_tokens == len(prepared.prompt_ids)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_thinking_off_closes_the_think_block_in_the_prompt(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    on = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    off = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, reasoning_effort="none")
    tokenizer = server.llm.tokenizer
    for reply, thinking, ending in ((on, True, "<think>\n"), (off, False, "<think>\n\n</think>\n\n")):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        assert prompt.endswith("<|im_start|>assistant\n" + ending)
        assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_anthropic_messages_return_thinking_and_tool_use_blocks(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tool = {"name": "get_weather", "description": "weather of a city",
            "input_schema": WEATHER["function"]["parameters"]}
    reply = client.messages.create(model="force:weather", max_tokens=200, tools=[tool],
                                   messages=[{"role": "user", "content": "weather in Paris for 3 days?"}])
    assert reply.stop_reason == "tool_use"
    kinds = [block.type for block in reply.content]
    assert kinds[0] == "thinking" and kinds[-1] == "tool_use"
    assert reply.content[0].thinking.strip() == "The user wants the weather in Paris."
    assert reply.content[-1].name == "get_weather" and reply.content[-1].input == {"city": "Paris", "days": 3}
