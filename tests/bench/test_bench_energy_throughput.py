"""Joules per token (the power integration and its wiring into bench speed) and bench throughput's
batched rows against their bandwidth limits, on CPU."""
from __future__ import annotations

import json
import time

import pytest
import torch

from lucebox.bench import batch_limits, energy, limits, shapes, speed, speed_report
from lucebox.cli import main
from lucebox.model.cache_spec import kv_bytes_per_token

CPU = torch.device("cpu")


def test_constant_power_integrates_to_watts_times_seconds():
    samples = [(t / 10, 300.0) for t in range(11)]  # 300 W from 0 to 1 s
    assert energy.integrate(samples, 0.0, 1.0) == pytest.approx(300.0)
    assert energy.integrate(samples, 0.25, 0.65) == pytest.approx(120.0)


def test_a_ramp_integrates_exactly_with_interpolated_ends():
    samples = [(0.0, 100.0), (1.0, 200.0), (3.0, 400.0)]  # P(t) = 100 + 100 t
    assert energy.integrate(samples, 0.0, 3.0) == pytest.approx(100 * 3 + 50 * 9)
    # ends between samples: the integral of 100 + 100 t from 0.5 to 2.5 = 200 + 50 (6.25 - 0.25)
    assert energy.integrate(samples, 0.5, 2.5) == pytest.approx(500.0)
    assert energy.integrate(samples, 1.2, 1.7) == pytest.approx(0.5 * (100 + 100 * 1.45))


def test_beyond_the_samples_the_nearest_value_holds_and_bad_stretches_are_refused():
    samples = [(1.0, 50.0), (2.0, 150.0)]
    assert energy.integrate(samples, 0.0, 1.0) == pytest.approx(50.0)
    assert energy.integrate(samples, 2.0, 4.0) == pytest.approx(300.0)
    with pytest.raises(ValueError, match="ends"):
        energy.integrate(samples, 2.0, 1.0)
    with pytest.raises(ValueError, match="no power samples"):
        energy.integrate([], 0.0, 1.0)


class FakeNvml:
    """Stands in for pynvml: 250 W, and an energy counter rising at 250 J/s."""
    NVMLError = RuntimeError

    def __init__(self):
        self.start = time.perf_counter()

    def nvmlDeviceGetPowerUsage(self, handle):
        return 250_000  # milliwatts

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return round(250_000 * (time.perf_counter() - self.start))  # millijoules


def test_the_meter_samples_in_a_thread_and_reports_both_integrations():
    with energy.PowerMeter(FakeNvml(), None, interval=0.005) as meter:
        t0 = time.perf_counter()
        time.sleep(0.2)
        t1 = time.perf_counter()
        time.sleep(0.02)
    got = meter.joules(t0, t1)
    assert got["joules"] == pytest.approx(250 * (t1 - t0))
    assert got["samples"] >= 10
    assert got["counter_joules"] == pytest.approx(250 * (t1 - t0), abs=250 * 0.06)  # counter read ~every 5 ms


def test_no_nvml_on_cpu_says_so_in_the_decode_row():
    meter, why = energy.open_meter(CPU)
    assert meter is None and why.startswith("n/a (no NVML)")
    result = speed.run(speed.default_args(shape="tiny", quant="f32", device="cpu", prompt_lens=[16], contexts=[16],
                                          decode_tokens=4, repeats=1, skip=["verify", "forced", "spec", "peer"]))
    assert result["energy"] == {"skipped": why} and "joules_per_token" not in result["decode"][0]
    row = next(r for r in speed_report.report_rows(result) if r[0].startswith("decode at"))
    assert "n/a (no NVML)" in row[1]


def test_decode_rows_carry_joules_per_token_of_their_timed_decode(monkeypatch):
    """A meter of a steady 2 W: each decode row's joules per token must be 2 W over its tok/s."""
    class Steady:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def joules(self, t0, t1):
            return {"joules": 2.0 * (t1 - t0), "counter_joules": 3.0 * (t1 - t0), "samples": 1}
    monkeypatch.setattr(energy, "open_meter", lambda device: (Steady(), None))
    result = speed.run(speed.default_args(shape="tiny", quant="f32", device="cpu", prompt_lens=[16], contexts=[16, 32],
                                          decode_tokens=4, repeats=1, skip=["verify", "forced", "spec", "peer"]))
    for d in result["decode"]:
        assert d["joules_per_token"] == pytest.approx(2.0 / d["tok_s"])
        assert d["counter_joules_per_token"] == pytest.approx(3.0 / d["tok_s"])
    assert result["energy"]["source"] == "NVML power"
    row = next(r for r in speed_report.report_rows(result) if r[0] == "decode at context 16")
    tok_s = result["decode"][0]["tok_s"]
    assert f"{2.0 / tok_s:.3g} J/token (counter {3.0 / tok_s:.3g})" in row[1]


