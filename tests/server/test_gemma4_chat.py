"""A Gemma 4 text model served: its thought channel (<|channel>thought\\n ... <channel|>) comes back
split out as reasoning, like <think>, through the official SDKs of both APIs.

The chat template here is a small stand-in written for this test, not Gemma 4's own (which this
repository does not have): it uses the turn and channel markers as transformers' Gemma 4-family
tests show them rendered: `<|turn>user\\n...<turn|>\\n<|turn>model\\n`, `<|think|>` in a system turn
when thinking is on, and an empty `<|channel>thought\\n<channel|>` after the generation prompt when
it is off."""
from __future__ import annotations

import json
import random

import anthropic
import openai
import pytest

from lucebox.server.config import ServerConfig
from lucebox.server.parsing import OutputParser, ParsedOutput, opens_reasoning
from tests.conftest import build_hf_model
from tests.model.test_gemma4 import DENSE
from tests.server_helpers import build_model, start_server

TEMPLATE = (
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- if thinking %}{{- '<|turn>system\\n<|think|>\\n<turn|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|turn>' + ('model' if message.role == 'assistant' else message.role) + '\\n' + message.content"
    " + '<turn|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}"
    "{%- if not thinking %}{{- '<|channel>thought\\n<channel|>' }}{%- endif %}{%- endif %}"
)
REPLY = "<|channel>thought\nThe user greets me; answer briefly.<channel|>Hello! How can I help?"


def parse(text: str, sizes=None, **kwargs) -> ParsedOutput:
    parser, events, i = OutputParser(**kwargs), [], 0
    while i < len(text):
        k = sizes() if sizes else len(text)
        events += parser.feed(text[i:i + k])
        i += k
    return ParsedOutput.of(events + parser.finish())


def test_the_thought_channel_splits_over_any_chunking():
    want = ParsedOutput("Hello! How can I help?", "The user greets me; answer briefly.", [])
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
    srv.llm = llm
    yield srv
    srv.stop()


def test_the_served_model_is_gemma4(server):
    assert server.llm.engine.loaded.config.family == "gemma4"


def test_chat_completions_split_the_thought_channel(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="force:hello", messages=messages, max_tokens=200)
    message = reply.choices[0].message
    assert message.reasoning_content.strip() == "The user greets me; answer briefly."
    assert message.content.strip() == "Hello! How can I help?"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="force:hello", messages=messages, max_tokens=200,
                                                stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning.strip(), content.strip()) == ("The user greets me; answer briefly.", "Hello! How can I help?")


def test_anthropic_messages_return_a_thinking_block(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    reply = client.messages.create(model="force:hello", max_tokens=200, messages=[{"role": "user", "content": "hi"}])
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking.strip() == "The user greets me; answer briefly."
    assert reply.content[1].text.strip() == "Hello! How can I help?"
