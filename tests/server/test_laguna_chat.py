"""A Poolside Laguna model served with its own chat template (tests/fixtures/laguna_xs2_chat_template.jinja:
poolside-Laguna-XS.2.jinja as llama.cpp keeps it in models/templates/, byte for byte), through the
official SDKs of the three APIs: the prompt ends in `<think>` (thinking on: the output starts in
reasoning) or `</think>` (off, the default: it is all content); tool calls in the arg_key format
(`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`, strings raw, other
values JSON) come back as OpenAI tool_calls, Anthropic tool_use blocks and Responses function_call
items, typed by the tool's schema, streamed or not, cut off by max_tokens or not; a tool conversation
renders back through the template as the model wrote it; generation ends at the turn's
`</assistant>` whether the model writes it as its one token or spells it out; and tool_choice
required / named hold an untrained model to the format.

Laguna S 2.1's template (tests/fixtures/laguna_s21_chat_template.jinja, poolside-Laguna-S-2.1.jinja from
the same place) writes the same tags without newlines; its output parses the same, and constrained
decoding follows the spacing each template writes.

The tokenizer is built like Laguna's: `〈|EOS|〉` is BOS and EOS, `</assistant>` an ordinary added
token (not special) that the config lists among the EOS ids, as in poolside/Laguna-XS.2."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import anthropic
import openai
import pytest
import xgrammar as xgr

from lucebox import LLM
from lucebox.engine.async_engine import AsyncEngine
from lucebox.server.app import create_app
from lucebox.server.config import ServerConfig
from lucebox.server.constrain import GrammarFactory
from lucebox.server.glm_tools import taught_spacing
from lucebox.server.generate import render_chat
from lucebox.server.openai_chat import chat_job
from lucebox.server.parsing import OutputParser, ParsedOutput
from lucebox.server.protocol import ChatCompletionRequest
from lucebox.server.tools import ToolSpec, tool_format
from lucebox.text.chat_template import render_chat_template
from tests.conftest import build_hf_model
from tests.model.test_laguna import LAGUNA
from tests.server.test_gemma4_chat import _streamed_calls, _tokens_until
from tests.server_helpers import CORPUS, ForceText, Forcing, ServerThread

FIXTURES = Path(__file__).parents[1] / "fixtures"
TEMPLATE = (FIXTURES / "laguna_xs2_chat_template.jinja").read_text()
TIGHT_TEMPLATE = (FIXTURES / "laguna_s21_chat_template.jinja").read_text()  # Laguna S 2.1
EOS, TURN_END = "〈|EOS|〉", "</assistant>"
SPECIALS = [EOS, "<system>", "</system>", "<user>", "</user>", "<assistant>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>",
            "</tool_response>"]
REASONING, ANSWER = "The user greets me; answer briefly.", "Hello! How can I help?"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"type": "string"}},
                   "required": ["city"]}}}
BASH = {"type": "function", "function": {
    "name": "Bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"},
                                                    "env": {"type": "object"}}, "required": ["command"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in (WEATHER, BASH)}
THOUGHT = "I need the weather."
# Calls as the template writes them (and so as the model learned them): strings raw, the rest JSON.
CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
TWO_CALLS = [("get_weather", {"city": "Rome, Italy", "days": 2, "units": "metric"}),
             ("Bash", {"command": 'echo "<b>hi</b>" > /tmp/x', "env": {"DEBUG": 1, "PATH": "/bin"}, "timeout": 1.5})]
REPLY_TWO_CALLS = ("\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome, Italy</arg_value>\n"
                   "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>units</arg_key>\n"
                   "<arg_value>metric</arg_value>\n</tool_call>\n<tool_call>Bash\n<arg_key>command</arg_key>\n"
                   '<arg_value>echo "<b>hi</b>" > /tmp/x</arg_value>\n<arg_key>env</arg_key>\n'
                   '<arg_value>{"DEBUG": 1, "PATH": "/bin"}</arg_value>\n<arg_key>timeout</arg_key>\n'
                   "<arg_value>1.5</arg_value>\n</tool_call>\n" + TURN_END)
# What the model writes after the prompt's generation prompt (`<assistant>\n</think>` or `...<think>`).
SCRIPTS = {
    "hello": f"\n{ANSWER}\n{TURN_END}\n<user>\nthe model went on",
    "hello-thinking": f"\n{REASONING}\n</think>\n{ANSWER}\n{TURN_END}",
    "call": f"\n{THOUGHT}\n</think>\n{CALL}\n{TURN_END}",
    "two-calls": REPLY_TWO_CALLS,
    "answer": f"\nThe tool answered.\n</think>\nIt is sunny in Paris.\n{TURN_END}",
}


def parse(text: str, sizes=None, **kwargs) -> ParsedOutput:
    parser, events, i = OutputParser(call_format="glm", **kwargs), [], 0
    while i < len(text):
        k = sizes() if sizes else len(text)
        events += parser.feed(text[i:i + k])
        i += k
    return ParsedOutput.of(events + parser.finish())


def build_laguna_tokenizer(tok_dir: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = CORPUS + f"{REPLY_TWO_CALLS} {REASONING} {ANSWER} {THOUGHT} {TEMPLATE}" * 5
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(TURN_END, special=False, normalized=False)])
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
        "chat_template": TEMPLATE}))
    return tok_dir


class ScriptedIds(Forcing):
    """Forcing, plus outputs given as token ids (a turn end spelled out in several tokens)."""

    def __init__(self, tokenizer, eos: int):
        super().__init__(tokenizer, eos)
        self.ids: dict[str, list[int]] = {}

    def __call__(self, api: str, body: dict):
        key = (body.get("model") or "").removeprefix("force:")
        if key not in self.ids:
            return super().__call__(api, body)
        forced = ForceText(self.tokenizer, "", self.eos)
        forced.ids = self.ids[key] + [self.eos]
        return [forced]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("laguna-chat")
    tok_dir = build_laguna_tokenizer(root / "tok")
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    end_id = len(vocab)  # the added </assistant>
    model_dir = build_hf_model("qwen3", root / "laguna", tok_dir, **dict(
        LAGUNA, model_type="laguna", max_position_embeddings=4096, bos_token_id=vocab[EOS],
        eos_token_id=[vocab[EOS], end_id]))
    llm = LLM(str(model_dir), block_size=16, max_num_seqs=4)
    assert llm.tokenizer.token_to_id(TURN_END) == end_id
    forcing = ScriptedIds(llm.tokenizer, llm.tokenizer.eos_token_id)
    forcing.scripts.update(SCRIPTS)
    encode = llm.tokenizer.encode
    forcing.ids["spelled"] = [i for piece in (f"\n{ANSWER}\n", "</assist", "ant>", "\n<user>\nmore")
                              for i in encode(piece, add_special_tokens=False)]
    app = create_app(AsyncEngine(llm.engine), ServerConfig(keepalive=0.3), model_id="tiny", request_processors=forcing)
    srv = ServerThread(app).start()
    srv.llm = llm
    yield srv
    srv.stop()


def _oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _anthropic(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


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
    client = _oai(server)
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
    client = _anthropic(server)
    reply = client.messages.create(model="force:hello-thinking", max_tokens=200,
                                   thinking={"type": "enabled", "budget_tokens": 1024},
                                   messages=[{"role": "user", "content": "hi"}])
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in reply.content] == [
        ("thinking", REASONING), ("text", ANSWER)]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    response = _oai(server).responses.create(model="force:hello-thinking", input="hi", reasoning={"effort": "low"},
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
    choice = _oai(server).chat.completions.create(model=model, messages=messages, max_tokens=100).choices[0]
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
    client = _anthropic(server)
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
    client = _oai(server)
    request = dict(model="force:two-calls", messages=[{"role": "user", "content": "weather, then a command"}],
                   tools=[WEATHER, BASH], max_tokens=300)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == TWO_CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2
    _, content, streamed = _streamed_calls(client.chat.completions.create(**request, stream=True))
    assert streamed == TWO_CALLS and content == "Checking."


def test_anthropic_messages_return_arg_key_tool_use(server):
    client = _anthropic(server)
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
    client = _oai(server)
    tools = [dict(t["function"], type="function") for t in (WEATHER, BASH)]
    reply = client.responses.create(model="force:two-calls", input="weather, then a command", tools=tools, store=False)
    assert [(o.name, json.loads(o.arguments)) for o in reply.output if o.type == "function_call"] == TWO_CALLS
    with client.responses.stream(model="force:two-calls", input="weather, then a command", tools=tools) as s:
        streamed = s.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in streamed.output if o.type == "function_call"] == TWO_CALLS


@pytest.mark.parametrize("stream", [False, True])
def test_an_arg_key_call_cut_off_by_max_tokens(server, stream):
    client = _anthropic(server)
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
    choice = _oai(server).chat.completions.create(
        model="force:two-calls", messages=[{"role": "user", "content": "run it"}], tools=[WEATHER, BASH],
        max_tokens=n, stream=False).choices[0]
    assert choice.finish_reason == "length"
    assert json.loads(choice.message.tool_calls[-1].function.arguments) == {"command": 'echo "<b>hi</b>" > /tmp/x'}


# ---------------------------------------------------------------------------------------------- multi-turn
def test_a_tool_conversation_renders_back_as_the_model_wrote_it(server):
    """Call, result, answer: the second prompt holds the model's turn exactly as it wrote it (its
    reasoning, the call, </assistant>) and the result in the template's <tool_response> block."""
    client = _oai(server)
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
    client = _anthropic(server)
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


