"""A Poolside Laguna model served with its own chat template (tests/fixtures/laguna_xs2_chat_template.jinja:
poolside-Laguna-XS.2.jinja as llama.cpp keeps it in models/templates/, byte for byte), through the
official SDKs of the three APIs: the prompt ends in `<think>` (thinking on: the output starts in
reasoning) or `</think>` (off, the default: it is all content); tool calls in the arg_key format
(`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`, strings raw, other
values JSON) come back as OpenAI tool_calls, Anthropic tool_use blocks and Responses function_call
items, typed by the tool's schema, streamed or not, cut off by max_tokens or not; a tool conversation
renders back through the template as the model wrote it; and generation ends at the turn's
`</assistant>` whether the model writes it as its one token or spells it out. The server, its tokenizer
(built like poolside/Laguna-XS.2's) and scripted outputs: tests/server/laguna_server.py; constrained calls
and Laguna S 2.1's template: test_laguna_constrained.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lucebox.server.generate import render_chat
from lucebox.server.openai_chat import chat_job
from lucebox.server.parsing import ParsedOutput
from lucebox.server.protocol import ChatCompletionRequest
from lucebox.server.tools import tool_format
from tests.server.laguna_server import (  # noqa: F401  (server: the module's fixture)
    ANSWER, BASH, CALL, EOS, REASONING, REPLY_TWO_CALLS, SCHEMAS, SCRIPTS, THOUGHT, TURN_END, TWO_CALLS, WEATHER,
    anthropic_client, oai, parse, server)
from tests.server.test_gemma4_chat import _streamed_calls, _tokens_until


# ---------------------------------------------------------------------------------------------- template
def test_the_served_model_is_laguna_and_the_prompt_ends_by_thinking_mode(server):
    assert server.llm.engine.loaded.config.family == "laguna"
    tokenizer, messages = server.llm.tokenizer, [{"role": "user", "content": "hi"}]
    off = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    on = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True)
    assert off.startswith(EOS + "<system>\n\nYou are a helpful")
    assert off.endswith("<user>\nhi\n</user>\n<assistant>\n</think>")
    assert on == off.removesuffix("</think>") + "<think>"
    ids = tokenizer.encode(off, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.token_to_id("</think>") == ids[-1]
    assert tool_format(tokenizer.chat_templates) == "glm"


# ---------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize(("model", "thinking"), [("force:hello", False), ("force:hello-thinking", True)])
def test_chat_completions_split_reasoning_by_the_prompts_think_tag(server, model, thinking):
    client = oai(server)
    request = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=200,
                   extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    choice = client.chat.completions.create(**request).choices[0]
    want_reasoning = REASONING if thinking else None
    assert (getattr(choice.message, "reasoning_content", None), choice.message.content) == (want_reasoning, ANSWER)
    assert choice.finish_reason == "stop"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (want_reasoning or "", ANSWER)


def test_with_thinking_off_a_think_close_is_content():
    """The template already wrote </think>: nothing the model writes is reasoning unless it opens <think>."""
    assert parse("\nplain </think> text", after_reasoning=True) == ParsedOutput("plain </think> text", "", [])
    assert parse("\nreasoning\n</think>\nanswer", in_reasoning=True) == ParsedOutput("answer", "reasoning", [])


def test_anthropic_and_responses_return_reasoning_split_out(server):
    client = anthropic_client(server)
    reply = client.messages.create(model="force:hello-thinking", max_tokens=200,
                                   thinking={"type": "enabled", "budget_tokens": 1024},
                                   messages=[{"role": "user", "content": "hi"}])
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in reply.content] == [
        ("thinking", REASONING), ("text", ANSWER)]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    response = oai(server).responses.create(model="force:hello-thinking", input="hi", reasoning={"effort": "low"},
                                             store=False)
    assert response.output_text == ANSWER
    reasoning = [o for o in response.output if o.type == "reasoning"]
    assert reasoning and REASONING in json.dumps(reasoning[0].model_dump())


# ---------------------------------------------------------------------------------------------- turn end
@pytest.mark.parametrize("model", ["force:hello", "force:spelled"])
def test_generation_ends_at_the_turn_end_token_or_spelled_out(server, model):
    """`</assistant>` as its one token (an EOS id) or in pieces: the reply ends there, as the model's
    own end (finish "stop", end_turn), never as a stop sequence the client did not send."""
    messages = [{"role": "user", "content": "hi"}]
    choice = oai(server).chat.completions.create(model=model, messages=messages, max_tokens=100).choices[0]
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
    client = anthropic_client(server)
    reply = client.messages.create(model=model, max_tokens=100, messages=messages)
    assert [b.text for b in reply.content] == [ANSWER]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    assert reply.usage.output_tokens < len(server.llm.tokenizer.encode(SCRIPTS["hello"], add_special_tokens=False))
    with client.messages.stream(model=model, max_tokens=100, messages=messages) as s:
        streamed = s.get_final_message()
    assert [b.text for b in streamed.content] == [ANSWER] and streamed.stop_reason == "end_turn"
    # A client's own stop sequence is still reported as one.
    own = client.messages.create(model=model, max_tokens=100, messages=messages, stop_sequences=["help"])
    assert (own.stop_reason, own.stop_sequence) == ("stop_sequence", "help")


# ---------------------------------------------------------------------------------------------- tool calls
def test_arg_key_calls_parse_over_any_chunking_typed_by_the_schema():
    import random
    reply = REPLY_TWO_CALLS.removesuffix(TURN_END)  # where the server stops
    whole = parse(reply, param_schemas=SCHEMAS, after_reasoning=True)
    assert whole.content == "Checking." and [(n, json.loads(a)) for n, a in whole.calls] == TWO_CALLS
    rng = random.Random(1)
    for _ in range(100):
        assert parse(reply, lambda: rng.randint(1, 7), param_schemas=SCHEMAS, after_reasoning=True) == whole
    # A string parameter keeps the text as written; an integer one reads the number.
    typed = parse("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1.10</arg_value>\n"
                  "<arg_key>days</arg_key>\n<arg_value>4</arg_value>\n</tool_call>", param_schemas=SCHEMAS)
    assert json.loads(typed.calls[0][1]) == {"city": "1.10", "days": 4}
    # Without a schema: JSON where the text is a JSON number, object..., else the text itself.
    untyped = parse('<tool_call>f<arg_key>n</arg_key><arg_value>3</arg_value><arg_key>s</arg_key>'
                    '<arg_value>"q"</arg_value><arg_key>o</arg_key><arg_value>{"a": null}</arg_value></tool_call>')
    assert json.loads(untyped.calls[0][1]) == {"n": 3, "s": '"q"', "o": {"a": None}}
    # Constrained decoding may pad an enum's string: it is still the enum's value.
    padded = parse("<tool_call>temp<arg_key>unit</arg_key><arg_value> f</arg_value></tool_call>",
                   param_schemas={"temp": {"unit": {"enum": ["c", "f"]}}})
    assert json.loads(padded.calls[0][1]) == {"unit": "f"}
    # A call without arguments (how the template writes one).
    assert parse("<tool_call>list_files\n</tool_call>").calls == [["list_files", "{}"]]


def test_arg_key_calls_cut_off_keep_complete_members_and_a_name_cut_off_is_dropped():
    cut = parse(REPLY_TWO_CALLS[:REPLY_TWO_CALLS.index('"PATH"')], param_schemas=SCHEMAS)
    assert [n for n, _ in cut.calls] == ["get_weather", "Bash"]
    assert json.loads(cut.calls[1][1]) == {"command": 'echo "<b>hi</b>" > /tmp/x'}
    assert parse("Let me see.\n<tool_call>get_wea") == ParsedOutput("Let me see.", "", [])
    # Not a call at all: the text comes back as written.
    assert parse("a <tool_call>I think so</tool_call>").content == "a<tool_call>I think so</tool_call>"
    # The other formats still parse where a model slips into them.
    assert parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>').calls == [["f", '{"a": 1}']]


def test_chat_completions_return_arg_key_tool_calls(server):
    client = oai(server)
    request = dict(model="force:two-calls", messages=[{"role": "user", "content": "weather, then a command"}],
                   tools=[WEATHER, BASH], max_tokens=300)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == TWO_CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2
    _, content, streamed = _streamed_calls(client.chat.completions.create(**request, stream=True))
    assert streamed == TWO_CALLS and content == "Checking."


def test_anthropic_messages_return_arg_key_tool_use(server):
    client = anthropic_client(server)
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
    reply = client.messages.create(**dict(request, model="force:call",
                                          thinking={"type": "enabled", "budget_tokens": 1024}))
    assert [b.type for b in reply.content] == ["thinking", "tool_use"] and reply.content[0].thinking == THOUGHT
    assert reply.content[1].input == {"city": "Paris", "days": 3}


def test_responses_return_arg_key_function_calls(server):
    client = oai(server)
    tools = [dict(t["function"], type="function") for t in (WEATHER, BASH)]
    reply = client.responses.create(model="force:two-calls", input="weather, then a command", tools=tools, store=False)
    assert [(o.name, json.loads(o.arguments)) for o in reply.output if o.type == "function_call"] == TWO_CALLS
    with client.responses.stream(model="force:two-calls", input="weather, then a command", tools=tools) as s:
        streamed = s.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in streamed.output if o.type == "function_call"] == TWO_CALLS


@pytest.mark.parametrize("stream", [False, True])
def test_an_arg_key_call_cut_off_by_max_tokens(server, stream):
    client = anthropic_client(server)
    tool = {"name": "Bash", "input_schema": BASH["function"]["parameters"]}

    def reply(marker: str):
        kwargs = dict(model="force:two-calls", max_tokens=_tokens_until(server.llm, REPLY_TWO_CALLS, marker),
                      tools=[tool], messages=[{"role": "user", "content": "run it"}])
        if not stream:
            return client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as s:
            return s.get_final_message()
    before_name = reply("<tool_call>Ba")
    assert before_name.stop_reason == "max_tokens"
    assert [b.type for b in before_name.content] == ["text", "tool_use"]  # the first call is whole
    assert "<tool_call>" not in before_name.content[0].text
    in_arguments = reply('"DEBUG": 1, "PA')
    assert in_arguments.stop_reason == "max_tokens"
    last = in_arguments.content[-1]
    assert (last.type, last.name, last.input) == ("tool_use", "Bash", {"command": 'echo "<b>hi</b>" > /tmp/x'})
    n = _tokens_until(server.llm, REPLY_TWO_CALLS, '"DEBUG": 1, "PA')
    choice = oai(server).chat.completions.create(
        model="force:two-calls", messages=[{"role": "user", "content": "run it"}], tools=[WEATHER, BASH],
        max_tokens=n, stream=False).choices[0]
    assert choice.finish_reason == "length"
    assert json.loads(choice.message.tool_calls[-1].function.arguments) == {"command": 'echo "<b>hi</b>" > /tmp/x'}


# ---------------------------------------------------------------------------------------------- multi-turn
def test_a_tool_conversation_renders_back_as_the_model_wrote_it(server):
    """Call, result, answer: the second prompt holds the model's turn exactly as it wrote it (its
    reasoning, the call, </assistant>) and the result in the template's <tool_response> block."""
    client = oai(server)
    messages = [{"role": "user", "content": "weather in Paris for 3 days?"}]
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    first = client.chat.completions.create(model="force:call", messages=messages, tools=[WEATHER], max_tokens=200,
                                           extra_body=thinking)
    message = first.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, None)
    (call,) = message.tool_calls
    history = messages + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="force:answer", messages=history, tools=[WEATHER], max_tokens=50,
                                            extra_body=thinking)
    assert answer.choices[0].message.content == "It is sunny in Paris."
    request = ChatCompletionRequest.model_validate(dict(model="tiny", messages=history, tools=[WEATHER],
                                                        max_tokens=50, **thinking))
    prepared = render_chat(SimpleNamespace(tokenizer=server.llm.tokenizer), chat_job(request))
    assert answer.usage.prompt_tokens == len(prepared.prompt_ids)
    first_request = ChatCompletionRequest.model_validate(dict(model="tiny", messages=messages, tools=[WEATHER],
                                                              **thinking))
    first_prompt = render_chat(SimpleNamespace(tokenizer=server.llm.tokenizer), chat_job(first_request)).prompt_text
    # The model's whole turn, as it was generated after the first prompt, then the tool's result.
    assert prepared.prompt_text == (first_prompt + SCRIPTS["call"][:SCRIPTS["call"].index(TURN_END)] + TURN_END
                                    + "\n<tool_response>\nsunny, 21 degrees\n</tool_response>\n<assistant>\n<think>")


