"""qualify's own judgement: where a client shows the scripted reasoning, and the results table."""
from __future__ import annotations

import json

from lucebox.agents.qualify import (
    ANSWER,
    REASONING,
    Result,
    client_records,
    reasoning_seen,
    table,
    tool_call,
)


def _lines(*objects) -> str:
    return "\n".join(json.dumps(o) for o in objects)


def test_reasoning_shown_as_reasoning_passes():
    out = _lines({"type": "item.completed", "item": {"type": "reasoning", "text": f"{REASONING}: yes"}},
                 {"type": "item.completed", "item": {"type": "agent_message", "text": f"{ANSWER}."}})
    assert reasoning_seen(client_records(out, None)) == (True, "as 'reasoning'")


def test_reasoning_inside_the_answer_fails():
    out = _lines({"type": "reasoning", "text": REASONING},
                 {"type": "text", "text": f"<think>{REASONING}</think>{ANSWER}"})
    ok, detail = reasoning_seen(client_records(out, None))
    assert not ok and "leaked" in detail


def test_reasoning_missing_fails():
    ok, detail = reasoning_seen(client_records(_lines({"type": "text", "text": ANSWER}), None))
    assert not ok and "nothing" in detail


def test_session_files_in_the_clients_home_count(tmp_path):
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "rollout.jsonl").write_text(_lines(
        {"type": "response_item", "payload": {"type": "reasoning", "content": [
            {"type": "reasoning_text", "text": REASONING}]}}))
    assert reasoning_seen(client_records("", tmp_path))[0]


def test_tool_call_is_the_templates_hermes_format():
    assert tool_call("bash", {"command": "ls"}) == '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


def test_table_marks_missing_checks_skipped():
    r = Result("codex", seconds=12.4)
    r.mark("tool round trip", True)
    r.mark("streaming", False, "no")
    assert not r.passed
    assert table([r], short=True).splitlines()[-1] == "| codex | PASS | FAIL | SKIP | 12 s |"


def test_a_sqlite_session_database_counts_by_column(tmp_path):
    import sqlite3
    db = sqlite3.connect(tmp_path / "state.db")  # hermes keeps its sessions so: reasoning beside content
    db.execute("CREATE TABLE messages (role TEXT, content TEXT, reasoning TEXT)")
    db.execute("INSERT INTO messages VALUES ('assistant', ?, ?)", (f"{ANSWER}.", f"{REASONING}: yes"))
    db.commit()
    db.close()
    assert reasoning_seen(client_records("", tmp_path)) == (True, "as 'reasoning'")
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("UPDATE messages SET content = ?", (f"<think>{REASONING}</think>{ANSWER}",))
    db.commit()
    db.close()
    assert not reasoning_seen(client_records("", tmp_path))[0]


def test_json_documents_in_a_sqlite_column_count_by_their_own_types(tmp_path):
    import json
    import sqlite3
    db = sqlite3.connect(tmp_path / "opencode.db")  # opencode keeps each message part as JSON in `data`
    db.execute("CREATE TABLE part (id TEXT, data TEXT)")
    db.execute("INSERT INTO part VALUES ('1', ?)", (json.dumps({"type": "reasoning", "text": f"{REASONING}: yes"}),))
    db.execute("INSERT INTO part VALUES ('2', ?)", (json.dumps({"type": "text", "text": f"{ANSWER}."}),))
    db.commit()
    db.close()
    assert reasoning_seen(client_records("", tmp_path)) == (True, "as 'reasoning'")