# ---------------------------------------------------------------------------------------------- constrained
def test_tool_choice_required_and_named_hold_an_untrained_model_to_arg_key_calls(server):
    client = _oai(server)
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "exact": {"type": "boolean"}},
              "required": ["unit", "exact"]}
    temp = {"type": "function", "function": {"name": "temp", "parameters": schema}}
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[temp, WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("temp", "get_weather") and isinstance(json.loads(call.function.arguments), dict)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[temp, WEATHER], max_tokens=120,
                                       temperature=0.8, seed=3,
                                       tool_choice={"type": "function", "function": {"name": "temp"}})
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "temp" and args["unit"] in ("c", "f") and isinstance(args["exact"], bool)


def test_the_arg_key_grammar_takes_reasoning_then_calls_as_the_template_writes_them(server):
    llm = server.llm
    factory = GrammarFactory(llm.tokenizer, llm.engine.model.config.vocab_size, llm.engine.eos_token_ids)
    tools = [ToolSpec("get_weather", parameters=WEATHER["function"]["parameters"])]
    compiled = factory.tool_calls(tools, "required", "glm", parallel=True, in_reasoning=True)

    def accepts(text: str, compiled=compiled) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.token_to_id(TURN_END)]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()
    assert accepts(f"\n{THOUGHT}\n</think>\n{CALL}")
    assert accepts(f"\n{THOUGHT}\n</think>\n{CALL}\n{CALL}")  # parallel calls, one block each
    assert accepts(f"{THOUGHT}</think>\n" + CALL.replace("\n", ""))  # the tight form of Laguna S 2.1
    assert not accepts(f"{THOUGHT}</think>\n" + CALL.replace("<arg_value>3<", "<arg_value>three<"))
    assert not accepts(f"{THOUGHT}</think>\n" + CALL.replace("Paris", f"Paris{TURN_END}"))
    assert not accepts(f'{THOUGHT}</think>\n<tool_call>\n{{"name": "get_weather", "arguments": {{}}}}\n</tool_call>')
    # Thinking off: the prompt ends in </think>, and the template's newline after it comes first.
    off = factory.tool_calls(tools, "required", "glm", parallel=False, in_reasoning=False, reasoning_closed=True)
    assert accepts(f"\n{CALL}", off) and not accepts(CALL, off) and not accepts(f"\n{CALL}\n{CALL}", off)