# ------------------------------------------------------------------------------------------- throughput
def test_throughput_of_a_shape_reports_each_level_against_its_bandwidth_limit(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--shape", "tiny", "--quant", "q8_0", "--device", "cpu", "--concurrency", "1",
                 "4", "--prompt-len", "16", "--output-len", "6", "--spec-method", "ngram", "--no-hit-rate",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    model = shapes.build_random_model("tiny", "q8_0", CPU).model
    bandwidth = result["reference"]["gemv_gb_s"] * 1e9
    context = 16 + (6 + 1) / 2
    assert result["quant"] == "q8_0" and [r["concurrency"] for r in result["throughput"]] == [1, 4]
    for row in result["throughput"]:
        n = row["concurrency"]
        assert row["output_tokens"] == n * 5  # every token after the prefill's first
        assert row["weight_bytes_per_step"] == limits.weight_bytes_per_token(model) + (n - 1) * 256 * 34 // 32
        assert row["kv_bytes_per_step"] == pytest.approx(n * kv_bytes_per_token(model, "auto", "auto") * context, abs=n)
        step = row["weight_bytes_per_step"] + row["kv_bytes_per_step"]
        assert row["bandwidth_limit_tok_s"] == pytest.approx(n * bandwidth / step)
        # one row a token: the matmul rate over a row's FLOPs (2 a weight, attention over the mean context)
        cfg = model.config
        flops = 2 * sum(limits.matmul_params(cfg)) + 4 * cfg.num_heads * cfg.head_dim * context * cfg.num_layers
        assert row["compute_limit_tok_s"] == pytest.approx(result["reference"]["matmul_tflops"] * 1e12 / flops)
        assert row["limit_tok_s"] == min(row["bandwidth_limit_tok_s"], row["compute_limit_tok_s"])
        assert row["pct_limit"] == pytest.approx(100 * row["tok_s"] / row["limit_tok_s"])
        spec = row["spec"]
        assert spec["output_tokens"] == n * 5 and spec["tokens_per_sequence_step"] >= 1
        # a verify step reads what a decode step reads and commits tau tokens a sequence: tau times the bytes'
        # bound; its rows (drafts included) cost compute, each committing tokens_per_row <= 1 token
        assert spec["bandwidth_limit_tok_s"] == pytest.approx(spec["tokens_per_sequence_step"] * bandwidth * n / step)
        assert 0 < spec["tokens_per_row"] <= 1
        assert spec["compute_limit_tok_s"] == pytest.approx(row["compute_limit_tok_s"] * spec["tokens_per_row"])
        assert spec["limit_tok_s"] == min(spec["bandwidth_limit_tok_s"], spec["compute_limit_tok_s"])
        assert spec["pct_limit"] == pytest.approx(100 * spec["tok_s"] / spec["limit_tok_s"])
    table = capsys.readouterr().out
    assert "| concurrent sequences | output tok/s | ratio to 1 | GB a step (weights + KV) | limit tok/s |" in table
    assert "speculative (ngram) tok/s | x plain | tokens a sequence-step | its limit tok/s | % of it |" in table
    assert f"| {result['throughput'][1]['spec']['pct_limit']:.1f}% |" in table


def test_a_batch_reads_the_experts_any_of_its_tokens_routes_to():
    model = shapes.build_random_model("tiny-moe", "bf16", CPU).model
    cfg = model.config
    assert batch_limits.weight_bytes_per_step(model, 1) == limits.weight_bytes_per_token(model)
    share = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** 8
    sizes = limits.weight_tensors(model)
    experts = sum(s for name, s in sizes.items() if limits._is_expert(name))
    row = cfg.hidden_size * 2
    expected = (limits.weight_bytes_per_token(model) - experts * cfg.num_experts_per_tok // cfg.num_experts
                + experts * share + 7 * row)
    assert batch_limits.weight_bytes_per_step(model, 8) == round(expected)
    assert batch_limits.expert_share(model, 10_000) == pytest.approx(1.0)


def test_throughput_refuses_a_drafter_method_without_a_drafter():
    assert main(["bench", "throughput", "--shape", "tiny", "--device", "cpu", "--spec-method", "dflash"]) == 1


def test_forced_throughput_accepts_every_draft_of_each_sequence_on_the_same_prompts(tmp_path, capsys):
    """--spec-method forced: each sequence drafts its own recorded greedy continuation, so with 3 drafts a
    step every verify commits 4 tokens (12 after the prefill's first: 3 steps a sequence)."""
    out = tmp_path / "f.json"
    assert main(["bench", "throughput", "--shape", "tiny", "--device", "cpu", "--concurrency", "1", "3",
                 "--prompt-len", "16", "--output-len", "13", "--spec-method", "forced", "--spec-tokens", "3",
                 "--no-hit-rate", "--no-reference", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["spec_method"] == "forced" and result["spec_config"]["num_speculative_tokens"] == 3
    for row in result["throughput"]:
        spec = row["spec"]
        assert spec["converged"] and spec["output_tokens"] == row["output_tokens"] == 12 * row["concurrency"]
        assert spec["tokens_per_sequence_step"] == pytest.approx(4.0)
        assert spec["tokens_per_row"] == pytest.approx(1.0)  # every drafted row committed
        assert spec["ratio_to_plain"] == pytest.approx(spec["tok_s"] / row["tok_s"])
    assert "| speculative (forced) tok/s | x plain | tokens a sequence-step |" in capsys.readouterr().out
