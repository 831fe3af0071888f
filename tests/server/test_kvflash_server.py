"""KVFlash through the server: the request field kv_pool, as the official SDKs send it (extra_body), on
every API; a server without a pool refuses kv_pool: true naming the flag; /metrics shows the pool's
sequences, host blocks and resident-set churn; a request without max_tokens is bounded by where its
KV lives (the device for an unpooled one, host memory for a pooled one), not refused."""
from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest
import torch

from lucebox.model.kv_pool.score import ChunkSummaries
from tests.conftest import build_hf_model
from tests.server_helpers import start_server

SAMPLE = re.compile(r"^(?P<name>[\w:]+)(?:\{[^}]*\})? (?P<value>\S+)$")


def words(start: int, count: int = 200) -> str:
    """~3.6 tokens a word: 200 words fit the device unpooled but not the 512-token pool. A prompt of its own
    per request, so no prefix-cache hit skips the prefill in which the pool evicts."""
    return " ".join(f"item{i}" for i in range(start, start + count))


def scrape(url: str) -> dict[str, float]:
    return {m["name"]: float(m["value"]) for line in httpx.get(url + "/metrics").text.splitlines()
            if (m := SAMPLE.match(line))}


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("kvflash-server"), tokenizer_dir, seed=2,
                          max_position_embeddings=4096)


@pytest.fixture(scope="module")
def pooled(model):
    """Every request pooled unless it says kv_pool: false (--kv-pool-target)."""
    srv, llm, _ = start_server(model, block_size=16, max_model_len=2048, max_num_seqs=2, max_num_batched_tokens=256,
                               kv_pool_tokens=512, kv_pool_target=True, kv_reselect_interval=16)
    yield srv, llm
    srv.stop()


@pytest.fixture(scope="module")
def plain(model):
    srv, _, _ = start_server(model, block_size=16, max_model_len=2048, max_num_seqs=2, max_num_batched_tokens=256)
    yield srv
    srv.stop()


def oai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def chat(srv, content: str, logprobs: bool = False, **extra):
    return oai(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                            max_tokens=6, temperature=0, logprobs=logprobs,
                                            extra_body={"ignore_eos": True} | extra)


def test_a_pooled_long_request_moves_the_pool_gauges(pooled, monkeypatch):
    srv, llm = pooled
    idle = scrape(srv.url)
    assert idle["lucebox:kvflash_pool_tokens"] == 512
    assert idle["lucebox:kvflash_sequences"] == idle["lucebox:kvflash_host_blocks_in_use"] == 0
    assert idle["lucebox:kvflash_host_blocks"] * 16 >= 2048  # at least one whole context backed
    # a tiny random model's queries barely move: shuffled scores make chunks leave and come back
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(ChunkSummaries, "scores", lambda self, q: torch.rand(self.count, generator=generator))

    prompt = llm.tokenizer.encode(words(0, 400))
    assert len(prompt) > 1400
    stream = oai(srv).completions.create(model="tiny", prompt=prompt, max_tokens=200, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True, "kv_pool": True})
    chunks = iter(stream)
    for _ in range(40):
        next(chunks)
    running = scrape(srv.url)
    assert running["lucebox:kvflash_sequences"] == 1
    assert running["lucebox:kvflash_host_blocks_in_use"] * 16 >= len(prompt) + 200  # its whole context
    assert running["lucebox:kvflash_reselects_total"] > idle["lucebox:kvflash_reselects_total"]
    # the device holds the pool, not the context: most of the prompt was given back
    evicted = running["lucebox:kvflash_blocks_evicted_total"] - idle["lucebox:kvflash_blocks_evicted_total"]
    assert evicted >= (len(prompt) - 512 - 256) // 16
    held = running["lucebox:kv_cache_blocks"] - running["lucebox:kv_cache_blocks_free"]
    assert held * 16 < len(prompt)
    assert sum(1 for _ in chunks) >= 200 - 40 - 1  # the rest streams to the end

    done = scrape(srv.url)
    assert done["lucebox:kvflash_sequences"] == done["lucebox:kvflash_host_blocks_in_use"] == 0
    paged_in = done["lucebox:kvflash_blocks_paged_in_total"] - idle["lucebox:kvflash_blocks_paged_in_total"]
    assert 0 < paged_in <= done["lucebox:kvflash_blocks_evicted_total"] - idle["lucebox:kvflash_blocks_evicted_total"]


