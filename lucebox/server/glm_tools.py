"""Tool calls in the arg_key / arg_value format (GLM 4.5+, Poolside Laguna), read as the text arrives.

The chat templates write a model's call as
`<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`: one call per
block, string values raw and every other value as JSON (Laguna S 2.1 writes the same tags without
the newlines). The tool's JSON schema says which a value is: a string parameter keeps "3" as
written, an integer one reads 3; a parameter the schema does not type is JSON where the text is a
JSON number, boolean, null, object or array, else text.

`GlmCallBlock` reads the text between `<tool_call>` and `</tool_call>` in any chunks and returns
("start", name), ("args", json_text) and ("end", "") items, the protocol of gemma4_tools: a member is
written once its `</arg_value>` arrives, so a call cut off by max_tokens closes into valid JSON of its
complete members, and the same text in any chunks gives the same arguments.
"""
from __future__ import annotations

import json
import re

from ..errors import LuceboxError
from ..text.chat_template import render_chat_template
from .tool_values import coerce_text, schema_types, strict_json

KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
TAGS = (KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)
_TAUGHT = re.compile(r"</think>(\s*)<tool_call>first_tool.*?</tool_call>(\s*)<tool_call>second_tool", re.S)


class GlmCallBlock:
    """One `<tool_call>` block's text. `schemas[tool]` is the tool's parameter properties."""

    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas
        self.text, self.pos = "", 0
        self.name: str | None = None  # set once the name is complete
        self.calls = 0
        self.invalid = False  # the text after <tool_call> is no call: it goes back as text
        self.members = 0
        self.key: str | None = None  # a key waiting for its value
        # Where the search for a value's end may resume: a long value (a file's content) is not
        # searched again from its start on every piece.
        self._searched = 0

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.text += text
        out: list[tuple[str, str]] = []
        while not self.invalid and self._step(out, final=False):
            pass
        return out

    def close(self, cut_off: bool) -> list[tuple[str, str]]:
        """The block ended: at </tool_call> (a value ended by it counts), or cut off (a partial name,
        key or value is dropped)."""
        out: list[tuple[str, str]] = []
        while not cut_off and not self.invalid and self._step(out, final=True):
            pass
        if self.name is not None:
            out += [("args", "}"), ("end", "")]
        return out

    # ------------------------------------------------------------------ reading
    def _step(self, out, final: bool) -> bool:
        """Reads one piece (the name, a key, a value); False when it needs more text."""
        if self.name is None:
            return self._name(out, final)
        text = self.text
        i = _skip_space(text, self.pos)
        if i == len(text):
            return False
        opening = VALUE_OPEN if self.key is not None else KEY_OPEN
        if not text.startswith(opening, i):
            if opening.startswith(text[i:]) and not final:
                return False  # the tag may be arriving
            return self._skip_to_key(i, final)
        start = i + len(opening)
        closing = VALUE_CLOSE if self.key is not None else KEY_CLOSE
        end = text.find(closing, max(start, self._searched - len(closing) + 1))
        if end < 0:
            if not final:
                self._searched = len(text)
                return False
            end = len(text)  # </tool_call> ended the value: what it holds counts
        self._searched = 0
        self.pos = min(len(text), end + len(closing))
        raw = text[start:end]
        if self.key is None:
            self.key = raw.strip()
            return True
        schema = self.schemas.get(self.name, {}).get(self.key)
        lead = ", " if self.members else ""
        self.members += 1
        out.append(("args", lead + json.dumps(self.key, ensure_ascii=False) + ": "
                    + json.dumps(typed_value(raw, schema), ensure_ascii=False)))
        self.key = None
        return True

    def _name(self, out, final: bool) -> bool:
        i = _skip_space(self.text, 0)
        ends = [p for p in (self.text.find("\n", i), self.text.find("<", i)) if p >= 0]
        if not ends and not final:
            return False
        end = min(ends) if ends else len(self.text)
        name = self.text[i:end].strip()
        if not name or any(c.isspace() or c in "{}<>\"'" for c in name):
            self.invalid = True  # prose or JSON after <tool_call>: not this format's call
            return False
        self.name, self.pos, self.calls = name, end, 1
        out += [("start", name), ("args", "{")]
        return True

    def _skip_to_key(self, i: int, final: bool) -> bool:
        """Text that is no tag where a tag belongs (a stray word): read on from the next key; a key
        left without its value is dropped."""
        nxt = self.text.find(KEY_OPEN, i)
        if nxt < 0:
            if final:
                self.pos = len(self.text)
            return False
        self.pos, self.key = nxt, None
        return True


def typed_value(raw: str, schema) -> object:
    """A value as the templates write it, typed by the parameter's schema."""
    if isinstance(schema, dict):  # constrained decoding lets an enum's string stand between spaces
        choices = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema.get("const")]
        if raw not in choices and raw.strip() in choices:
            return raw.strip()
    kinds = schema_types(schema)
    if kinds:
        return coerce_text(raw, schema)
    try:
        value = strict_json(raw)
    except ValueError:
        return raw
    return raw if isinstance(value, str) else value  # a string is written raw, never as a JSON literal


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def taught_spacing(chat_templates: dict[str, str]) -> tuple[str, str] | None:
    """What a template of this format writes between </think> and a call, and between two calls
    (Laguna XS.2: newlines; Laguna S 2.1: nothing), read off an assistant turn it renders; None
    where no template of the model renders one."""
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}} for name in ("first_tool", "second_tool")]
    turn = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": calls}]
    for source in chat_templates.values():
        if KEY_OPEN not in source:
            continue
        try:
            text = render_chat_template(source, turn, add_generation_prompt=False, enable_thinking=True)
        except LuceboxError:
            continue
        if m := _TAUGHT.search(text):
            return m.group(1), m.group(2)
    return None
