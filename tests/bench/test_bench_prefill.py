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
    assert main(["bench", "prefill", "--shape", "tiny", "--device", "cpu", "--scorer-chunk", "0"]) == 1
    assert "--scorer-chunk" in capsys.readouterr().err


def test_the_scorer_chunk_sets_its_forwards_not_what_is_kept(tmp_path, monkeypatch):
    from lucebox.engine.pflash.score import TailAttentionScorer
    forwards = []
    original = TailAttentionScorer._prefill_chunk
    monkeypatch.setattr(TailAttentionScorer, "_prefill_chunk", lambda self, ids, *rest: (forwards.append(len(ids)),
                                                                                    original(self, ids, *rest)))
    kept = {}
    for chunk in (64, 4096):
        out = tmp_path / f"prefill-{chunk}.json"
        forwards.clear()
        assert main(["bench", "prefill", "--shape", "tiny", "--scorer", "tiny", "--device", "cpu", "--prompt-lens",
                     "320", "--keep-ratio", "0.5", "--scorer-chunk", str(chunk), "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        # 320 tokens: the 312 before the 8-token tail in forwards of at most `chunk`, then the tail's own
        one_scoring = [64, 64, 64, 64, 56, 8] if chunk == 64 else [312, 8]
        assert result["scorer_chunk"] == chunk and forwards[:len(one_scoring)] == one_scoring
        assert len(forwards) % len(one_scoring) == 0
        kept[chunk] = result["rows"][0]["scored"][0]["kept_tokens"]
    assert kept[64] == kept[4096] == 160


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
