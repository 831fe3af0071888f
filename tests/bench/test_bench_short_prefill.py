"""Issue 33's measurement tools on CPU: cached-prefix TTFT rows of bench speed (and their llama.cpp peer),
scripts/profile_prefill.py, joules per token."""
from __future__ import annotations

import importlib.util
import json
import stat
from pathlib import Path

import pytest

from lucebox.bench import prefix, speed, speed_report
from lucebox.cli import main
from lucebox.errors import RequestError

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).with_name("llama_bench_sample.json")
PREFIX_ONLY = dict(shape="tiny", quant="f32", device="cpu", prompt_lens=[16], contexts=[16], decode_tokens=4,
                   repeats=1, skip=["reference", "verify", "forced", "spec", "peer"])


def test_suffix_on_a_cached_prefix_is_served_from_the_prefix_cache_beside_fresh_prompts(tmp_path, capsys):
    code = main(["bench", "speed", "--shape", "tiny", "--quant", "f32", "--device", "cpu", "--prompt-lens", "16",
                 "--contexts", "16", "--decode-tokens", "4", "--repeats", "1", "--skip", "reference", "verify",
                 "forced", "spec", "peer", "--prefix-lens", "64", "100", "--suffix-lens", "16", "40",
                 "--json", str(tmp_path / "r.json")])
    assert code == 0
    rows = json.loads((tmp_path / "r.json").read_text())["prefix"]
    assert [(r["prefix_len"], r["suffix_len"]) for r in rows] == [(64, 16), (64, 40), (100, 16), (100, 40)]
    for r in rows:  # whole 16-token blocks of the prefix: 64 of 64, 96 of 100
        assert r["cached_tokens"] == r["expected_cached_tokens"] == r["prefix_len"] // 16 * 16
        assert r["computed_tokens"] == r["prefix_len"] + r["suffix_len"] - r["cached_tokens"]
        assert r["ttft_s"] > 0 and r["fresh_ttft_s"] > 0 and r["fresh_prefix_ttft_s"] > 0
        assert r["tok_s"] == pytest.approx(r["suffix_len"] / r["ttft_s"])
    table = capsys.readouterr().out
    assert "| 40 tokens on a cached 100-token prefix (96 cached) | TTFT " in table
    assert "fresh 40-token prompt" in table and "llama.cpp not measured" in table


def test_a_hybrids_prefix_engine_has_room_for_its_state_snapshots(tmp_path):
    """Prefix caching on a hybrid keeps recurrent-state snapshots beside the KV pool of one context."""
    code = main(["bench", "speed", "--shape", "tiny-hybrid", "--quant", "f32", "--device", "cpu", "--prompt-lens",
                 "16", "--contexts", "16", "--decode-tokens", "4", "--repeats", "1", "--skip", "reference", "verify",
                 "forced", "spec", "peer", "--prefix-lens", "64", "--suffix-lens", "16", "--json", str(tmp_path / "r.json")])
    assert code == 0
    [row] = json.loads((tmp_path / "r.json").read_text())["prefix"]
    assert row["cached_tokens"] == 64 and row["ttft_s"] > 0


def test_a_prefix_that_misses_the_cache_is_an_error_not_a_figure(monkeypatch):
    """Prefix caching off under the phase: the cached-token check must refuse the row."""
    made = prefix.prefix_engine

    def uncached(*a, **k):
        engine = made(*a, **k)
        engine.scheduler.cache.match_prefix = lambda tokens, seq: []
        return engine
    monkeypatch.setattr(prefix, "prefix_engine", uncached)
    with pytest.raises(RuntimeError, match="served 0 prompt tokens from the prefix cache, expected 64"):
        speed.run(speed.default_args(**PREFIX_ONLY, prefix_lens=[64], suffix_lens=[16]))


def test_lengths_that_do_not_fit_are_refused_naming_the_flag():
    with pytest.raises(RequestError, match=r"--prefix-lens \[4010\] / --suffix-lens \[16\] do not fit"):
        speed.run(speed.default_args(**PREFIX_ONLY, prefix_lens=[4010], suffix_lens=[16]))
    with pytest.raises(RequestError, match="do not fit"):
        speed.run(speed.default_args(**PREFIX_ONLY, prefix_lens=[64], suffix_lens=[0]))


def test_llama_bench_times_the_suffix_at_the_prefix_depth_as_the_peer(tmp_path):
    """A second llama-bench run: -p SUFFIXES -n 0 -d PREFIXES; its row at (depth, prompt) becomes the
    peer TTFT of the matching cached-prefix row (here matched by hand to the sample's pp4096 @ d512)."""
    seen = tmp_path / "argv"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {seen}\ncat {SAMPLE}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    args = speed.default_args(**dict(PREFIX_ONLY, skip=["reference", "verify", "spec"]), peer="llama.cpp",
                              llama_bench=str(fake), peer_dir=str(tmp_path), prefix_lens=[64], suffix_lens=[16, 32])
    result = speed.run(args)
    second = seen.read_text().splitlines()[1].split()
    flags = dict(zip(second[0::2], second[1::2]))
    assert (flags["-p"], flags["-n"], flags["-d"]) == ("16,32", "0", "64")
    assert [(p["depth"], p["prompt_len"]) for p in result["peer"]["prefix"]] == [(0, 4096), (512, 4096)]
    rows = [dict(result["prefix"][0], prefix_len=512, suffix_len=4096, ttft_s=2.0)]
    prefix.peer_ratios(rows, result["peer"]["prefix"])
    assert rows[0]["llama_cpp_ttft_s"] == pytest.approx(4096 / 2925.71)
    assert rows[0]["llama_cpp_ttft_ratio"] == pytest.approx(2.0 / (4096 / 2925.71))
    table = {r[0]: r for r in prefix.report_rows({"prefix": rows}, speed_report._n)}
    assert table["4,096 tokens on a cached 512-token prefix (64 cached)"][3] == \
        f"{2.0 / (4096 / 2925.71):.2f}x llama.cpp"


def _profile_script():
    spec = importlib.util.spec_from_file_location("profile_prefill", ROOT / "scripts" / "profile_prefill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_prefill_runs_on_cpu_and_prints_ops_and_syncs_by_call_site(capsys):
    script = _profile_script()
    assert script.main(["--shape", "tiny", "--quant", "f32", "--device", "cpu", "--tokens", "32",
                        "--prefix-len", "64", "--rows", "5"]) == 0
    out = capsys.readouterr().out
    assert "32 new tokens on a 64-token prefix (64 served from the prefix cache)" in out
    assert "top operators by host time:" in out and "aten::mm" in out
    assert "host-device syncs in the step (profiler events):" in out and "runtime copies in the step" in out
    lines = out.split("syncing tensor calls")[1].splitlines()
    total = int(lines[0].split(":")[1].split()[0])
    sites = [int(line.split()[0]) for line in lines[1:] if "Tensor." in line]
    assert total >= 1 and sum(sites) == total and all("lucebox/" in line for line in lines[1:] if "Tensor." in line)


def test_the_sync_counter_counts_calls_by_site_and_restores_the_methods():
    import collections

    import torch
    script = _profile_script()
    before = torch.Tensor.item
    counts = collections.Counter()
    with script.count_syncing_calls(counts):
        x = torch.ones(3)
        x.sum().item(), x.tolist(), x.tolist(), bool(x[0])
    assert sum(counts.values()) == 4
    assert sorted(k.split(" at ")[0] for k in counts.elements()) == \
        ["Tensor.__bool__", "Tensor.item", "Tensor.tolist", "Tensor.tolist"]
    assert torch.Tensor.item is before and torch.ones(1).item() == 1.0
