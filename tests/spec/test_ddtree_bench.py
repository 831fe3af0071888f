"""`lucebox bench spec --tree-budget N`: draft trees measured beside the chain in the same run."""
from __future__ import annotations

import json

from lucebox.cli import main

from tests.spec_fixtures import write_dflash_drafter


def test_bench_spec_reports_trees_beside_the_chain(hf_models, tmp_path):
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "d", block_size=4)
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(target), "--draft", str(drafter), "--tree-budget", "6", "12",
                 "--prompts", "2", "--chars", "200", "--max-tokens", "6", "--repeats", "1", "--no-adaptive",
                 "--temperatures", "0", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"dflash", "dflash+tree6", "dflash+tree12"} <= set(rows)
    for name in ("dflash+tree6", "dflash+tree12"):
        assert rows[name]["tokens"] == 2 * 5 and rows[name]["tau"] >= 1 and rows[name]["steps"]["verify"] > 0
    # the verify cost per node count: the tree rows' sizes (1 + nodes) measured against a plain step
    assert all(float(c) > 0 for c in rows["dflash+tree12"]["verify_cost"].values())
    assert set(map(int, rows["dflash+tree12"]["verify_cost"])) & {1 + 12}
