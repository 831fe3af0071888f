"""A Gemma 4 text model served with Gemma 4's chat template (tests/fixtures/gemma4_chat_template.jinja:
google-gemma-4-31B-it.jinja as llama.cpp keeps it in models/templates/): its thought channel
(<|channel>thought\n ... <channel|>) comes back split out as reasoning, like <think>, through the
official SDKs of both APIs, whether the template opened the channel (thinking on) or the model does;
its tool calls (`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`) come back as OpenAI
tool_calls, Anthropic tool_use blocks and Responses function_call items, typed by the tool's schema,
and a tool conversation renders back through the template as the model wrote it.

Google's published template has had a variant that, with thinking off, closes an empty channel
after the generation prompt (`<|turn>model\n<|channel>thought\n<channel|>`, as transformers'
Gemma 4-family tests render it); the parser tests below cover that prompt ending too."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import anthropic
import openai
import pytest
import xgrammar as xgr

from lucebox.server.config import ServerConfig
from lucebox.server.constrain import GrammarFactory
from lucebox.server.generate import render_chat
from lucebox.server.openai_chat import chat_job
from lucebox.server.parsing import OutputParser, ParsedOutput, opens_reasoning
from lucebox.server.protocol import ChatCompletionRequest
from lucebox.server.tools import ToolSpec, tool_format
from tests.conftest import build_hf_model
from tests.model.test_gemma4 import DENSE
from tests.server_helpers import assert_tool_choice_holds_the_format, build_model, start_server

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "gemma4_chat_template.jinja").read_text()
REASONING, ANSWER = "The user greets me; answer briefly.", "Hello! How can I help?"
REPLY = f"<|channel>thought\n{REASONING}<channel|>{ANSWER}"  # thinking off: the model opens the channel itself
REPLY_IN_CHANNEL = f"{REASONING}\n<channel|>{ANSWER}"  # thinking on: the prompt opened it

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    # declared out of order: the template sorts the keys, and so must the grammar
    "parameters": {"type": "object", "properties": {"units": {"type": "string"}, "days": {"type": "integer"},
                                                    "city": {"type": "string"}},
                   "required": ["city"]}}}
BASH = {"type": "function", "function": {
    "name": "Bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"},
                                                    "env": {"type": "object"}}, "required": ["command"]}}}
THOUGHT = "I need the weather."
# A call as Gemma 4 writes one (keys sorted, as the template's dictsort teaches): `days` is a bare
# number and `units` a bare word the schema makes a string.
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
REPLY_CALL = f"<|channel>thought\n{THOUGHT}<channel|>{CALL}"
REPLY_TWO_CALLS = ('Checking.<|tool_call>call:get_weather{city:<|"|>Rome, Italy<|"|>,days:2,units:metric}<tool_call|>'
                   '<|tool_call>call:Bash{command:<|"|>echo "hi" > /tmp/x<|"|>,env:{DEBUG:1,PATH:<|"|>/bin<|"|>},'
                   'timeout:1.5}<tool_call|>')
TWO_CALLS = [("get_weather", {"city": "Rome, Italy", "days": 2, "units": "metric"}),
             ("Bash", {"command": 'echo "hi" > /tmp/x', "env": {"DEBUG": 1, "PATH": "/bin"}, "timeout": 1.5})]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in (WEATHER, BASH)}


def parse(text: str, sizes=None, **kwargs) -> ParsedOutput:
    parser, events, i = OutputParser(**kwargs), [], 0
    while i < len(text):
        k = sizes() if sizes else len(text)
        events += parser.feed(text[i:i + k])
        i += k
    return ParsedOutput.of(events + parser.finish())


def test_the_thought_channel_splits_over_any_chunking():
    want = ParsedOutput(ANSWER, REASONING, [])
    assert parse(REPLY) == want
    rng = random.Random(0)
    for _ in range(100):
        assert parse(REPLY, lambda: rng.randint(1, 5)) == want
    # A prompt that opened the channel starts the output inside it; a closed empty one does not.
    assert opens_reasoning("<|turn>model\n<|channel>thought\n")
    assert not opens_reasoning("<|turn>model\n<|channel>thought\n<channel|>")
    assert parse("thinking...<channel|>answer", in_reasoning=True) == ParsedOutput("answer", "thinking...", [])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-chat")
    tok_dir = build_model(root).parent / "tok"  # the tag-aware tokenizer of the server tests
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=TEMPLATE)))
    model_dir = build_hf_model("qwen3", root / "gemma4", tok_dir, **dict(DENSE, max_position_embeddings=4096))
    srv, llm, forcing = start_server(model_dir, ServerConfig(keepalive=0.3), block_size=16, max_num_seqs=4)
    forcing.scripts["hello"] = REPLY
    forcing.scripts["hello-thinking"] = REPLY_IN_CHANNEL
    forcing.scripts["call"] = REPLY_CALL
    forcing.scripts["two-calls"] = REPLY_TWO_CALLS
    forcing.scripts["answer"] = "It is sunny in Paris."
    srv.llm = llm
    yield srv
    srv.stop()


def test_the_served_model_is_gemma4_and_the_template_opens_the_channel_when_thinking(server):
    assert server.llm.engine.loaded.config.family == "gemma4"
    tokenizer, messages = server.llm.tokenizer, [{"role": "user", "content": "hi"}]
    on = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True)
    off = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert on.startswith("<|turn>system\n<|think|>\n<turn|>\n") and on.endswith("<|turn>model\n<|channel>thought\n")
    assert off == "<|turn>user\nhi<turn|>\n<|turn>model\n"
    assert opens_reasoning(on) and not opens_reasoning(off)


@pytest.mark.parametrize(("model", "thinking"), [("force:hello", False), ("force:hello-thinking", True)])
def test_chat_completions_split_the_thought_channel(server, model, thinking):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    request = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=200,
                   extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    message = client.chat.completions.create(**request).choices[0].message
    assert (message.reasoning_content.strip(), message.content.strip()) == (REASONING, ANSWER)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning.strip(), content.strip()) == (REASONING, ANSWER)


def test_anthropic_messages_return_a_thinking_block(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    for model, thinking in (("force:hello", {"type": "disabled"}),
                            ("force:hello-thinking", {"type": "enabled", "budget_tokens": 1024})):
        reply = client.messages.create(model=model, max_tokens=2000, thinking=thinking,
                                       messages=[{"role": "user", "content": "hi"}])
        assert [block.type for block in reply.content] == ["thinking", "text"]
        assert (reply.content[0].thinking.strip(), reply.content[1].text.strip()) == (REASONING, ANSWER)


def test_a_reply_with_its_thought_renders_back_without_it(server):
    """The template strips the thought channel from earlier model turns (strip_thinking)."""
    tokenizer = server.llm.tokenizer
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": REPLY},
               {"role": "user", "content": "again"}]
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    assert f"<|turn>model\n{ANSWER}<turn|>\n" in prompt and REASONING not in prompt


# ---------------------------------------------------------------------------------------------- tool calls
def test_gemma4_calls_parse_over_any_chunking_typed_by_the_schema():
    want = ParsedOutput("Checking.", "", [[name, json.dumps(args)] for name, args in TWO_CALLS])
    whole = parse(REPLY_TWO_CALLS, param_schemas=SCHEMAS)
    assert [(n, json.loads(a)) for n, a in whole.calls] == TWO_CALLS and whole.content == want.content
    rng = random.Random(1)
    for _ in range(100):
        assert parse(REPLY_TWO_CALLS, lambda: rng.randint(1, 7), param_schemas=SCHEMAS) == whole
    # Without a schema a bare word is still text, a bare number a number.
    assert json.loads(parse(CALL.replace("days:3", "days:3,units:metric")).calls[0][1]) == {
        "city": "Paris", "days": 3, "units": "metric"}
    # A string-typed parameter keeps the text as written; a quoted number for an integer is a number.
    typed = parse('<|tool_call>call:get_weather{city:1.10,days:<|"|>4<|"|>}<tool_call|>', param_schemas=SCHEMAS)
    assert json.loads(typed.calls[0][1]) == {"city": "1.10", "days": 4}


def test_gemma4_slips_into_json_quoting_still_read_as_strings():
    """Models write "x" or 'x' inside containers at times (vllm-project/vllm#51284)."""
    out = parse('<|tool_call>call:f{tags:["a", \'b\'],opts:{"mode": "fast"},n:None}<tool_call|>')
    assert json.loads(out.calls[0][1]) == {"tags": ["a", "b"], "opts": {"mode": "fast"}, "n": None}


def test_gemma4_call_cut_off_keeps_complete_members_and_a_name_cut_off_is_dropped():
    cut = parse('Let me see.<|tool_call>call:Bash{command:<|"|>ls -la<|"|>,env:{A:1,B:<|"|>x', param_schemas=SCHEMAS)
    assert cut.content == "Let me see." and [n for n, _ in cut.calls] == ["Bash"]
    assert json.loads(cut.calls[0][1]) == {"command": "ls -la", "env": {"A": 1}}
    assert parse("Let me see.<|tool_call>call:Bas") == ParsedOutput("Let me see.", "", [])
    # A number cut off could be a prefix of a longer one: it is not kept either.
    assert json.loads(parse('<|tool_call>call:f{a:<|"|>x<|"|>,b:12').calls[0][1]) == {"a": "x"}
    # Not a call at all: the text comes back as written.
    assert parse("a <|tool_call>hello<tool_call|>").content == "a<|tool_call>hello<tool_call|>"


def test_the_template_teaches_gemma4_calls(server):
    assert tool_format(server.llm.tokenizer.chat_templates) == "gemma4"


def _oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _streamed_calls(stream):
    reasoning, content, calls = "", "", {}
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
    return reasoning, content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


def test_chat_completions_return_gemma4_tool_calls(server):
    client = _oai(server)
    request = dict(model="force:two-calls", messages=[{"role": "user", "content": "weather, then a command"}],
                   tools=[WEATHER, BASH], max_tokens=300)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "Checking."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == TWO_CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2
    _, content, streamed = _streamed_calls(client.chat.completions.create(**request, stream=True))
    assert streamed == TWO_CALLS and content.strip() == "Checking."


def test_anthropic_messages_return_gemma4_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, BASH)]
    request = dict(model="force:two-calls", max_tokens=300, tools=tools,
                   messages=[{"role": "user", "content": "weather, then a command"}])
    reply = client.messages.create(**request)
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["text", "tool_use", "tool_use"]
    assert [(b.name, b.input) for b in reply.content[1:]] == TWO_CALLS
    with client.messages.stream(**request) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == TWO_CALLS
    # Thinking, then the call: a thinking block and a tool_use block.
    reply = client.messages.create(**dict(request, model="force:call"))
    assert [b.type for b in reply.content] == ["thinking", "tool_use"] and reply.content[0].thinking == THOUGHT
    assert reply.content[1].input == {"city": "Paris", "days": 3}


