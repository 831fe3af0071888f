"""A served hybrid (Gated DeltaNet) model reuses cached prefixes where a recurrent-state snapshot
makes them exact, and says so in the usage the official SDKs read: OpenAI's cached_tokens, and
Anthropic's cache_read_input_tokens, the same in message_start (probed before the request runs)
as in message_delta (what the engine served)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import HYBRID
from tests.server_helpers import start_server

BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    model = build_hf_model("qwen3", tmp_path_factory.mktemp("hybrid-prefix-server"), tokenizer_dir,
                           **(HYBRID | {"max_position_embeddings": 4096}))
    srv, _, _ = start_server(model, block_size=BLOCK, max_num_seqs=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_a_repeated_chat_and_its_next_turn_are_served_from_the_cache(oai):
    messages = [{"role": "user", "content": " ".join(f"item{i}" for i in range(40))}]
    kwargs = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    first = oai.chat.completions.create(messages=messages, **kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = oai.chat.completions.create(messages=messages, **kwargs)
    boundary = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK  # the prompt's snapshot
    assert again.usage.prompt_tokens_details.cached_tokens == boundary > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "and then?"}]
    second = oai.chat.completions.create(messages=turn2, **kwargs)
    assert second.usage.prompt_tokens_details.cached_tokens >= boundary


def test_anthropic_cache_reads_agree_between_message_start_and_delta(server):
    body = {"model": "tiny", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": " ".join(f"word{i}" for i in range(50))}]}
    usages = []
    for _ in range(2):  # the second request finds the first one's prompt and state snapshot
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
        assert start["cache_read_input_tokens"] == delta["cache_read_input_tokens"]
        usages.append(start)
    prompt = usages[0]["input_tokens"] + usages[0]["cache_read_input_tokens"]
    assert usages[0]["cache_read_input_tokens"] == 0
    assert usages[1]["cache_read_input_tokens"] == (prompt - 1) // BLOCK * BLOCK > 0
