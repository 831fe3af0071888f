"""/metrics of a hybrid (Gated DeltaNet) model: its recurrent-state pool, slots in use and in all,
beside vLLM's KV gauges; a dense model has no such pool and reports none."""
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


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("lucebox:recurrent_state")}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    model = build_hf_model("qwen3", tmp_path_factory.mktemp("hybrid-server"), tokenizer_dir,
                           **(HYBRID | {"max_position_embeddings": 4096}))
    srv, llm, _ = start_server(model, block_size=16, max_num_seqs=SLOTS)
    yield srv
    srv.stop()


def test_state_slots_in_use_follow_a_running_request(server):
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


def test_a_dense_model_reports_no_state_pool():
    stats = EngineStats(running=1, waiting=0, kv_blocks=8, kv_blocks_free=4, kv_capacity_tokens=128,
                        prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0)
    text = Metrics("tiny").render(stats)
    assert "vllm:kv_cache_usage_perc" in text and "lucebox:recurrent_state" not in text
