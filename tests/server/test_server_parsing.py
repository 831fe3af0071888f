"""Server protocol units: the incremental parser over arbitrary chunkings, XML coercion, prompt
rendering of tool history for each API, and the grammar processor under speculative-style histories."""
from __future__ import annotations

import json
import random

import pytest
import torch

from lucebox.server.parsing import OutputParser, ParsedOutput

SCHEMAS = {"get_weather": {"days": {"type": "integer"}, "city": {"type": "string"}, "hot": {"type": "boolean"}}}
CASES = {
    "hermes_with_reasoning": (
        '<think>\nLet me see.\n</think>\n\nSure.<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Pa\\"ri}s", "n": [1, {"a": 2}]}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n'
        "</tool_call>",
        ParsedOutput("Sure.", "Let me see.", [["get_weather", '{"city": "Pa\\"ri}s", "n": [1, {"a": 2}]}'],
                                               ["f", "{}"]])),
    "qwen3_coder_xml": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=hot>\ntrue\n</parameter>\n</function>\n</tool_call>",
        ParsedOutput("", "", [["get_weather", '{"city": "New York", "days": 3, "hot": true}']])),
    "bare_xml_function_between_text": (
        "before <function=f>\n<parameter=x>\n1\n</parameter>\n</function> after",
        ParsedOutput("before after", "", [["f", '{"x": "1"}']])),
    "arguments_before_name": ('<tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call>',
                              ParsedOutput("", "", [["g", '{"a": 1}']])),
    "invalid_call_is_kept_as_text": ("<tool_call>not json</tool_call> ok",
                                     ParsedOutput("<tool_call>not json</tool_call> ok", "", [])),
    "partial_tag_at_end_is_text": ("a < b <thin", ParsedOutput("a < b <thin", "", [])),
}


def run(text: str, sizes=None, **kwargs) -> ParsedOutput:
    parser, events, i = OutputParser(param_schemas=SCHEMAS, **kwargs), [], 0
    while i < len(text):
        k = sizes() if sizes else len(text)
        events += parser.feed(text[i:i + k])
        i += k
    return ParsedOutput.of(events + parser.finish())


@pytest.mark.parametrize("name", CASES)
def test_parse_is_independent_of_chunk_boundaries(name):
    text, expected = CASES[name]
    assert run(text) == expected
    rng = random.Random(0)
    for _ in range(100):
        assert run(text, lambda: rng.randint(1, 6)) == expected


def test_partial_tags_are_held_back_and_nothing_else():
    parser = OutputParser()
    assert [e.text for e in parser.feed("Hello <tool")] == ["Hello"]
    assert parser.feed("_ca") == []
    events = parser.feed('ll>{"name": "f", "arguments": {"x"')
    assert [(e.kind, e.name or e.text) for e in events] == [("tool_start", "f"), ("tool_args", '{"x"')]


def test_prompt_ending_inside_think_starts_in_reasoning():
    out = run("I should answer.</think>\n\nHi!", in_reasoning=True)
    assert (out.reasoning, out.content) == ("I should answer.", "Hi!")


def test_tool_tags_are_plain_text_when_tools_are_off():
    assert run('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tools=False).calls == []


def test_streamed_arguments_are_a_prefix_of_the_final_ones():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "x}y", "b": [1, 2]}}\n</tool_call>'
    parser, so_far = OutputParser(), ""
    for ch in text:
        for e in parser.feed(ch):
            if e.kind == "tool_args":
                so_far += e.text
                assert '{"a": "x}y", "b": [1, 2]}'.startswith(so_far)
    json.loads(so_far)


# ------------------------------------------------------------------ prompt rendering of tool history
def test_each_api_renders_tool_calls_and_results_into_the_prompt(tmp_path):
    from lucebox.server.anthropic import anthropic_messages
    from lucebox.server.openai_chat import chat_messages
    from lucebox.server.protocol import ChatCompletionRequest, MessagesRequest, ResponsesRequest
    from lucebox.server.responses import responses_messages

    chat = chat_messages(ChatCompletionRequest(messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}]))
    assert chat[0] == {"role": "system", "content": "Be brief."}
    assert chat[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # templates |tojson a dict
    assert chat[3] == {"role": "tool", "content": "21C", "tool_call_id": "c1"}

    anth = anthropic_messages(MessagesRequest(model="claude", max_tokens=5, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
        {"type": "text", "text": "You are Claude Code."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "21C"}]}]}]))
    assert anth[0] == {"role": "system", "content": "You are Claude Code."}
    assert anth[2]["reasoning_content"] == "hmm" and anth[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert anth[3] == {"role": "tool", "content": "21C", "tool_call_id": "t1"}

    resp = responses_messages(ResponsesRequest(instructions="Be brief.", input=[
        {"type": "message", "role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Patch it"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
        {"type": "function_call", "call_id": "c3", "name": "shell", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c3", "output": "a.py"}]))
    assert resp[0] == {"role": "system", "content": "Be brief.\n\nUse tools."}
    assert resp[2]["reasoning_content"] == "think"
    assert resp[2]["tool_calls"][0]["function"]["arguments"] == {"input": "*** Begin Patch"}
    assert resp[3] == {"role": "tool", "content": "done", "tool_call_id": "c2"}
    assert resp[4]["tool_calls"][0]["function"] == {"name": "shell", "arguments": {"cmd": "ls"}}
    assert resp[5] == {"role": "tool", "content": "a.py", "tool_call_id": "c3"}


# ------------------------------------------------------------------ grammar processor
def test_grammar_processor_follows_each_rows_history(tmp_path):
    """Rows of one sequence in a speculative verify differ by draft tokens; n samples share the
    processor. Each row is masked by the grammar state of its own history."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lucebox.server.constrain import GrammarFactory
    from lucebox.text.tokenizer import Tokenizer as LTok

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(['{"a": true, "b": false}'] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ltok = LTok(tok)
    factory = GrammarFactory(ltok, ltok.vocab_size + 5, [0])
    proc = factory.processor(factory.response_format({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
        "additionalProperties": False}}}), n=2)
    ids = ltok.encode('{"a": true}', add_special_tokens=False)

    def allowed(history):
        return set(torch.nonzero(proc(list(history), torch.zeros(ltok.vocab_size + 5)) == 0).flatten().tolist())

    for k in range(len(ids)):  # forward, then jump back (rejected drafts), then forward again
        assert ids[k] in allowed(ids[:k])
        assert ids[0] in allowed([])
    assert allowed(ids) == {0}  # complete: only EOS
    assert ltok.encode("x", add_special_tokens=False)[0] not in allowed(ids[:1])


@pytest.mark.parametrize("text, expected", [
    ('{"a": 1, "b": "hel', {"a": 1}),
    ('{"cmd": "ls", "opts": {"x": [1, 2', {"cmd": "ls", "opts": {"x": [1]}}),
    ('{"a', {}), ("", {}), ("not json", {}), ('{"a": 1}', {"a": 1}),
    ('{"p": "say \\"hi\\"", "q": "c', {"p": 'say "hi"'}),
])
def test_truncated_arguments_keep_their_complete_members(text, expected):
    from lucebox.server.tools import parse_arguments
    assert parse_arguments(text) == expected
