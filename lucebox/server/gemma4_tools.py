"""Gemma 4's tool calls, read into calls with JSON arguments as the text arrives.

The chat template (format_argument) writes a model's call as
`<|tool_call>call:NAME{key:value,...}<tool_call|>`: keys bare, strings between `<|"|>` marks,
numbers and true/false bare, objects `{key:value}`, arrays `[a,b]`; several calls follow each other.
Models also slip into JSON or Python quoting inside containers ("x", 'x'), so those are strings too,
and a bare value is typed by the tool's JSON schema (a string parameter keeps "1.10" as written).

`GemmaCallBlock` reads the text between `<|tool_call>` and `<tool_call|>` in any chunks and returns
("start", name), ("args", json_text) and ("end", "") items: each member is written once its value is
complete, so the arguments of a call cut off by max_tokens close into valid JSON holding the complete
members, and the same text in any chunks gives the same arguments.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .tool_values import coerce_text, schema_types, strict_json

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"[\s,]*call:([^\s{}\[\]<>:,\"']+)\s*\{")
_BARE_END = re.compile(r"[,}\]]")
_NOT_A_LITERAL = object()
_LITERALS = {"true": True, "True": True, "false": False, "False": False, "null": None, "None": None}


@dataclass
class _Container:
    closer: str  # } or ]
    schema: object
    count: int = 0  # members written
    key: str | None = None  # an object's key waiting for its value

    def child_schema(self):
        if not isinstance(self.schema, dict):
            return {}
        if self.closer == "]":
            return self.schema.get("items", {})
        props = self.schema.get("properties")
        if isinstance(props, dict) and self.key in props:
            return props[self.key]
        extra = self.schema.get("additionalProperties")
        return extra if isinstance(extra, dict) else {}

    def lead(self) -> str:
        """What comes before the next member: a comma after the first, the key in an object."""
        lead = ", " if self.count else ""
        self.count += 1
        if self.closer == "}":
            lead += json.dumps(self.key, ensure_ascii=False) + ": "
        self.key = None
        return lead


class GemmaCallBlock:
    """One `<|tool_call>` block's text. `schemas[tool]` is the tool's parameter properties."""

    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas
        self.text, self.pos = "", 0
        self.stack: list[_Container] = []
        self.calls = 0
        # A value still open at a position, and how much text it had: a long string (a file's content)
        # is searched for its end once, not again from its start on every piece.
        self._open_value = (-1, 0)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.text += text
        out: list[tuple[str, str]] = []
        while self._step(out, final=False):
            pass
        return out

    def close(self, cut_off: bool) -> list[tuple[str, str]]:
        """The block ended: at its end tag (a value ended by it counts), or cut off (a partial value
        is dropped). Whatever is still open is closed."""
        out: list[tuple[str, str]] = []
        while not cut_off and self._step(out, final=True):
            pass
        if self.stack:
            out.append(("args", "".join(c.closer for c in reversed(self.stack))))
            out.append(("end", ""))
            self.stack = []
        return out

    # ------------------------------------------------------------------ reading
    def _step(self, out, final: bool) -> bool:
        """Reads one piece (a call's head, a key, a value, a bracket); False when it needs more text."""
        text = self.text
        if not self.stack:
            m = _HEAD.match(text, self.pos)
            if not m:
                return False  # more text, or not a call (what is left of the block is dropped)
            name = m.group(1)
            out += [("start", name), ("args", "{")]
            self.calls += 1
            self.stack.append(_Container("}", {"properties": self.schemas.get(name) or {}}))
            self.pos = m.end()
            return True
        i = _skip_space(text, self.pos)
        if i == len(text):
            return False
        top, ch = self.stack[-1], text[i]
        if ch in "}]":  # either bracket closes the open container: the arguments stay valid JSON
            self.stack.pop()
            out.append(("args", top.closer))
            if not self.stack:
                out.append(("end", ""))
            self.pos = i + 1
            return True
        if ch == ",":  # also where a value is missing (`a:,`): its key is dropped
            top.key = None
            self.pos = i + 1
            return True
        if top.closer == "}" and top.key is None:
            return self._key(i, final)
        if ch in "{[":
            schema = top.child_schema()
            out.append(("args", top.lead() + ch))
            self.stack.append(_Container("}" if ch == "{" else "]", schema))
            self.pos = i + 1
            return True
        at, searched = self._open_value
        read = _scalar(text, i, final, searched if at == i else 0)
        if read is None:
            self._open_value = (i, len(text))
            return False
        value, quoted, self.pos = read
        typed = _typed(value, quoted, top.child_schema())
        out.append(("args", top.lead() + json.dumps(typed, ensure_ascii=False)))
        return True

    def _key(self, i: int, final: bool) -> bool:
        text, top = self.text, self.stack[-1]
        if text.startswith((QUOTE, '"', "'"), i):
            read = _scalar(text, i, final)
            if read is None:
                return False
            key, _, end = read
        else:
            colon = text.find(":", i)
            stop = _BARE_END.search(text, i)
            if stop and (colon < 0 or stop.start() < colon):  # no key before the next comma or bracket
                self.pos = stop.start()
                return True
            if colon < 0:
                if final:
                    self.pos = len(text)
                return False
            key, end = text[i:colon].strip(), colon
        j = _skip_space(text, end)
        if j == len(text) and not final:
            return False  # the colon may follow
        top.key = str(key)
        self.pos = j + 1 if text.startswith(":", j) else j
        return True


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _scalar(text: str, i: int, final: bool, searched: int = 0):
    """(value, quoted, end) of the string or bare value at i, or None until it is complete. The text
    before `searched` held no end of it."""
    for mark in (QUOTE, '"', "'"):
        if text.startswith(mark, i):
            start = i + len(mark)
            end = _closing(text, start, mark, searched)
            if end < 0:
                return (text[start:], True, len(text)) if final else None
            raw = text[start:end]
            if mark == '"':
                try:
                    raw = json.loads('"' + raw + '"')
                except ValueError:
                    pass
            return raw, True, end + len(mark)
    if len(text) - i < len(QUOTE) and QUOTE.startswith(text[i:]) and not final:
        return None  # maybe the start of a <|"|> string
    stop = _BARE_END.search(text, max(i, searched))
    if stop is None:
        return (text[i:].strip(), False, len(text)) if final else None
    return text[i:stop.start()].strip(), False, stop.start()


def _closing(text: str, start: int, mark: str, searched: int) -> int:
    if mark != '"':  # a mark that ended before `searched` would have been found then
        return text.find(mark, max(start, searched - len(mark) + 1))
    escaped = False
    for j in range(start, len(text)):
        if escaped:
            escaped = False
        elif text[j] == "\\":
            escaped = True
        elif text[j] == '"':
            return j
    return -1


def _typed(value: str, quoted: bool, schema):
    """A value as the schema types it: a quoted string for a non-string parameter is read as the XML
    format's text is; a bare value is the literal it spells unless the schema wants a string."""
    kinds = schema_types(schema)
    if quoted:
        return value if not kinds or "string" in kinds else coerce_text(value, schema)
    literal = _literal(value)
    if literal is _NOT_A_LITERAL:
        return value
    if "string" in kinds and not kinds & _kinds_of(literal):
        return value
    return literal


def _literal(text: str):
    if text in _LITERALS:
        return _LITERALS[text]
    try:
        value = strict_json(text)
    except ValueError:
        return _NOT_A_LITERAL
    return value if isinstance(value, (int, float)) else _NOT_A_LITERAL


def _kinds_of(value) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if value is None:
        return {"null"}
    return {"integer", "number"} if isinstance(value, int) else {"number"}
