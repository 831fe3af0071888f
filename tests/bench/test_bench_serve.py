"""`lucebox bench serve` end to end: against a server started in-test (--url), and starting the bundled
default model itself; the report's numbers checked against what the server counted."""
from __future__ import annotations

import json
import socket

import pytest

from lucebox.cli import main
from tests.server_helpers import build_model, start_server



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv, llm, _ = start_server(build_model(tmp_path_factory.mktemp("bench-serve-model")), block_size=16,
                               max_num_seqs=8)
    yield srv
    srv.stop()


def bench(*flags) -> int:
    return main(["bench", "serve", "--disable-tqdm", *flags])


def assert_consistent(result: dict, prompts: int):
    """The totals are the per-request sums, and the server counted the same tokens over the run."""
    assert (result["completed"], result["failed"]) == (prompts, 0)
    assert result["total_input_tokens"] == sum(result["input_lens"]) == result["server_metrics"]["prompt_tokens"]
    assert result["total_output_tokens"] == sum(result["output_lens"]) \
        == result["server_metrics"]["generation_tokens"]
    assert all(0 < ttft <= e2el for ttft, e2el in zip(result["ttfts"], result["e2els"]))
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["request_throughput"] == pytest.approx(prompts / result["duration"])


def test_url_sweep_over_request_rates_on_the_chat_endpoint(server, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = bench("--url", server.url, "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
               "--random-input-len", "24", "--random-output-len", "5", "--ignore-eos",
               "--request-rate", "40,inf", "--max-concurrency", "2", "--json", str(out))
    assert rc == 0
    results = json.loads(out.read_text())
    assert [(r["request_rate"], r["max_concurrency"]) for r in results] == [(40.0, 2), ("inf", 2)]
    for result in results:
        assert_consistent(result, 3)
        assert result["output_lens"] == [5, 5, 5]  # --ignore-eos: every asked token
        assert result["backend"] == "openai-chat" and result["served_model_name"] == "tiny"
        assert result["prefix_cache_source"] == "/metrics"
    captured = capsys.readouterr()
    assert "the server has no /tokenize: prompt lengths estimated at 4 chars per token" in captured.err
    assert captured.out.count("Serving Benchmark Result") == 2
    assert "| max concurrency | request rate |" in captured.out


def test_url_counts_failed_requests_and_shows_the_first_error(server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def add(a, b):", "max_tokens": 3}, {"prompt": "word " * 4000, "max_tokens": 3},
            {"prompt": "The weather in Paris", "max_tokens": 3}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    rc = bench("--url", server.url, "--dataset", str(data), "--num-prompts", "3", "--ignore-eos", "--save-result",
               "--result-dir", str(tmp_path / "results"))
    assert rc == 0
    (saved,) = (tmp_path / "results").glob("openai-infqps-tiny-*.json")
    result = json.loads(saved.read_text())
    assert (result["completed"], result["failed"]) == (2, 1)
    assert result["output_lens"] == [3, 3]
    assert result["total_input_tokens"] == result["server_metrics"]["prompt_tokens"]
    out = capsys.readouterr().out
    assert "Failed requests:                         1" in out
    assert "first error (1 failed): HTTP 400:" in out and "context" in out.split("first error")[1]


def test_bad_flags_and_unreachable_servers_are_one_clear_line(server, capsys):
    assert bench("--url", server.url, "--model", "x") == 1
    assert "give --url (a running server) or --model (start one), not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench("--url", server.url, "--max-concurrency", "0")
    assert "argument --max-concurrency: '0': a concurrency must be > 0" in capsys.readouterr().err
    assert bench("--url", server.url, "--dataset", "nope.jsonl") == 1
    assert "--dataset nope.jsonl: no such file" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert bench("--url", f"http://127.0.0.1:{port}") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: http://127.0.0.1:") and "cannot list the server's models" in err
    assert "Traceback" not in err


def test_bundled_model_started_by_the_bench_agent_traces_hit_the_prefix_cache(tmp_path, capsys):
    out = tmp_path / "agent.json"
    rc = bench("--dataset", "agent", "--num-prompts", "4", "--turns", "2", "--prefix-len", "64", "--suffix-len",
               "8", "--agent-output-len", "6", "--max-concurrency", "2", "--json", str(out),
               "--serve-args", "--max-num-seqs 4")  # a small KV pool: a quicker start
    assert rc == 0
    result = json.loads(out.read_text())
    assert_consistent(result, 4)
    assert result["model_id"].endswith("models/default")
    deltas = result["server_metrics"]
    assert deltas["prefix_cache_hits"] > 0 and result["prefix_cache_hit_rate"] > 0
    assert result["prefix_cache_hit_rate"] == deltas["prefix_cache_hits"] / deltas["prefix_cache_queries"]
    assert 0 <= deltas["spec_decode_num_accepted_tokens"] <= deltas["spec_decode_num_draft_tokens"]
    err = capsys.readouterr().err
    assert "prompt lengths counted by the model's tokenizer" in err
    assert "serve --model" in err and "--max-num-seqs 4" in err  # --serve-args reach the started server
    port = int(err.split("--port ")[1].split()[0].rstrip("]"))
    with socket.socket() as s:  # the started server is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0
