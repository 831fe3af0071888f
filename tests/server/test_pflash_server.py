"""PFlash through the server: the extra body field prefill_keep_ratio, as the official SDKs send it,
validated, and the kept prompt tokens reported in OpenAI's usage.prompt_tokens_details."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.conftest import build_hf_model
from tests.server_helpers import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    model = build_hf_model("qwen3", tmp_path_factory.mktemp("pflash-server"), tokenizer_dir,
                           max_position_embeddings=1024)
    srv, _, _ = start_server(model, block_size=16, max_num_seqs=2, prefill_min_tokens=64)
    yield srv
    srv.stop()


MESSAGES = [{"role": "user", "content": " ".join(f"item{i}" for i in range(120))}]


def test_openai_extra_body_keeps_a_share_and_reports_it(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    kwargs = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": MESSAGES}
    exact = oai.chat.completions.create(**kwargs)
    assert getattr(exact.usage.prompt_tokens_details, "kept_tokens", None) is None
    squeezed = oai.chat.completions.create(**kwargs, extra_body={"prefill_keep_ratio": 0.25})
    kept = squeezed.usage.prompt_tokens_details.kept_tokens
    assert squeezed.usage.prompt_tokens == exact.usage.prompt_tokens
    assert 0 < kept < 0.5 * exact.usage.prompt_tokens  # a quarter of the chunks, the short last one among them
    assert squeezed.usage.prompt_tokens_details.cached_tokens == 0
    text = oai.completions.create(model="tiny", prompt=MESSAGES[0]["content"], max_tokens=2,
                                  extra_body={"prefill_keep_ratio": 1.0})
    assert text.usage.prompt_tokens_details.kept_tokens == text.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="prefill_keep_ratio"):
        oai.chat.completions.create(**kwargs, extra_body={"prefill_keep_ratio": 1.5})


def test_anthropic_extra_body_is_accepted_and_validated(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    reply = client.messages.create(model="tiny", max_tokens=3, messages=MESSAGES,
                                   extra_body={"prefill_keep_ratio": 0.25})
    assert reply.usage.output_tokens == 3 or reply.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError, match="prefill_keep_ratio"):
        client.messages.create(model="tiny", max_tokens=3, messages=MESSAGES, extra_body={"prefill_keep_ratio": 0})


def test_anthropic_stream_reports_no_cache_reads_for_a_compressed_prompt(server):
    reads = []
    body = {"model": "tiny", "max_tokens": 2, "stream": True, "messages": MESSAGES}
    for extra in ({}, {}, {"prefill_keep_ratio": 0.25}):  # the second exact request finds the first's blocks
        usages = []
        with httpx.stream("POST", server.url + "/v1/messages", json=body | extra, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] in ("message_start", "message_delta"):
                        usages.append(event.get("usage") or event["message"]["usage"])
        start, delta = usages[0], usages[-1]
        assert start["cache_read_input_tokens"] == delta["cache_read_input_tokens"]
        reads.append(delta["cache_read_input_tokens"])
    assert reads[1] > 0 and reads[2] == 0
