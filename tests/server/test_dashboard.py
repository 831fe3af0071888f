"""The status page's sampler (a fake clock, real EngineStats and RequestOutputs) and its data endpoint on a
real server: the official SDKs' usage and the Prometheus /metrics counters are the references."""
from __future__ import annotations

import concurrent.futures
import time

import anthropic
import httpx
import openai
import pytest

from lucebox.engine.async_engine import EngineStats
from lucebox.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lucebox.server.app import ServerConfig
from lucebox.server.dashboard import Dashboard
from tests.server_helpers import build_model, start_server

KEY = "dash-secret"
REPEATING = "the cat sat on the mat. " * 6  # n-gram lookup drafts it, the forced output accepts them


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def stats(running=0, waiting=0, free=10, queries=0, hits=0, slots=0, slots_free=0) -> EngineStats:
    return EngineStats(running=running, waiting=waiting, kv_blocks=10, kv_blocks_free=free, kv_capacity_tokens=160,
                       prefix_cache_queries=queries, prefix_cache_hits=hits, preemptions=0, state_slots=slots,
                       state_slots_free=slots_free)


def output(rid, tokens, arrival, first=None, finished=None, reason=None, cached=0, drafts=0, accepted=0, per_pos=()):
    m = RequestMetrics(arrival, first, finished, drafts, 3 * drafts, accepted, list(per_pos))
    return RequestOutput(rid, None, [1] * 10, [CompletionOutput(0, "", [7] * tokens, finish_reason=reason)],
                         finished=reason is not None, num_cached_tokens=cached, metrics=m)


def test_samples_turn_request_progress_into_per_second_rates_in_a_ring_buffer():
    clock, now = Clock(), {"stats": stats()}
    dash = Dashboard(lambda: now["stats"], period=1.0, history=3, clock=clock)
    dash.arrived("chatcmpl-a", 10)
    clock.now = 100.5
    now["stats"] = stats(running=1, free=8, queries=10, hits=4)
    dash.progress(output("chatcmpl-a", 4, arrival=100.1, first=100.5, cached=2, drafts=2, accepted=3, per_pos=[2, 1]))
    clock.now = 101.0
    s1 = dash.sample().values
    assert s1["running"] == 1 and s1["kv_usage"] == pytest.approx(0.2)
    assert s1["generated_tps"] == pytest.approx(4 / 1.0) and s1["prompt_tps"] == pytest.approx(8 / 1.0)
    assert s1["ttft"] == pytest.approx(0.4) and s1["acceptance_length"] == pytest.approx((3 + 2) / 2)
    assert s1["prefix_hit_rate"] == pytest.approx(0.4) and s1["state_usage"] is None

    clock.now = 101.5
    dash.progress(output("chatcmpl-a", 10, arrival=100.1, first=100.5, finished=101.5, reason="stop", cached=2,
                         drafts=4, accepted=5, per_pos=[3, 2]))
    dash.ended("chatcmpl-a")
    now["stats"] = stats(queries=10, hits=4, slots=4, slots_free=3)
    clock.now = 102.0
    s2 = dash.sample().values
    assert s2["generated_tps"] == pytest.approx(6.0) and s2["prompt_tps"] == 0 and s2["ttft"] is None
    assert s2["acceptance_length"] == pytest.approx((2 + 2) / 2)  # this interval's drafts only
    assert s2["prefix_hit_rate"] is None and s2["state_usage"] == pytest.approx(0.25)  # no new lookups

    for t in (103.0, 104.0):
        clock.now = t
        dash.sample()
    assert [s.t for s in dash.samples] == [102.0, 103.0, 104.0]  # history=3: the oldest fell out

    d = dash.snapshot("m")
    assert d["series"]["generated_tps"] == [pytest.approx(6.0), 0.0, 0.0]
    assert d["acceptance_per_position"] == [pytest.approx(1 / 2), pytest.approx(1 / 2)]  # window: 2 drafts
    totals = d["totals"]
    assert (totals["requests"], totals["generated_tokens"], totals["prompt_tokens"]) == (1, 10, 8)
    assert (totals["drafts"], totals["accepted_tokens"], totals["finished"]) == (4, 5, {"stop": 1})
    assert totals["acceptance_per_position"] == [pytest.approx(3 / 4), pytest.approx(2 / 4)]
    (row,) = d["requests"]
    assert row["api"] == "chat" and row["finish_reason"] == "stop" and row["generated_tokens"] == 10
    assert row["ttft"] == pytest.approx(0.4) and row["finished"] - row["arrival"] == pytest.approx(1.4)


def test_a_request_that_ends_without_finishing_is_an_abort_and_live_ones_come_first():
    clock = Clock()
    dash = Dashboard(stats, clock=clock)
    dash.arrived("msg_gone", 5)
    dash.arrived("cmpl-live", 5)
    clock.now = 101.0
    dash.ended("msg_gone")
    rows = dash.snapshot("m")["requests"]
    assert [(r["id"], r["api"], r["finish_reason"]) for r in rows] == [("cmpl-live", "completions", None),
                                                                      ("msg_gone", "messages", "abort")]
    assert rows[1]["first_token"] is None and rows[1]["finished"] - rows[1]["arrival"] == pytest.approx(1.0)


def test_bad_dashboard_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="period > 0"):
        Dashboard(stats, period=0)


# ------------------------------------------------------------------ a real server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_model(tmp_path_factory.mktemp("dash-model"))
    srv, llm, forcing = start_server(model_dir, ServerConfig(keepalive=0.3, api_key=KEY), block_size=16,
                                     max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                         "adaptive": False})
    forcing.scripts["rep"] = REPEATING
    srv.dashboard = srv.server.config.app.state.lucebox.dashboard
    srv.dashboard.period = 0.1  # 600 samples: a minute of history, more than the tests take
    yield srv
    srv.stop()


