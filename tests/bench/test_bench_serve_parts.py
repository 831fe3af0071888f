"""`lucebox bench serve`'s parts without a server: the metrics math on synthetic timings, the
Prometheus parser against the server's own exposition, the agent traces, and the load generator."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from lucebox.bench.serve import load_tokenizer
from lucebox.bench.serve_data import CharSizer, TokenSizer, agent_requests, file_requests, random_requests
from lucebox.bench.serve_load import RequestResult, arrival_times, parse_prometheus, run_load
from lucebox.bench.serve_report import (
    calculate_metrics,
    counter_deltas,
    report_text,
    result_filename,
    result_json,
    server_figures,
)
from lucebox.default_model import BUNDLED


def ok(ttft, latency, output_len, itl=(), prompt_len=10, cached=None):
    return RequestResult(success=True, prompt_len=prompt_len, output_len=output_len, ttft=ttft, latency=latency,
                         itl=list(itl), cached_tokens=cached)


def test_metrics_follow_vllm_definitions_on_synthetic_timings():
    results = [ok(0.1, 1.1, 11, itl=[0.5, 0.5]), ok(0.2, 2.2, 21, itl=[1.0, 1.0]), ok(0.3, 0.3, 1),
               ok(0.4, 1.4, 6, itl=[0.25] * 4), RequestResult(error="HTTP 400: too long", prompt_len=999)]
    m = calculate_metrics(results, duration=4.0, percentiles=[50, 90, 99])
    assert (m["completed"], m["failed"]) == (4, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 39)  # the failed request counts nowhere
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(39 / 4)
    assert m["total_token_throughput"] == pytest.approx(79 / 4)
    # TTFT 100..400 ms: linear interpolation between order statistics, as numpy (and vLLM) compute it
    assert m["mean_ttft_ms"] == pytest.approx(250)
    assert m["median_ttft_ms"] == m["p50_ttft_ms"] == pytest.approx(250)
    assert m["p90_ttft_ms"] == pytest.approx(370)
    assert m["p99_ttft_ms"] == pytest.approx(397)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(12500))
    # TPOT per request of 2+ tokens: (E2EL - TTFT) / (tokens - 1) = 100, 100, 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert m["median_tpot_ms"] == pytest.approx(100)
    # ITL: every gap of every request, pooled
    assert m["mean_itl_ms"] == pytest.approx(1000 * 4.0 / 8)
    assert m["median_itl_ms"] == pytest.approx(375)
    assert m["mean_e2el_ms"] == pytest.approx(1250)
    assert m["p99_e2el_ms"] == pytest.approx(1000 * (1.4 + 0.97 * (2.2 - 1.4)))


def test_metrics_of_a_run_where_nothing_succeeded_are_missing_not_zero():
    m = calculate_metrics([RequestResult(error="refused")], duration=1.0, percentiles=[99])
    assert m["completed"] == 0 and m["failed"] == 1 and m["request_throughput"] == 0
    assert m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None


def test_server_counters_parse_from_lucebox_metrics_exposition():
    from lucebox.engine.async_engine import EngineStats
    from lucebox.server.metrics import Metrics

    metrics = Metrics("m")
    metrics.num_drafts, metrics.num_draft_tokens, metrics.num_accepted_tokens = 10, 40, 25
    metrics.accepted_per_pos = [9, 8, 5, 3]
    metrics.success.update({"length": 2, "stop": 3})
    stats = EngineStats(running=1, waiting=0, kv_blocks=256, kv_blocks_free=128, kv_capacity_tokens=4096,
                        prefix_cache_queries=300, prefix_cache_hits=120, preemptions=0)
    samples = parse_prometheus(metrics.render(stats))
    assert samples["vllm:prefix_cache_queries_total"] == 300
    assert samples["vllm:prefix_cache_hits_total"] == 120
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == 40
    assert samples["vllm:request_success_total"] == 5  # summed over finished_reason labels
    assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 25


def test_prefix_hit_rate_and_acceptance_are_deltas_over_the_run():
    before = {"prefix_cache_queries": 100, "prefix_cache_hits": 50, "spec_decode_num_drafts": 10,
              "spec_decode_num_draft_tokens": 40, "spec_decode_num_accepted_tokens": 20}
    after = {"prefix_cache_queries": 500, "prefix_cache_hits": 350, "spec_decode_num_drafts": 30,
             "spec_decode_num_draft_tokens": 120, "spec_decode_num_accepted_tokens": 50}
    deltas = counter_deltas(before, after)
    figures = server_figures(deltas, [])
    assert figures["prefix_cache_hit_rate"] == pytest.approx(300 / 400)
    assert figures["prefix_cache_source"] == "/metrics"
    assert figures["spec_decode_acceptance_rate"] == pytest.approx(30 / 80)
    assert figures["spec_decode_acceptance_length"] == pytest.approx(1 + 30 / 20)


def test_prefix_hit_rate_falls_back_to_usage_cached_tokens_without_metrics():
    results = [ok(0.1, 0.2, 2, prompt_len=100, cached=64), ok(0.1, 0.2, 2, prompt_len=100, cached=0)]
    figures = server_figures(counter_deltas(None, None), results)
    assert figures["prefix_cache_hit_rate"] == pytest.approx(0.32)
    assert figures["prefix_cache_source"] == "usage"
    assert figures["spec_decode_acceptance_rate"] is None


def test_report_prints_vllm_names_and_the_first_error():
    results = [ok(0.1, 1.1, 11, itl=[0.5, 0.5]), RequestResult(error="HTTP 400: the prompt is too long")]
    config = {"backend": "openai", "model_id": "org/some-model", "request_rate": "inf", "max_concurrency": 4}
    deltas = {"prefix_cache_queries": 10, "prefix_cache_hits": 5}
    result = result_json(config, calculate_metrics(results, 2.0, [50, 99]), server_figures(deltas, results), deltas,
                         results)
    text = report_text(result, ["ttft", "tpot", "itl", "e2el"], [50, 99])
    for line in ("Successful requests:                     1", "Failed requests:                         1",
                 "Benchmark duration (s):                  2.00", "Output token throughput (tok/s):         5.50",
                 "Median TTFT (ms):                        100.00", "P99 ITL (ms):", "Mean E2EL (ms):",
                 "Prefix cache hit rate (%, /metrics):     50.00", "Acceptance rate (%):                     n/a"):
        assert line in text, line
    assert text.splitlines()[-1] == "first error (1 failed): HTTP 400: the prompt is too long"
    assert result_filename(result) == f"openai-infqps-concurrency4-some-model-{result['date']}.json"


@pytest.fixture(scope="module")
def sizer():
    return TokenSizer(load_tokenizer(str(BUNDLED)))


def test_agent_traces_share_one_prefix_and_grow_turn_by_turn(sizer):
    requests = agent_requests(7, prefix_len=96, suffix_len=12, output_len=10, turns=3, sizer=sizer, seed=1)
    assert len(requests) == 7
    system = requests[0].messages[0]
    assert system["role"] == "system" and sizer.count(system["content"]) == 96
    assert all(r.messages[0] == system for r in requests)  # one prefix for every conversation
    assert [(r.turn, r.conversation) for r in requests] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    for i, r in enumerate(requests):
        if r.turn == 0:
            assert r.after is None and len(r.messages) == 2
            continue
        previous = requests[r.after]
        assert (previous.conversation, previous.turn) == (r.conversation, r.turn - 1)
        assert r.after < i
        assert r.messages[:len(previous.messages)] == previous.messages  # the whole history is resent
        assert len(r.messages) == len(previous.messages) + 2  # the reply and the tool's result
        assert r.prompt.startswith(previous.prompt)
        assert r.prompt_len >= previous.prompt_len + 10 + 12
    assert len({r.messages[1]["content"] for r in requests if r.turn == 0}) == 3  # each its own task


def test_agent_traces_are_deterministic_by_seed(sizer):
    def make(seed):
        return [(r.prompt, r.output_len, r.after) for r in agent_requests(6, 64, 8, 8, 2, sizer, seed)]
    assert make(5) == make(5)
    assert make(5) != make(6)


def test_random_prompts_have_the_asked_token_count(sizer):
    requests = random_requests(3, input_len=50, output_len=7, sizer=sizer, seed=0)
    assert [sizer.count(r.messages[0]["content"]) for r in requests] == [50, 50, 50]
    assert len({r.prompt for r in requests}) == 3 and all(r.output_len == 7 for r in requests)
    estimated = random_requests(1, input_len=50, output_len=7, sizer=CharSizer(4.0, ""), seed=0)
    assert len(estimated[0].messages[0]["content"]) == 200


def test_file_dataset_reads_prompt_lines_and_sharegpt(tmp_path, sizer):
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "def f(x):", "max_tokens": 5}\n\n{"prompt": "import os"}\n')
    got = sorted((r.prompt, r.output_len) for r in file_requests(str(lines), 2, 33, sizer, seed=0))
    assert got == [("### user\ndef f(x):\n\n", 5), ("### user\nimport os\n\n", 33)]
    assert len(file_requests(str(lines), 5, 33, sizer, seed=0)) == 5  # repeated to --num-prompts
    share = tmp_path / "sg.json"
    share.write_text('[{"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", '
                     '"value": "return a + b"}]}]')
    (request,) = file_requests(str(share), 1, 33, sizer, seed=0)
    assert request.messages == [{"role": "user", "content": "hi there"}]
    assert request.output_len == sizer.count("return a + b")


def test_file_dataset_errors_name_the_problem(tmp_path, sizer):
    from lucebox.errors import LuceboxError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(LuceboxError, match="entry 2 has neither"):
        file_requests(str(bad), 2, 8, sizer, 0)
    with pytest.raises(LuceboxError, match="no such file"):
        file_requests(str(tmp_path / "missing.jsonl"), 2, 8, sizer, 0)


def test_poisson_arrivals_have_the_asked_rate_and_inf_sends_all_at_once():
    times = arrival_times(4000, request_rate=20.0, seed=3)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 20, rel=0.05)
    assert times == arrival_times(4000, 20.0, seed=3)
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5


def test_load_keeps_the_concurrency_cap_and_agent_turn_order(sizer):
    requests = agent_requests(9, 32, 4, 4, 3, sizer, seed=0)
    running, peak, started, finished = [0], [0], {}, {}

    async def send(request):
        i = requests.index(request)
        started[i] = time.perf_counter()
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.02 if request.conversation == 0 else 0.005)
        running[0] -= 1
        finished[i] = time.perf_counter()
        return ok(0.001, 0.002, 2)

    results, duration = asyncio.run(run_load(send, requests, math.inf, 2, seed=0))
    assert len(results) == 9 and peak[0] == 2
    for i, r in enumerate(requests):
        if r.after is not None:
            assert started[i] >= finished[r.after]
    assert duration >= 3 * 0.02  # conversation 0's three turns run one after another
