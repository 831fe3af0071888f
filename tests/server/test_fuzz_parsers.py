"""Property-based fuzzing (hypothesis) of what the server parses and frames: the reasoning / tool-call
parser over any text and any chunking, well-formed calls of every format recovered exactly (Gemma 4's
as its real chat template writes them), XML and Gemma 4 values under any schema, and SSE framing read
back by a spec-following reader.
FUZZ_EXAMPLES scales the examples (scripts/fuzz_server.sh runs many)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lucebox.server.parsing import OutputParser, ParsedOutput
from lucebox.server.sse import sse
from lucebox.text.chat_template import render_chat_template

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10")) * 6
fuzz = settings(max_examples=EXAMPLES, deadline=None, database=None)

# Text made of the pieces that matter to the parser (tags, their fragments, JSON and XML punctuation)
# and anything else.
PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
          "</parameter>", "<", ">", "</", "<tool", "_call>", "think>", '{"name": "f", "arguments": ', "{", "}",
          "[", "]", '"', "\\", ",", ":", "\n", " ", "f", "x",
          "<|tool_call>", "<tool_call|>", '<|"|>', "call:f{", "call:", "<|", "|>", "'", "None", "1.5"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=40).map("".join)
JSON_SCHEMA_TYPES = ["string", "integer", "number", "boolean", "object", "array", "null"]
schemas = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5) |
                       st.sampled_from(JSON_SCHEMA_TYPES),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                           st.sampled_from(["type", "properties", "items", "enum"]) | st.text(max_size=4),
                           inner, max_size=3), max_leaves=8)


def parse(text: str, cuts: list[int], **kwargs) -> tuple[ParsedOutput, list]:
    parser = OutputParser(**kwargs)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    return ParsedOutput.of(events), events


def well_ordered(events) -> None:
    """Calls are numbered 0, 1, ... in order; arguments and the end only follow their call's start."""
    started, ended = [], set()
    for e in events:
        if e.kind == "tool_start":
            assert e.call == len(started) and e.name is not None
            started.append(e.call)
        elif e.kind in ("tool_args", "tool_end"):
            assert e.call in started and e.call not in ended
            if e.kind == "tool_end":
                ended.add(e.call)
        else:
            assert e.kind in ("content", "reasoning") and e.text


@fuzz
@given(text=texts, cuts=st.lists(st.integers(0, 400), max_size=12), tools=st.booleans(),
       in_reasoning=st.booleans())
def test_any_text_in_any_chunks_parses_as_it_does_whole(text, cuts, tools, in_reasoning):
    whole, _ = parse(text, [], tools=tools, in_reasoning=in_reasoning)
    chunked, events = parse(text, cuts, tools=tools, in_reasoning=in_reasoning)
    assert chunked == whole
    well_ordered(events)
    if not tools and "<think>" not in text and "</think>" not in text and not in_reasoning:
        assert whole.content == text.rstrip()  # no tags: the text as it is, less trailing whitespace


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                           allow_infinity=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=10)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,12}", fullmatch=True)


@fuzz
@given(calls=st.lists(st.tuples(names, st.dictionaries(st.text(max_size=6), json_values, max_size=4)),
                      min_size=1, max_size=3),
       before=st.text(max_size=10).filter(lambda t: "<" not in t), cuts=st.lists(st.integers(0, 2000), max_size=15))
def test_hermes_calls_are_recovered_exactly_in_any_chunks(calls, before, cuts):
    text = before + "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>'
                            for n, a in calls)
    out, events = parse(text, cuts)
    well_ordered(events)
    assert [(n, json.loads(a)) for n, a in out.calls] == [(n, a) for n, a in calls]
    assert out.content == before.rstrip()


xml_values = st.text(max_size=12).filter(lambda v: not re.search(r"</?(parameter|function|tool_call)", v))


@fuzz
@given(name=names, params=st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), xml_values,
                                          max_size=4),
       cuts=st.lists(st.integers(0, 600), max_size=15), wrapped=st.booleans())