def data(server, key=KEY) -> httpx.Response:
    return httpx.get(server.url + "/dashboard/data", headers={"Authorization": f"Bearer {key}"} if key else {})


def run_requests(server) -> list[tuple[str, str, int, int, int]]:
    """Chat, completions and messages requests at once, one slow to start: (id, api, prompt, cached, generated)."""
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    user = [{"role": "user", "content": "the cat sat on the mat. the cat"}]

    def chat(model):
        r = oai.chat.completions.create(model=model, messages=user, max_tokens=40)
        return r.id, "chat", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.usage.completion_tokens

    def completion():
        r = oai.completions.create(model="force:rep", prompt="the cat sat on the mat.", max_tokens=30)
        return r.id, "completions", r.usage.prompt_tokens, 0, r.usage.completion_tokens

    def message():
        r = claude.messages.create(model="force:rep", messages=user, max_tokens=30)
        return r.id, "messages", r.usage.input_tokens + r.usage.cache_read_input_tokens, \
            r.usage.cache_read_input_tokens, r.usage.output_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, "force:slow"), pool.submit(chat, "force:rep"), pool.submit(completion),
                   pool.submit(message)]
        seen_live = False
        while not all(f.done() for f in futures):
            body = data(server).json()
            seen_live |= any(r["finish_reason"] is None for r in body["requests"])
            time.sleep(0.05)
        assert seen_live, "no request was ever listed while running"
        return [f.result() for f in futures]


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_the_data_endpoint_matches_the_sdks_usage_and_the_prometheus_counters(server):
    done = run_requests(server)
    last_finish = time.time()
    deadline = time.monotonic() + 5
    while (body := data(server).json())["series"]["t"][-1] < last_finish + 0.05:  # a sample after them all
        assert time.monotonic() < deadline
        time.sleep(0.05)
    prom = httpx.get(server.url + "/metrics", headers={"x-api-key": KEY}).text

    rows = {r["id"]: r for r in body["requests"]}
    assert set(rows) == {rid for rid, *_ in done}
    for rid, api, prompt, cached, generated in done:
        r = rows[rid]
        assert (r["api"], r["prompt_tokens"], r["cached_tokens"], r["generated_tokens"]) == (api, prompt, cached, generated)
        assert r["arrival"] < r["first_token"] <= r["finished"] and r["finish_reason"] in ("stop", "length")
    slow = rows[done[0][0]]
    assert slow["ttft"] >= 1.0  # "force:slow" holds its first token back for a second

    totals = body["totals"]
    assert totals["requests"] == len(done) == sum(totals["finished"].values())
    assert totals["generated_tokens"] == sum(d[4] for d in done) == metric(prom, "vllm:generation_tokens_total")
    assert totals["prompt_tokens"] == sum(d[2] - d[3] for d in done)
    assert totals["mean_ttft"] * len(done) == pytest.approx(metric(prom, "vllm:time_to_first_token_seconds_sum"))
    assert totals["drafts"] == metric(prom, "vllm:spec_decode_num_drafts_total") > 0
    assert totals["accepted_tokens"] == metric(prom, "vllm:spec_decode_num_accepted_tokens_total") > 0
    per_pos = [metric(prom, f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{i}"}}')
               for i in range(3)]
    assert totals["acceptance_per_position"] == pytest.approx([n / totals["drafts"] for n in per_pos])
    assert 1.0 < totals["acceptance_length"] <= 4.0

    series = body["series"]
    assert len(series["t"]) == len(series["running"]) == len(series["kv_usage"]) >= 3
    assert max(series["running"]) >= 1 and max(series["kv_usage"]) > 0
    assert any(v is not None and v > 1.0 for v in series["acceptance_length"])
    # the slow request's TTFT is in one sample's mean, beside at most the other requests' TTFTs
    assert any(v is not None and v >= slow["ttft"] / len(done) for v in series["ttft"])
    # every generated token shows up in exactly one sample's rate
    starts = [body["started"]] + series["t"][:-1]
    # (to a hundredth of a token: the page's timestamps are rounded, a lost token would be off by 1)
    assert sum(r * (t - s) for r, t, s in zip(series["generated_tps"], series["t"], starts)) == pytest.approx(
        totals["generated_tokens"], abs=0.01)
    assert body["engine"]["state_usage"] is None
    # Prefix hits: the burst's requests may all be admitted in one step (none finds another's blocks),
    # so one request repeated after them is what must hit.
    repeat = dict(model="tiny", messages=[{"role": "user", "content": "tell me about the cat on the mat " * 4}],
                  max_tokens=2)
    for _ in range(2):
        openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(**repeat)
    deadline = time.monotonic() + 10
    while data(server).json()["engine"]["prefix_cache_hits"] == 0:
        assert time.monotonic() < deadline, "the repeated request found nothing in the prefix cache"
        time.sleep(0.05)


def test_the_page_is_public_its_data_needs_the_api_key(server):
    assert data(server, key=None).status_code == 401 and data(server, key="wrong").status_code == 401
    assert data(server).status_code == 200
    types = {"/": "text/html", "/dashboard": "text/html", "/dashboard/static/dashboard.js": "text/javascript",
             "/dashboard/static/dashboard.css": "text/css", "/dashboard/static/vendor/uPlot.iife.min.js": "text/javascript",
             "/dashboard/static/vendor/uPlot.min.css": "text/css"}
    for path, kind in types.items():
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
    assert httpx.get(server.url + "/dashboard/static/missing.js").status_code == 404
    assert httpx.get(server.url + "/metrics").status_code == 401  # nothing else opened up
