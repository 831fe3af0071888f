"""/metrics of a model mixing sliding-window and full attention: one pool per KV cache group,
labelled group="full" and group="window=W". A running request's full-attention blocks grow with its
context while its window group holds only the window; vllm:kv_cache_usage_perc stays the primary
(full) group's, and the dashboard's data shows the same pools."""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from lucebox.engine.async_engine import EngineStats, KVPoolStats
from lucebox.model.cache_spec import window_blocks
from lucebox.server.metrics import Metrics
from tests.conftest import build_hf_model
from tests.server_helpers import start_server

WINDOW, BLOCK = 6, 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SAMPLE = re.compile(r'^(?P<name>[\w:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def scrape(url: str) -> dict[tuple[str, str | None], float]:
    """(sample name, its group label or None) -> value."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = SAMPLE.match(line)
        if m:
            group = re.search(r'group="([^"]*)"', m["labels"] or "")
            out[m["name"], group[1] if group else None] = float(m["value"])
    return out


def in_use(samples, group: str) -> int:
    return int(samples["lucebox:kv_cache_blocks", group] - samples["lucebox:kv_cache_blocks_free", group])


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    model = build_hf_model("qwen2", tmp_path_factory.mktemp("qwen2-mixed-server"), tokenizer_dir, seed=5,
                           num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, sliding_window=WINDOW,
                           max_position_embeddings=2048)
    srv, _, _ = start_server(model, block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=64,
                                kv_cache_memory=8 << 20)
    yield srv
    srv.stop()


def test_each_kv_group_has_its_pool_and_the_window_holds_only_its_window(server):
    window = f"window={WINDOW}"
    idle = scrape(server.url)
    assert {g for name, g in idle if name == "lucebox:kv_cache_blocks"} == {"full", window}
    assert in_use(idle, "full") == in_use(idle, window) == 0
    assert idle["lucebox:kv_cache_blocks", "full"] * BLOCK == idle["vllm:kv_cache_capacity_tokens", None]
    assert 0 < idle["lucebox:kv_cache_blocks", window] < idle["lucebox:kv_cache_blocks", "full"]

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    prompt = " ".join(f"w{i}" for i in range(40))
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(20):
        next(chunks)
    running = scrape(server.url)
    stream.close()
    full, held = in_use(running, "full"), in_use(running, window)
    assert full * BLOCK >= 40 + 20  # the whole context: prompt and the tokens generated so far
    assert 0 < held <= window_blocks(WINDOW, BLOCK, 2)  # the window, and a step's new tokens at most
    usage = running["vllm:kv_cache_usage_perc", None]
    assert usage == running["lucebox:kv_cache_usage_perc", "full"] == pytest.approx(
        full / running["lucebox:kv_cache_blocks", "full"])
    assert running["lucebox:kv_cache_usage_perc", window] == pytest.approx(
        held / running["lucebox:kv_cache_blocks", window])

    deadline = time.monotonic() + 10  # the client left: the request is aborted, every group's blocks freed
    while in_use(scrape(server.url), "full") and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(server.url)
    assert in_use(after, "full") == in_use(after, window) == 0
    pools = httpx.get(server.url + "/dashboard/data").json()["engine"]["kv_pools"]
    assert [(p["group"], p["blocks"], p["blocks_free"]) for p in pools] == [
        (g, int(after["lucebox:kv_cache_blocks", g]), int(after["lucebox:kv_cache_blocks_free", g]))
        for g in ("full", window)]


def test_the_help_text_says_vllms_usage_is_the_primary_groups():
    stats = EngineStats(running=0, waiting=0, kv_blocks=8, kv_blocks_free=2, kv_capacity_tokens=32,
                        prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0,
                        kv_pools=(KVPoolStats("full", 8, 2), KVPoolStats("window=6", 4, 4)))
    text = Metrics("tiny").render(stats)
    assert "# HELP vllm:kv_cache_usage_perc" in text
    help_line = next(line for line in text.splitlines() if line.startswith("# HELP vllm:kv_cache_usage_perc"))
    assert "primary (full-attention) group" in help_line
    assert 'lucebox:kv_cache_usage_perc{model_name="tiny",group="full"} 0.75' in text
    assert 'lucebox:kv_cache_usage_perc{model_name="tiny",group="window=6"} 0.0' in text