def test_xml_calls_are_recovered_exactly_in_any_chunks(name, params, cuts, wrapped):
    body = f"<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) \
        + "</function>"
    text = f"<tool_call>\n{body}\n</tool_call>" if wrapped else body
    schemas = {name: {k: {"type": "string"} for k in params}}
    out, events = parse(text, cuts, param_schemas=schemas)
    well_ordered(events)
    assert [(n, json.loads(a)) for n, a in out.calls] == [(name, params)]


@fuzz
@given(raw=xml_values, schema=schemas)
@example(raw="NaN", schema={"type": "number"})  # found by this test: once coerced to a bare NaN
@example(raw="1e999", schema={"type": ["integer", "number"]})
@example(raw="1", schema={"type": [["integer"]]})  # found: an unhashable "type" raised
@example(raw="1", schema=True)  # found: a boolean schema raised
def test_xml_parameters_take_any_schema_a_client_declares(raw, schema):
    text = f"<tool_call>\n<function=f>\n<parameter=p>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    out, _ = parse(text, [], param_schemas={"f": {"p": schema}})
    [(name, args)] = out.calls
    value = json.loads(args, parse_constant=reject)["p"]  # whatever the schema: standard JSON arguments
    if value != raw:  # coerced: the JSON value the text spells, or a boolean
        assert value == json.loads(raw) if not isinstance(value, bool) else raw.strip().lower() == str(value).lower()


def reject(constant: str):
    raise AssertionError(f"{constant} is not JSON")


def read_sse(stream: str) -> list[dict]:
    """Events as the WHATWG spec reads them: lines end at CRLF, LF or CR; a blank line ends an event."""
    events, event = [], {}
    for line in re.split(r"\r\n|\r|\n", stream):
        if not line:
            if event:
                events.append(event)
            event = {}
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        event[field] = event[field] + "\n" + value if field == "data" and field in event else value
    return events


@fuzz
@given(payloads=st.lists(st.tuples(st.dictionaries(st.text(max_size=6), json_values, max_size=4),
                                   st.none() | st.sampled_from(["message_start", "ping", "content_block_delta"])),
                         min_size=1, max_size=5))
def test_sse_framing_reads_back_exactly(payloads):
    stream = "".join(sse(data, event) for data, event in payloads)
    events = read_sse(stream)
    assert [json.loads(e["data"]) for e in events] == [data for data, _ in payloads]
    assert [e.get("event") for e in events] == [event for _, event in payloads]


# ---------------------------------------------------------------------------------------------- Gemma 4
GEMMA_PIECES = ["<|tool_call>", "<tool_call|>", "call:f{", "call:g {", "call:", '<|"|>', "<|", '"|>', "{", "}",
                "[", "]", ",", ":", '"', "'", "\\", " ", "\n", "a", "b:", "1", "-2.5e3", "true", "None", "x y"]
gemma_texts = st.lists(st.one_of(st.sampled_from(GEMMA_PIECES), st.text(max_size=4)), max_size=40).map("".join)


@fuzz
@given(text=gemma_texts, cuts=st.lists(st.integers(0, 400), max_size=12), schema=schemas)
@example(text='<|tool_call>call:f{a:NaN,b:1e999,c:[1,}', cuts=[], schema={"type": "number"})
def test_gemma4_arguments_are_json_objects_whatever_the_text(text, cuts, schema):
    """Any text after <|tool_call>, cut anywhere, gives the same calls whole or chunked, and every
    call's arguments are a standard JSON object (closed where the text stopped)."""
    kwargs = dict(param_schemas={"f": {"a": schema, "b": schema}})
    whole, _ = parse(text, [], **kwargs)
    chunked, events = parse(text, cuts, **kwargs)
    assert chunked == whole
    well_ordered(events)
    if "<tool_call>" not in text and "<function=" not in text:  # only Gemma 4 calls: all well-formed
        for _, arguments in whole.calls:
            assert isinstance(json.loads(arguments, parse_constant=reject), dict)


TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "gemma4_chat_template.jinja").read_text()
identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
# What the template can write and a model may say: no string holds the marks that frame it.
gemma_strings = st.text(max_size=8).filter(lambda t: '<|"|>' not in t and "<tool_call|>" not in t)
gemma_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | gemma_strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(identifiers, inner, max_size=3), max_leaves=10)