class _WithTemplate:
    """A tokenizer as it is, with another chat template."""

    def __init__(self, tokenizer, template: str):
        self._tokenizer, self.chat_templates = tokenizer, {"default": template}

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_laguna_s21_writes_the_tags_without_newlines_and_constrained_calls_follow_it(server):
    assert taught_spacing({"default": TEMPLATE}) == ("\n", "\n")
    assert taught_spacing({"default": TIGHT_TEMPLATE}) == ("", "")
    assert tool_format({"default": TIGHT_TEMPLATE}) == "glm"
    tight_call = CALL.replace("\n", "")
    # Its default is thinking on: the prompt ends in <think>, and the output parses as XS.2's does.
    llm = server.llm
    prompt = render_chat_template(TIGHT_TEMPLATE, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt.endswith("<user>hi</user>\n<assistant><think>")
    out = parse(f"{THOUGHT}</think>{tight_call}{tight_call}", in_reasoning=True, param_schemas=SCHEMAS)
    assert out.reasoning == THOUGHT and out.content == ""
    assert [(n, json.loads(a)) for n, a in out.calls] == [("get_weather", {"city": "Paris", "days": 3})] * 2
    factory = GrammarFactory(_WithTemplate(llm.tokenizer, TIGHT_TEMPLATE), llm.engine.model.config.vocab_size,
                             llm.engine.eos_token_ids)
    tools = [ToolSpec("get_weather", parameters=WEATHER["function"]["parameters"])]
    compiled = factory.tool_calls(tools, "required", "glm", parallel=True, in_reasoning=True)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.token_to_id(TURN_END)]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()
    assert accepts(f"{THOUGHT}</think>{tight_call}{tight_call}")
    assert not accepts(f"{THOUGHT}</think>\n{tight_call}")
