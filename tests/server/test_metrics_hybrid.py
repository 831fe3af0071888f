"""/metrics of a hybrid (Gated DeltaNet) model: its recurrent-state pool, slots in use and in all,
beside vLLM's KV gauges, and the state-snapshot pool prefix reuse goes through (entries, those in
use, admissions served from one and the prompt tokens they did not compute); a dense model has
no such pools and reports none."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from lucebox.engine.async_engine import EngineStats
from lucebox.server.metrics import Metrics
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import HYBRID
from tests.server_helpers import start_server

SLOTS = 3
BLOCK = 16
SNAPSHOTS = 8  # --recurrent-prefix-snapshots' default


def gauges(url: str, prefix: str = "lucebox:recurrent_state") -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(prefix)}


def snapshot_figures(url: str) -> dict[str, float]:
    return gauges(url, "lucebox:recurrent_prefix_snapshot") | gauges(url, "vllm:prefix_cache_hits")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    model = build_hf_model("qwen3", tmp_path_factory.mktemp("hybrid-server"), tokenizer_dir,
                           **(HYBRID | {"max_position_embeddings": 4096}))
    srv, _, _ = start_server(model, block_size=BLOCK, max_num_seqs=SLOTS)
    yield srv
    srv.stop()


def test_state_slots_in_use_follow_a_running_request(server):
    assert snapshot_figures(server.url)["lucebox:recurrent_prefix_snapshots"] == SNAPSHOTS  # empty, still there
    idle = gauges(server.url)
    assert idle == {"lucebox:recurrent_state_slots": SLOTS, "lucebox:recurrent_state_slots_in_use": 0,
                    "lucebox:recurrent_state_usage_perc": 0.0}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running: it holds a slot
    running = gauges(server.url)
    assert running["lucebox:recurrent_state_slots_in_use"] == 1 and running["lucebox:recurrent_state_slots"] == SLOTS
    assert running["lucebox:recurrent_state_usage_perc"] == pytest.approx(1 / SLOTS)
    stream.close()  # the client leaves: the request is aborted and its slot freed
    deadline = time.monotonic() + 10
    while gauges(server.url)["lucebox:recurrent_state_slots_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gauges(server.url)["lucebox:recurrent_state_slots_in_use"] == 0


def test_a_repeated_prompt_is_served_from_a_snapshot_and_counted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    prompt = " ".join(f"entry{i}" for i in range(40))
    before = snapshot_figures(server.url)
    assert before["lucebox:recurrent_prefix_snapshots"] == SNAPSHOTS
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    kept = snapshot_figures(server.url)
    assert kept["lucebox:recurrent_prefix_snapshots_in_use"] > before["lucebox:recurrent_prefix_snapshots_in_use"]
    hits = "lucebox:recurrent_prefix_snapshot_hits_total"
    assert kept[hits] == before[hits]  # a new prompt: nothing to load
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = snapshot_figures(server.url)
    saved = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK  # the prompt's snapshot boundary
    assert again.usage.prompt_tokens_details.cached_tokens == saved > 0
    assert after[hits] - kept[hits] == 1
    assert (after["lucebox:recurrent_prefix_snapshot_hit_tokens_total"]
            - kept["lucebox:recurrent_prefix_snapshot_hit_tokens_total"]) == saved
    # every prefix hit of a hybrid starts from a snapshot: the two token counters move together
    assert (after["vllm:prefix_cache_hits_total"] - kept["vllm:prefix_cache_hits_total"]) == saved
    assert after["lucebox:recurrent_prefix_snapshots_in_use"] <= SNAPSHOTS
    engine = httpx.get(server.url + "/dashboard/data").json()["engine"]
    assert engine["recurrent_prefix_snapshot_hit_tokens"] == after["lucebox:recurrent_prefix_snapshot_hit_tokens_total"]
    assert engine["recurrent_prefix_snapshots"] == SNAPSHOTS


def test_a_dense_model_reports_no_state_pool():
    stats = EngineStats(running=1, waiting=0, kv_blocks=8, kv_blocks_free=4, kv_capacity_tokens=128,
                        prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0)
    text = Metrics("tiny").render(stats)
    assert "vllm:kv_cache_usage_perc" in text and "lucebox:recurrent_state" not in text