def render_calls(calls) -> str:
    """The assistant turn Gemma 4's chat template writes for these calls (what the model learned)."""
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(TEMPLATE).render(messages=messages, bos_token="", add_generation_prompt=False)
    return prompt[prompt.index("<|turn>model\n") + len("<|turn>model\n"):prompt.rindex("<tool_call|>") + 12]


@fuzz
@given(calls=st.lists(st.tuples(names, st.dictionaries(identifiers, gemma_values, max_size=4)),
                      min_size=1, max_size=3),
       before=st.text(max_size=10).filter(lambda t: "<" not in t), cuts=st.lists(st.integers(0, 2000), max_size=15))
def test_gemma4_calls_the_template_writes_are_recovered_exactly_in_any_chunks(calls, before, cuts):
    text = before + render_calls(calls)
    out, events = parse(text, cuts)
    well_ordered(events)
    assert [(n, json.loads(a)) for n, a in out.calls] == [(n, a) for n, a in calls]
    assert out.content == before.rstrip()


# ---------------------------------------------------------------------------------------------- arg_key (GLM, Laguna)
GLM_PIECES = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<arg_",
              "</arg", "_value>", "f\n", "g", "a", "b", "\n", " ", "<", ">", "/", "{", "}", '"', "1", "true", "null",
              "<think>", "</think>"]
glm_texts = st.lists(st.one_of(st.sampled_from(GLM_PIECES), st.text(max_size=4)), max_size=40).map("".join)


@fuzz
@given(text=glm_texts, cuts=st.lists(st.integers(0, 400), max_size=12), schema=schemas, in_reasoning=st.booleans())
@example(text="<tool_call>f<arg_key>a</arg_key><arg_value>NaN</arg_value></tool_call>", cuts=[],
         schema={"type": "number"}, in_reasoning=False)
def test_arg_key_arguments_are_json_objects_whatever_the_text(text, cuts, schema, in_reasoning):
    """Any text, cut anywhere, gives the same calls whole or chunked, and every call's arguments are
    a standard JSON object (closed where the text stopped)."""
    kwargs = dict(call_format="glm", in_reasoning=in_reasoning, param_schemas={"f": {"a": schema, "b": schema}})
    whole, _ = parse(text, [], **kwargs)
    chunked, events = parse(text, cuts, **kwargs)
    assert chunked == whole
    well_ordered(events)
    for _, arguments in whole.calls:
        assert isinstance(json.loads(arguments, parse_constant=reject), dict)


LAGUNA_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "laguna_xs2_chat_template.jinja").read_text()
# What the template can write and a model may say: no string holds a tag that frames it.
glm_strings = st.text(max_size=8).filter(lambda t: not re.search(r"</?(arg_value|arg_key|tool_call)>", t))
glm_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | glm_strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10)
JSON_TYPE_OF = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
                dict: "object"}


def render_laguna_calls(calls) -> str:
    """The assistant turn Laguna's chat template writes for these calls (what the model learned)."""
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}]
    prompt = render_chat_template(LAGUNA_TEMPLATE, messages, add_generation_prompt=False)
    turn = "<assistant>\n</think>\n"
    return prompt[prompt.index(turn) + len(turn):prompt.rindex("</assistant>")]


@fuzz
@given(calls=st.lists(st.tuples(names, st.dictionaries(identifiers, glm_values, max_size=4)), min_size=1, max_size=3),
       before=st.text(max_size=10).filter(lambda t: "<" not in t), cuts=st.lists(st.integers(0, 2000), max_size=15))
def test_arg_key_calls_the_template_writes_are_recovered_exactly_in_any_chunks(calls, before, cuts):
    """Strings raw, the rest JSON: each parameter's declared type reads it back as it was."""
    text = before + render_laguna_calls(calls)
    schemas = {name: {k: {"type": JSON_TYPE_OF[type(v)]} for k, v in args.items()} for name, args in calls}
    out, events = parse(text, cuts, call_format="glm", param_schemas=schemas, after_reasoning=True)
    well_ordered(events)
    assert [(n, json.loads(a)) for n, a in out.calls] == [(n, a) for n, a in calls]
    assert out.content == before.strip()
