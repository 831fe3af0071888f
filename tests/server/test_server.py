"""The server end to end: a real uvicorn server, the official openai and anthropic SDKs as clients.

Outputs that a random tiny model would never write (tool calls, reasoning) are forced through the
test-only request_processors hook (model "force:<key>"); everything after the logits is production.
"""
from __future__ import annotations

import concurrent.futures
import json
import time

import anthropic
import httpx
import openai
import pytest

from tests.server_helpers import build_model, start_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                 "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                   "properties": {}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
SCRIPTS = {
    "call": "<think>\nI need the weather.\n</think>\n\nChecking." + CALL,
    "two_calls": TWO_CALLS,
    "answer": "It is sunny in Paris.",
    "stop": "hello STOP world",
    "json": '{"city": "Rome"}',
    "patch": '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** End Patch"}}'
             "\n</tool_call>",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("server-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv, llm, forcing = start_server(model_dir, block_size=16, max_num_seqs=32)
    forcing.scripts.update(SCRIPTS)
    srv.llm = llm
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def user(text="Hello"):
    return [{"role": "user", "content": text}]


def kv_is_free(llm, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    blocks = llm.engine.scheduler.blocks
    while time.monotonic() < deadline:
        if not llm.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks:
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------ health, models, metrics
def test_health_and_models_report_the_real_context_length(server, oai):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    (model,) = oai.models.list().data
    assert model.id == "tiny" and model.context_length == server.llm.engine.max_model_len == 2048


def test_models_listing_for_codex_has_its_shape(server):
    body = httpx.get(server.url + "/v1/models", params={"client_version": "0.66.0"}).json()
    (m,) = body["models"]
    assert m["slug"] == "tiny" and m["context_window"] == 2048 and m["supported_reasoning_levels"]


def test_metrics_use_vllm_names_and_count_requests(server, oai):
    oai.chat.completions.create(model="tiny", messages=user(), max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert name in text
    success = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    assert sum(float(line.split()[-1]) for line in success) >= 1


# ------------------------------------------------------------------ chat completions
def test_chat_stream_equals_non_stream_and_reports_usage(oai):
    kwargs = dict(model="tiny", messages=user("Say something"), max_tokens=12, temperature=0)
    full = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12
    # the same prompt again is served from the prefix cache
    assert oai.chat.completions.create(**kwargs).usage.prompt_tokens_details.cached_tokens > 0


def test_chat_n_seed_logprobs_and_max_completion_tokens(oai):
    r = oai.chat.completions.create(model="tiny", messages=user(), n=2, seed=7, temperature=1.0,
                                    max_completion_tokens=5, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == 5 and len(c.logprobs.content[0].top_logprobs) == 2
    again = oai.chat.completions.create(model="tiny", messages=user(), n=2, seed=7, temperature=1.0,
                                        max_completion_tokens=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_chat_stop_string_ends_the_reply(oai):
    r = oai.chat.completions.create(model="force:stop", messages=user(), stop=["STOP"], max_tokens=30)
    assert r.choices[0].message.content == "hello" and r.choices[0].finish_reason == "stop"


def test_chat_reasoning_and_tool_call_round_trip(oai):
    r = oai.chat.completions.create(model="force:call", messages=user("Weather in Paris?"), tools=CHAT_TOOLS,
                                    max_tokens=80)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "I need the weather." and msg.content == "Checking."
    (call,) = msg.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = user("Weather in Paris?") + [msg.model_dump(exclude_none=True),
                                           {"role": "tool", "tool_call_id": call.id, "content": "21C, sunny"}]
    answer = oai.chat.completions.create(model="force:answer", messages=history, tools=CHAT_TOOLS, max_tokens=30)
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.choices[0].finish_reason == "stop"


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_calls(oai):
    kwargs = dict(model="force:two_calls", messages=user(), tools=CHAT_TOOLS, max_tokens=80)
    full = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, seen = {}, set()
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.index not in seen:  # first delta of an index: id, type and name
                seen.add(d.index)
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
    assert [calls[i] for i in sorted(calls)] == [[c.function.name, c.function.arguments] for c in full]
    assert len(full) == 2


def test_tool_choice_required_and_named_are_enforced_on_an_untrained_model(oai):
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "exact": {"type": "boolean"}},
              "required": ["unit", "exact"]}
    tools = [{"type": "function", "function": {"name": "temp", "parameters": schema}}, CHAT_TOOLS[1]]
    r = oai.chat.completions.create(model="tiny", messages=user(), tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=120, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("temp", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    r = oai.chat.completions.create(model="tiny", messages=user(), tools=tools, max_tokens=120, temperature=0.8,
                                    seed=3, tool_choice={"type": "function", "function": {"name": "temp"}})
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "temp" and args["unit"] in ("c", "f") and isinstance(args["exact"], bool)


def test_tool_choice_none_returns_no_calls(oai):
    r = oai.chat.completions.create(model="tiny", messages=user(), tools=CHAT_TOOLS, tool_choice="none",
                                    max_tokens=20)
    assert r.choices[0].message.tool_calls is None


def test_response_format_json_schema_is_enforced(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["c", "f"]}},
              "required": ["ok", "unit"], "additionalProperties": False}
    r = oai.chat.completions.create(model="tiny", messages=user(), max_tokens=60, temperature=0,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value["ok"], bool) and value["unit"] in ("c", "f")
    r = oai.chat.completions.create(model="force:json", messages=user(), response_format={"type": "json_object"},
                                    max_tokens=30)
    assert json.loads(r.choices[0].message.content) == {"city": "Rome"}


def test_sixteen_simultaneous_streams(oai, server):
    def one(i):
        chunks = list(oai.chat.completions.create(model="tiny", messages=user(f"request {i}"), max_tokens=8,
                                                  stream=True, temperature=0))
        return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert results == [["length"]] * 16
    assert kv_is_free(server.llm)


def test_client_disconnect_aborts_and_frees_kv(server):
    body = {"model": "tiny", "messages": user("long"), "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.llm.engine.has_unfinished()
    assert kv_is_free(server.llm)


def test_keepalive_comments_and_pings_while_waiting(server):
    body = {"model": "force:slow", "messages": user(), "max_tokens": 5, "stream": True}
    raw = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).text
    assert ": keep-alive" in raw and raw.rstrip().endswith("data: [DONE]")
    body = {"model": "force:slow", "messages": user(), "max_tokens": 5, "stream": True}
    raw = httpx.post(server.url + "/v1/messages", json=body, timeout=30).text
    assert raw.count("event: ping") >= 2 and "event: message_stop" in raw


# ------------------------------------------------------------------ legacy completions
def test_completions_stream_non_stream_echo_and_logprobs(oai):
    full = oai.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0, echo=True,
                                  logprobs=2)
    c = full.choices[0]
    assert c.text.startswith("def add(a, b):") and len(c.logprobs.tokens) == 6
    assert c.text == "def add(a, b):" + "".join(c.logprobs.tokens)
    streamed = "".join(ch.choices[0].text for ch in oai.completions.create(
        model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0, stream=True))
    assert "def add(a, b):" + streamed == c.text


# ------------------------------------------------------------------ anthropic messages
ANTH_TOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]


def test_messages_text_stream_equals_non_stream(claude):
    kwargs = dict(model="force:answer", max_tokens=4, messages=user())
    full = claude.messages.create(**kwargs)
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 4 and full.content[0].text
    with claude.messages.stream(**kwargs) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == full.content[0].text and final.stop_reason == "max_tokens"
    assert types[0] == "message_start" and "content_block_start" in types and types[-1] == "message_stop"


def test_messages_tool_use_round_trip_with_thinking(claude):
    m = claude.messages.create(model="force:call", max_tokens=80, messages=user("Weather?"), tools=ANTH_TOOLS)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    tool_use = m.content[2]
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
    with claude.messages.stream(model="force:call", max_tokens=80, messages=user("Weather?"), tools=ANTH_TOOLS) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.content[2].input == tool_use.input and streamed.content[0].thinking == "I need the weather."
    history = user("Weather?") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "21C"}]}]
    answer = claude.messages.create(model="force:answer", max_tokens=30, messages=history, tools=ANTH_TOOLS)
    assert answer.content[0].text == "It is sunny in Paris." and answer.stop_reason == "end_turn"


