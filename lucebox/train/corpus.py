"""The default model's corpus: Python source of the packages installed on the training machine
(a large, permissively licensed code corpus available offline), deduplicated, split by file."""
from __future__ import annotations

import ast
import hashlib
import site
import sysconfig
from pathlib import Path

MIN_FILE_BYTES = 200
MAX_FILE_BYTES = 300_000  # larger files are mostly generated tables
MAX_LINE = 500  # minified or data-heavy files teach little code
HELD_OUT_EVERY = 50  # one file in 50, by content hash, is held out


def is_held_out(data: bytes, every: int = HELD_OUT_EVERY) -> bool:
    """The split rule: by content, so the same file is held out on every machine and Python."""
    return int(hashlib.sha1(data).hexdigest()[:8], 16) % every == 0


def usable(data: bytes) -> str | None:
    """The file's text if the corpus keeps files like it (size, no minified lines), else None."""
    if not MIN_FILE_BYTES <= len(data) <= MAX_FILE_BYTES:
        return None
    text = data.decode("utf-8", errors="ignore")
    return text if max(map(len, text.splitlines()), default=0) <= MAX_LINE else None


def python_roots() -> list[Path]:
    roots = {Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                               sysconfig.get_paths()["stdlib"])}
    roots |= {Path(p) for p in site.getsitepackages()}
    return sorted(r for r in roots if r.is_dir())


def collect(max_bytes: int, held_out_every: int = HELD_OUT_EVERY) -> tuple[list[str], list[str], dict]:
    """(train texts, held-out texts, stats). A file is held out by its content hash, so the split is
    reproducible and copies of one file (deduplicated first) never straddle it."""
    seen, train, held = set(), [], []
    stats = {"files_seen": 0, "duplicates": 0, "skipped": 0, "bytes": 0}
    for root in python_roots():
        for path in sorted(root.rglob("*.py")):
            stats["files_seen"] += 1
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if not MIN_FILE_BYTES <= len(data) <= MAX_FILE_BYTES:  # before deduplication: the stats count it as skipped
                stats["skipped"] += 1
                continue
            digest = hashlib.sha1(data).hexdigest()
            if digest in seen:
                stats["duplicates"] += 1
                continue
            seen.add(digest)
            text = usable(data)
            if text is None:
                stats["skipped"] += 1
                continue
            (held if is_held_out(data, held_out_every) else train).append(text)
            stats["bytes"] += len(data)
            if stats["bytes"] >= max_bytes:
                stats.update(train_files=len(train), held_out_files=len(held))
                return train, held, stats
    stats.update(train_files=len(train), held_out_files=len(held))
    return train, held, stats


def function_tasks(texts: list[str], limit: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs for the chat stage: the user gives a function's signature and
    docstring, the assistant writes the whole function."""
    tasks = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.col_offset != 0:
                continue
            doc = ast.get_docstring(node, clean=False)
            body = node.body
            if not doc or len(body) < 2 or node.end_lineno - node.lineno > 40:
                continue
            source = "\n".join(lines[node.lineno - 1:node.end_lineno])
            header = "\n".join(lines[node.lineno - 1:body[0].end_lineno])
            if len(source) > 1500:
                continue
            prompt = f"Complete this Python function:\n```python\n{header}\n```"
            tasks.append((prompt, f"```python\n{source}\n```"))
            if len(tasks) >= limit:
                return tasks
    return tasks