def test_kv_pool_false_on_a_pooling_server_is_exact_and_the_default_pools(pooled, plain):
    srv, _ = pooled
    before = scrape(srv.url)["lucebox:kvflash_reselects_total"]
    exact = chat(plain, words(1000), logprobs=True)
    unpooled = chat(srv, words(1000), kv_pool=False, logprobs=True)
    assert [t.logprob for t in unpooled.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in exact.choices[0].logprobs.content], abs=1e-5)
    assert unpooled.usage.prompt_tokens == exact.usage.prompt_tokens > 512
    assert scrape(srv.url)["lucebox:kvflash_reselects_total"] == before  # nothing was pooled

    by_default = chat(srv, words(2000))
    assert by_default.usage.completion_tokens == 6
    assert scrape(srv.url)["lucebox:kvflash_reselects_total"] > before


def test_every_api_carries_the_field(pooled):
    srv, _ = pooled
    before = scrape(srv.url)["lucebox:kvflash_reselects_total"]
    client = oai(srv)
    text = client.completions.create(model="tiny", prompt=words(3000), max_tokens=3, extra_body={"kv_pool": True})
    assert text.usage.completion_tokens <= 3
    reply = client.responses.create(model="tiny", input=words(4000), max_output_tokens=3,
                                    extra_body={"kv_pool": True})
    assert reply.status in ("completed", "incomplete")
    claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
    message = claude.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": words(5000)}],
                                     extra_body={"kv_pool": True})
    assert message.usage.input_tokens > 512
    assert scrape(srv.url)["lucebox:kvflash_reselects_total"] >= before + 3  # each of the three was pooled
    with pytest.raises(openai.BadRequestError, match="kv_pool"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"kv_pool": "yes"})
    with pytest.raises(anthropic.BadRequestError, match="kv_pool"):
        claude.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}],
                               extra_body={"kv_pool": 1})


def test_without_max_tokens_a_request_stops_where_its_kv_runs_out(pooled):
    srv, llm = pooled
    device = int(scrape(srv.url)["vllm:kv_cache_capacity_tokens"])
    assert device < 2048  # the device KV was planned for pools: an unpooled context cannot reach max_model_len

    def chat_tokens(words: int) -> int:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": " ".join(["x"] * words)}])
        return len(llm.tokenizer.encode(text, add_special_tokens=False))
    words = max(w for w in range(device) if chat_tokens(w) < device)
    content = " ".join(["x"] * words)
    unpooled = oai(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                extra_body={"kv_pool": False, "ignore_eos": True})
    assert unpooled.usage.prompt_tokens == chat_tokens(words)
    assert unpooled.usage.completion_tokens == device - chat_tokens(words)
    assert unpooled.choices[0].finish_reason == "length"

    too_long = [10 + i % 90 for i in range(device + 40)]
    with pytest.raises(openai.BadRequestError, match="kv_pool") as refused:
        oai(srv).completions.create(model="tiny", prompt=too_long, max_tokens=2, extra_body={"kv_pool": False})
    assert refused.value.code == "context_length_exceeded"
    pooled_out = oai(srv).completions.create(model="tiny", prompt=too_long, max_tokens=2)  # pooled: it fits
    assert pooled_out.usage.prompt_tokens == len(too_long)


def test_a_server_without_a_pool_names_the_flag(plain):
    with pytest.raises(openai.BadRequestError, match="--kv-pool-tokens"):
        chat(plain, "hello", kv_pool=True)
    claude = anthropic.Anthropic(base_url=plain.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="--kv-pool-tokens"):
        claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"kv_pool": True})
    assert chat(plain, "hello", kv_pool=False).usage.completion_tokens == 6
    assert not [name for name in scrape(plain.url) if name.startswith("lucebox:kvflash")]
