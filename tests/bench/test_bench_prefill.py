"""`lucebox bench prefill`: exact and scored TTFT in one run, the scored one split into scoring and target."""
from __future__ import annotations

import json

from lucebox.cli import main


def test_bench_prefill_reports_each_ratio(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--shape", "tiny", "--scorer", "tiny", "--device", "cpu", "--prompt-lens", "320",
                 "--keep-ratio", "0.1", "0.5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["prompt_tokens"] == 320 and row["exact_ttft_s"] > 0
    assert [s["kept_tokens"] for s in row["scored"]] == [32, 160]  # 1 and 5 of 10 chunks
    for s in row["scored"]:
        assert 0 < s["scoring_s"] < s["ttft_s"] and abs(s["scoring_s"] + s["target_s"] - s["ttft_s"]) < 1e-9
    assert "speedup" in capsys.readouterr().out


def test_bench_prefill_refuses_bad_ratios(capsys):
    assert main(["bench", "prefill", "--shape", "tiny", "--device", "cpu", "--keep-ratio", "1.5"]) == 1
    assert "--keep-ratio" in capsys.readouterr().err


def test_bench_prefill_needle_recall_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "needle.json"
    assert main(["bench", "prefill", "--needle", "--device", "cpu", "--prompt-lens", "1024", "--keep-ratio", "0.1",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["needle"]
    assert row["needles"] == 5 and row["recalled"] == 5  # the question quotes the needle: anchors keep it
    assert 0 < row["kept_share"] < 1
    assert "recall" in capsys.readouterr().out
    assert main(["bench", "prefill", "--needle", "--shape", "tiny", "--device", "cpu"]) == 1
    assert "--needle needs real checkpoints" in capsys.readouterr().err
