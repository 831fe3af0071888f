"""A Gemma 4 text model served with Gemma 4's chat template (tests/fixtures/gemma4_chat_template.jinja:
google-gemma-4-31B-it.jinja as llama.cpp keeps it in models/templates/): its thought channel
(<|channel>thought\n ... <channel|>) comes back split out as reasoning, like <think>, through the
official SDKs of both APIs, whether the template opened the channel (thinking on) or the model does.

Google's published template has had a variant that, with thinking off, closes an empty channel
after the generation prompt (`<|turn>model\n<|channel>thought\n<channel|>`, as transformers'
Gemma 4-family tests render it); the parser tests below cover that prompt ending too."""
from __future__ import annotations

import json
import random
from pathlib import Path

import anthropic
import openai
import pytest

from lucebox.server.config import ServerConfig
from lucebox.server.parsing import OutputParser, ParsedOutput, opens_reasoning
from tests.conftest import build_hf_model
from tests.model.test_gemma4 import DENSE
from tests.server_helpers import build_model, start_server

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "gemma4_chat_template.jinja").read_text()
REASONING, ANSWER = "The user greets me; answer briefly.", "Hello! How can I help?"
REPLY = f"<|channel>thought\n{REASONING}<channel|>{ANSWER}"  # thinking off: the model opens the channel itself
REPLY_IN_CHANNEL = f"{REASONING}\n<channel|>{ANSWER}"  # thinking on: the prompt opened it


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