def test_responses_return_gemma4_function_calls(server):
    client = _oai(server)
    tools = [dict(t["function"], type="function") for t in (WEATHER, BASH)]
    reply = client.responses.create(model="force:two-calls", input="weather, then a command", tools=tools, store=False)
    calls = [(o.name, json.loads(o.arguments)) for o in reply.output if o.type == "function_call"]
    assert calls == TWO_CALLS
    with client.responses.stream(model="force:two-calls", input="weather, then a command", tools=tools) as s:
        streamed = s.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in streamed.output if o.type == "function_call"] == TWO_CALLS


def _tokens_until(llm, text: str, marker: str) -> int:
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        if marker in llm.tokenizer.decode(ids[:n], skip_special_tokens=False):
            return n
    raise AssertionError(f"{marker!r} not in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_gemma4_call_cut_off_by_max_tokens(server, stream):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tool = {"name": "Bash", "input_schema": BASH["function"]["parameters"]}
    script = REPLY_TWO_CALLS[REPLY_TWO_CALLS.index("<|tool_call>call:Bash"):]

    def reply(marker: str):
        kwargs = dict(model="force:two-calls", max_tokens=_tokens_until(server.llm, REPLY_TWO_CALLS, marker),
                      tools=[tool], messages=[{"role": "user", "content": "run it"}])
        if not stream:
            return client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as s:
            return s.get_final_message()
    assert script.startswith("<|tool_call>call:Bash")
    before_name = reply("call:Ba")
    assert before_name.stop_reason == "max_tokens"
    assert [b.type for b in before_name.content] == ["text", "tool_use"]  # the first call is whole
    assert "<|tool_call>" not in before_name.content[0].text
    in_arguments = reply("DEBUG:1,PA")
    assert in_arguments.stop_reason == "max_tokens"
    last = in_arguments.content[-1]
    assert last.type == "tool_use" and last.name == "Bash"
    assert last.input == {"command": 'echo "hi" > /tmp/x', "env": {"DEBUG": 1}}


def test_openai_arguments_of_a_cut_off_gemma4_call_are_valid_json(server):
    n = _tokens_until(server.llm, REPLY_TWO_CALLS, "DEBUG:1,PA")
    choice = _oai(server).chat.completions.create(
        model="force:two-calls", messages=[{"role": "user", "content": "run it"}], tools=[WEATHER, BASH],
        max_tokens=n).choices[0]
    assert choice.finish_reason == "length"
    assert json.loads(choice.message.tool_calls[-1].function.arguments) == {"command": 'echo "hi" > /tmp/x',
                                                                           "env": {"DEBUG": 1}}


def test_a_tool_conversation_renders_back_as_the_model_wrote_it(server):
    """Call, result, answer: the second request's prompt holds the model's call exactly as it wrote it,
    its thought channel, and the result in the template's tool-response block."""
    client = _oai(server)
    messages = [{"role": "user", "content": "weather in Paris for 3 days?"}]
    first = client.chat.completions.create(model="force:call", messages=messages, tools=[WEATHER], max_tokens=200)
    message = first.choices[0].message
    assert message.reasoning_content == THOUGHT and message.content is None
    (call,) = message.tool_calls
    history = messages + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="force:answer", messages=history, tools=[WEATHER], max_tokens=50)
    assert answer.choices[0].message.content == "It is sunny in Paris."
    request = ChatCompletionRequest.model_validate(dict(model="tiny", messages=history, tools=[WEATHER], max_tokens=50))
    prepared = render_chat(SimpleNamespace(tokenizer=server.llm.tokenizer), chat_job(request))
    assert answer.usage.prompt_tokens == len(prepared.prompt_ids)
    assert prepared.prompt_text.endswith(
        f"<|turn>model\n<|channel>thought\n{THOUGHT}\n<channel|>{CALL}"
        '<|tool_response>response:get_weather{value:<|"|>sunny, 21 degrees<|"|>}<tool_response|>')
    assert '<|tool>declaration:get_weather{description:<|"|>weather of a city<|"|>' in prepared.prompt_text