def test_messages_stop_sequence_and_tool_choice(claude):
    m = claude.messages.create(model="force:stop", max_tokens=30, messages=user(), stop_sequences=["STOP"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP" and m.content[0].text == "hello"
    m = claude.messages.create(model="tiny", max_tokens=60, messages=user(), tools=ANTH_TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason in ("tool_use", "max_tokens") and m.content[-1].type == "tool_use"
    assert m.content[-1].name == "get_weather"


def test_count_tokens_strips_the_claude_code_billing_header(claude):
    plain = claude.messages.count_tokens(model="claude", messages=user(), system="You are Claude Code.")
    billed = claude.messages.count_tokens(model="claude", messages=user(), system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37; cc_entrypoint=cli; cch=9f2;"},
        {"type": "text", "text": "You are Claude Code."}])
    assert plain.input_tokens == billed.input_tokens > 0


def test_messages_report_cache_reads(claude):
    kwargs = dict(model="claude", max_tokens=3, messages=user("the same long prompt " * 8), system="Be terse.")
    claude.messages.create(**kwargs)
    assert claude.messages.create(**kwargs).usage.cache_read_input_tokens > 0


# ------------------------------------------------------------------ responses
RESP_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
              {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
              {"type": "web_search"}]


def test_responses_text_stream_event_order(oai):
    r = oai.responses.create(model="force:answer", input="Hello", instructions="Be brief.", max_output_tokens=4,
                             store=False)
    assert r.status == "incomplete" and r.output[0].type == "message" and r.usage.output_tokens == 4
    with oai.responses.stream(model="force:answer", input="Hello", instructions="Be brief.", max_output_tokens=4,
                              store=False) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert final.output_text == r.output_text
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.status == "incomplete"


def test_responses_function_call_round_trip(oai):
    r = oai.responses.create(model="force:call", input="Weather?", tools=RESP_TOOLS, store=False)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    with oai.responses.stream(model="force:call", input="Weather?", tools=RESP_TOOLS) as s:
        streamed = s.get_final_response()
    assert streamed.output[2].arguments == call.arguments
    history = [{"type": "message", "role": "developer", "content": "Use tools."},
               {"type": "message", "role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "21C"}]
    answer = oai.responses.create(model="force:answer", input=history, tools=RESP_TOOLS, store=False)
    assert answer.output_text == "It is sunny in Paris." and answer.status == "completed"


def test_responses_custom_tool_is_answered_with_custom_tool_call(oai):
    r = oai.responses.create(model="force:patch", input="Fix it", tools=RESP_TOOLS, store=False)
    (item,) = r.output
    assert item.type == "custom_tool_call" and item.input == "*** Begin Patch\n*** End Patch"
    with oai.responses.stream(model="force:patch", input="Fix it", tools=RESP_TOOLS) as s:
        types = [e.type for e in s]
        streamed = s.get_final_response()
    assert streamed.output[0].type == "custom_tool_call" and streamed.output[0].input == item.input
    assert "response.custom_tool_call_input.done" in types
    follow = oai.responses.create(model="force:answer", store=False, tools=RESP_TOOLS, input=[
        {"type": "message", "role": "user", "content": "Fix it"},
        {"type": "custom_tool_call", "call_id": item.call_id, "name": "apply_patch", "input": item.input},
        {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "Done!"}])
    assert follow.output_text == "It is sunny in Paris."


def test_the_server_uses_only_the_async_engine_surface():
    """server/ builds through LLMEngine.from_args and reads the engine through AsyncEngine: never the CLI,
    the scheduler, the runner or the LLMEngine inside the AsyncEngine."""
    import ast
    import re
    from pathlib import Path
    server = Path(__file__).resolve().parents[2] / "lucebox" / "server"
    for path in server.glob("*.py"):
        source = path.read_text()
        modules = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in modules if m and m.split(".")[-1] == "cli"}, path.name
        for reach in (r"\bengine\.engine\b(?! import)", r"\.scheduler\b", r"\.runner\b", r"\.speculator\b"):
            assert not re.search(reach, source), (path.name, reach)
