"""Coding agents' request shapes: Claude Code's system turns inside `messages` and its context
overflows worded as Anthropic words them (its max_tokens retry and compaction key on those phrases);
Codex's requests without an output limit; a log line for every refused request."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

from lucebox.cli import main
from lucebox.server.config import ServerConfig
from lucebox.server.generate import ChatJob, merge_late_system, render_chat
from lucebox.text.tokenizer import Tokenizer
from tests.server_helpers import build_model, start_server

# A template that, like many, takes a system message only as the first one.
FIRST_SYSTEM_ONLY = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}{{ raise_exception('System role only first') }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CONVERSATION = [{"role": "user", "content": "list the files"}, {"role": "assistant", "content": "a.py b.py"},
                {"role": "system", "content": "The user switched to plan mode."},
                {"role": "user", "content": "now read a.py"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("claude-shapes"))


DEFAULT_MAX_TOKENS = 3


@pytest.fixture(scope="module")
def server(model_dir):
    srv, llm, forcing = start_server(model_dir, ServerConfig(keepalive=0.3, default_max_tokens=DEFAULT_MAX_TOKENS),
                                     block_size=16, max_num_seqs=8)
    srv.llm, srv.forcing = llm, forcing
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0), server.llm


def test_system_turns_inside_messages_are_accepted_and_rendered(claude):
    client, _ = claude
    reply = client.messages.create(model="tiny", max_tokens=4, messages=CONVERSATION,
                                   extra_headers={"anthropic-beta": "mid-conversation-system-2026-04-07"})
    assert reply.stop_reason in ("end_turn", "max_tokens")
    without = [m for m in CONVERSATION if m["role"] != "system"]
    counted = [client.messages.count_tokens(model="tiny", messages=m).input_tokens for m in (CONVERSATION, without)]
    assert counted[0] > counted[1]  # the system turn is part of the prompt


def test_a_template_without_late_system_turns_gets_them_merged_into_the_next_user_turn(model_dir):
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    tokenizer.chat_templates = {"default": FIRST_SYSTEM_ONLY}
    state = SimpleNamespace(tokenizer=tokenizer)
    prepared = render_chat(state, ChatJob([{"role": "system", "content": "Be terse."}, *CONVERSATION]))
    assert prepared.prompt_text.count("<|im_start|>system") == 1
    assert "<|im_start|>user\nThe user switched to plan mode.\n\nnow read a.py<|im_end|>" in prepared.prompt_text


def test_merge_late_system_keeps_the_first_and_folds_the_rest_into_user_turns():
    assert merge_late_system(CONVERSATION)[2:] == [
        {"role": "user", "content": "The user switched to plan mode.\n\nnow read a.py"}]
    trailing = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                {"role": "system", "content": "late"}]
    assert merge_late_system(trailing) == [{"role": "system", "content": "S"}, {"role": "user", "content": "u\n\nlate"}]
    assert merge_late_system(CONVERSATION[:2]) == CONVERSATION[:2]


def test_max_tokens_overflow_uses_anthropics_wording(claude):
    client, llm = claude
    context = llm.engine.max_model_len
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=context + 5, messages=[{"role": "user", "content": "hi"}])
    found = re.search(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)", str(e.value))
    assert found and int(found[2]) == context + 5 and int(found[3]) == context
    assert int(found[1]) + int(found[2]) > int(found[3])


def test_a_prompt_longer_than_the_context_uses_anthropics_wording(claude):
    client, llm = claude
    context = llm.engine.max_model_len
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=1,
                               messages=[{"role": "user", "content": "word " * (2 * context)}])
    found = re.search(r"prompt is too long: (\d+) tokens > (\d+) maximum", str(e.value))
    assert found and int(found[1]) > int(found[2]) and int(found[2]) == context - 1


def test_requests_without_an_output_limit_get_the_default_max_tokens(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    reply = client.responses.create(model="tiny", input="write a long story", extra_body={"ignore_eos": True})
    assert reply.usage.output_tokens == DEFAULT_MAX_TOKENS  # Codex sends no max_output_tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5  # a request's own limit wins


def test_every_refused_request_is_logged_with_its_reason(claude, caplog):
    client, llm = claude
    with caplog.at_level("WARNING", logger="lucebox.server"), pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=llm.engine.max_model_len + 1,
                               messages=[{"role": "user", "content": "hi"}])
    lines = [r.getMessage() for r in caplog.records if r.name == "lucebox.server"]
    assert any(line.startswith("POST /v1/messages -> 400: ") and "max_tokens" in line for line in lines), lines


def test_serve_takes_verbose_after_the_command_and_rejects_a_bad_default_max_tokens(capsys):
    from lucebox.cli import build_parser
    assert build_parser().parse_args(["serve", "-v"]).verbose
    assert build_parser().parse_args(["-v", "serve"]).verbose
    assert not build_parser().parse_args(["serve"]).verbose
    assert main(["serve", "--default-max-tokens", "0"]) != 0
    assert "--default-max-tokens must be a positive integer" in capsys.readouterr().err


BASH_TOOL = {"name": "Bash", "description": "run a command",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la /tmp", "timeout": 30}}\n</tool_call>'


def _tokens_until(llm, text: str, marker: str) -> int:
    """How many tokens of `text` end just after `marker` first appears in their decoding."""
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        if marker in llm.tokenizer.decode(ids[:n], skip_special_tokens=False):
            return n
    raise AssertionError(f"{marker!r} not in {text!r}")


def _forced_call(server, max_tokens: int, stream: bool):
    forcing = server.forcing
    forcing.scripts["cut_call"] = CALL
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    kwargs = dict(model="force:cut_call", max_tokens=max_tokens, tools=[BASH_TOOL],
                  messages=[{"role": "user", "content": "list /tmp"}])
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_before_its_name_is_neither_text_nor_a_call(server, stream):
    n = _tokens_until(server.llm, CALL, '{"na')
    reply = _forced_call(server, n, stream)
    assert reply.stop_reason == "max_tokens"
    assert reply.usage.output_tokens == n
    assert [b.type for b in reply.content if b.type == "tool_use"] == []
    text = "".join(b.text for b in reply.content if b.type == "text")
    assert "<tool_call>" not in text and "</tool_call>" not in text


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_in_its_arguments_keeps_the_complete_members(server, stream):
    n = _tokens_until(server.llm, CALL, '"timeout": 3')
    reply = _forced_call(server, n, stream)
    assert reply.stop_reason == "max_tokens"
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "Bash"
    if not stream:  # the SDK's stream accumulator parses partial JSON itself
        assert call.input == {"command": "ls -la /tmp"}  # no private "_raw" field


def test_cached_tokens_agree_between_message_start_and_message_delta(server):
    long_text = " ".join(f"word{i}" for i in range(60))
    body = {"model": "tiny", "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": long_text}]}
    usages = []
    for _ in range(2):  # the second request finds the first one's prompt in the prefix cache
        starts, deltas = [], []
        with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] == "message_start":
                        starts.append(event["message"]["usage"])
                    elif event["type"] == "message_delta":
                        deltas.append(event["usage"])
        (start,), (delta,) = starts, deltas
        for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            assert start[key] == delta[key], key
        usages.append(start)
    prompt = usages[0]["input_tokens"] + usages[0]["cache_read_input_tokens"]
    assert usages[1]["input_tokens"] + usages[1]["cache_read_input_tokens"] == prompt
    assert usages[1]["cache_read_input_tokens"] > 0