def test_an_anthropic_tool_turn_renders_the_same_prompt(server):
    """tool_use and tool_result blocks sent back reach the template as the OpenAI shapes do."""
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tool = {"name": "get_weather", "description": "weather of a city", "input_schema": WEATHER["function"]["parameters"]}
    question = [{"role": "user", "content": "weather in Paris for 3 days?"}]
    reply = client.messages.create(model="force:call", max_tokens=200, tools=[tool], messages=question)
    thinking, tool_use = reply.content
    history = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "sunny, 21 degrees"}]}]
    answer = client.messages.create(model="force:answer", max_tokens=50, tools=[tool], messages=history)
    assert answer.content[0].text == "It is sunny in Paris." and answer.stop_reason == "end_turn"
    openai_history = question + [
        {"role": "assistant", "reasoning_content": thinking.thinking, "tool_calls": [{
            "id": tool_use.id, "type": "function",
            "function": {"name": tool_use.name, "arguments": json.dumps(tool_use.input)}}]},
        {"role": "tool", "tool_call_id": tool_use.id, "content": "sunny, 21 degrees"}]
    request = ChatCompletionRequest.model_validate(dict(model="tiny", messages=openai_history, tools=[WEATHER]))
    prepared = render_chat(SimpleNamespace(tokenizer=server.llm.tokenizer), chat_job(request))
    assert CALL in prepared.prompt_text
    usage = answer.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(prepared.prompt_ids)


def test_tool_choice_required_and_named_hold_an_untrained_model_to_gemma4_calls(server):
    assert_tool_choice_holds_the_format(_oai(server), WEATHER)


def test_the_gemma4_grammar_takes_thought_then_calls_in_the_templates_key_order(server):
    llm = server.llm
    factory = GrammarFactory(llm.tokenizer, llm.engine.model.config.vocab_size, llm.engine.eos_token_ids)
    tools = [ToolSpec("get_weather", parameters=WEATHER["function"]["parameters"])]
    compiled = factory.tool_calls(tools, "required", "gemma4", parallel=True, in_reasoning=True)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.eos_token_id]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()
    assert accepts(f"{THOUGHT}\n<channel|>{CALL}")
    assert accepts(f"{THOUGHT}\n<channel|>{CALL}{CALL}")  # parallel calls follow each other
    assert not accepts(f"{THOUGHT}\n<channel|>" + CALL.replace("city:<|\"|>Paris<|\"|>,days:3",
                                                                 'days:3,city:<|\"|>Paris<|\"|>'))
    assert not accepts(f"{THOUGHT}\n</think>\n\n{CALL}")
    assert not accepts(f"{THOUGHT}\n<channel|>" + CALL.replace("Paris", "Paris<tool_call|>"))
