"""`lucebox bench kv-pool`: decode speed and KV memory of a KVFlash pool against the full KV in one run; the
pooled sequence's device KV stays one pool whatever the context, the rest is in host memory."""
from __future__ import annotations

import json

from lucebox.bench import shapes
from lucebox.cli import main
from lucebox.model.cache_spec import kv_bytes_per_token

BLOCK = 16


def test_pool_keeps_device_kv_bounded_as_the_context_grows(tmp_path, capsys):
    out = tmp_path / "kv-pool.json"
    assert main(["bench", "kv-pool", "--device", "cpu", "--shape", "tiny", "--contexts", "1024", "2048",
                 "--pool-tokens", "512", "--max-num-batched-tokens", "256", "--decode-tokens", "32",
                 "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    per_token = kv_bytes_per_token(shapes.build_random_model("tiny", "bf16", "cpu").model)
    assert r["model"]["kv_bytes_per_token"] == per_token
    pooled, full = ({x["context"]: x for x in r[kind]} for kind in ("pooled", "full"))
    assert sorted(pooled) == sorted(full) == [1024, 2048]
    for n in (1024, 2048):
        p, f = pooled[n], full[n]
        assert p["decode_tokens"] == f["decode_tokens"] == 32 and p["tok_s"] > 0 and p["prefill_s"] > 0
        # the full KV holds the context and what was decoded; the pool at most the room the plan gives a
        # pooled sequence (its tokens, a step's and a chunk's: page-ins in flight use it), whatever the context
        assert (n + 32) * per_token <= f["device_kv_bytes"] <= (n + 34 + BLOCK) * per_token
        assert 512 * per_token <= p["device_kv_bytes"] <= (512 + 256 + 64) * per_token
        # every full block of the pooled sequence is copied to host memory; the unpooled one keeps none there
        assert (n + 32) // BLOCK * BLOCK * per_token <= p["host_kv_bytes"] <= (n + 34 + BLOCK) * per_token
        assert f["host_kv_bytes"] == 0 and p["peak_above_start_bytes"] is None  # CPU: no device allocator
        assert p["vs_full"] == p["tok_s"] / f["tok_s"]
    assert pooled[1024]["vs_shortest"] == 1.0 and pooled[2048]["vs_shortest"] == pooled[2048]["tok_s"] / \
        pooled[1024]["tok_s"]
    # the pooled engine reserves a pool and a prompt chunk of device KV, the full one a whole context
    pool, whole = r["engines"]["pool"], r["engines"]["full"]
    assert pool["device_kv_reserved_bytes"] < (512 + 256 + 64 + 8 * BLOCK) * per_token < 2048 * per_token
    assert whole["device_kv_reserved_bytes"] >= (2048 + 32) * per_token and whole["host_kv_reserved_bytes"] == 0
    assert pool["host_kv_reserved_bytes"] >= (2048 + 32) * per_token
    text = capsys.readouterr().out
    assert "| 2,048 | pool |" in text and "| 2,048 | full |" in text and "random token ids" in text


def test_drafter_rows_with_and_without_the_drafter_pool(tmp_path):
    out = tmp_path / "kv-pool.json"
    assert main(["bench", "kv-pool", "--device", "cpu", "--shape", "tiny", "--contexts", "1024", "--full-contexts",
                 "--pool-tokens", "512", "--decode-tokens", "16", "--draft-pool-tokens", "320", "--draft-contexts",
                 "1024", "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["full"] == [] and "full" not in r["engines"] and [x["context"] for x in r["pooled"]] == [1024]
    rows = {x["kv"]: x for x in r["draft"]}
    assert sorted(rows) == ["drafter full", "drafter pool"]
    for x in rows.values():
        assert x["context"] == 1024 and x["decode_tokens"] >= 16 and x["tau"] >= 1.0  # speculation ran
    assert rows["drafter full"]["vs_drafter_full"] == 1.0
    assert rows["drafter pool"]["vs_drafter_full"] == rows["drafter pool"]["tok_s"] / rows["drafter full"]["tok_s"]


def test_bad_options_are_named(capsys):
    assert main(["bench", "kv-pool", "--device", "cpu", "--shape", "tiny", "--contexts", "1024",
                 "--full-contexts", "2048"]) == 1
    assert "--full-contexts and --draft-contexts must be among --contexts" in capsys.readouterr().err
    assert main(["bench", "kv-pool", "--device", "cpu", "--shape", "tiny", "--contexts", "1024",
                 "--pool-tokens", "100"]) == 1
    assert "kv_pool_tokens must be a multiple of 64" in capsys.readouterr().err
    assert main(["bench", "kv-pool", "--device", "cpu", "--shape", "tiny", "--contexts", "1024",
                 "--draft-contexts", "1024"]) == 1
    assert "--draft-contexts needs --draft-pool-tokens" in capsys.readouterr().err