def test_an_anthropic_tool_turn_renders_the_same_prompt(server):
    client = anthropic_client(server)
    tool = {"name": "get_weather", "description": "weather of a city",
            "input_schema": WEATHER["function"]["parameters"]}
    question = [{"role": "user", "content": "weather in Paris for 3 days?"}]
    enabled = {"type": "enabled", "budget_tokens": 1024}
    reply = client.messages.create(model="force:call", max_tokens=200, tools=[tool], messages=question,
                                   thinking=enabled)
    thinking, tool_use = reply.content
    history = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                      "content": "sunny, 21 degrees"}]}]
    answer = client.messages.create(model="force:answer", max_tokens=50, tools=[tool], messages=history,
                                    thinking=enabled)
    assert answer.content[-1].text == "It is sunny in Paris." and answer.stop_reason == "end_turn"
    openai_history = question + [
        {"role": "assistant", "reasoning_content": thinking.thinking, "tool_calls": [{
            "id": tool_use.id, "type": "function",
            "function": {"name": tool_use.name, "arguments": json.dumps(tool_use.input)}}]},
        {"role": "tool", "tool_call_id": tool_use.id, "content": "sunny, 21 degrees"}]
    request = ChatCompletionRequest.model_validate(dict(model="tiny", messages=openai_history, tools=[WEATHER],
                                                        chat_template_kwargs={"enable_thinking": True}))
    prepared = render_chat(SimpleNamespace(tokenizer=server.llm.tokenizer), chat_job(request))
    assert f"<think>\n{THOUGHT}\n</think>\n{CALL}\n{TURN_END}\n<tool_response>" in prepared.prompt_text
    usage = answer.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(prepared.prompt_ids)
