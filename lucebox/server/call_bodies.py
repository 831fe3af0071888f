"""The body of one tool-call block, parsed as it grows (server/parsing.py's OutputParser opens one per
block): Hermes/Qwen JSON or Qwen3-Coder XML inside <tool_call> (or a bare <function=...> block), GLM's
arg_key format where the template teaches it (glm_tools.py), Gemma 4's <|tool_call> blocks
(gemma4_tools.py); each turns the block's text into the parser's events.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .gemma4_tools import CALL_CLOSE as GEMMA_CALL_CLOSE
from .gemma4_tools import CALL_OPEN as GEMMA_CALL_OPEN
from .gemma4_tools import GemmaCallBlock
from .glm_tools import GlmCallBlock
from .tool_values import coerce_text

if TYPE_CHECKING:
    from .parsing import OutputParser

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
# name first, then arguments: the lookahead waits for the value's first character, so whitespace
# before it never depends on where a chunk ended.
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])')
_FUNC_HEAD = re.compile(r"\s*<function=([^>\n]+)>")


@dataclass
class Event:
    kind: str  # content | reasoning | tool_start | tool_args | tool_end
    text: str = ""
    call: int = -1  # tool-call index within this output
    name: str = ""


class CallBody:
    """The text inside one <tool_call> block (or one bare <function=...> block), parsed as it grows."""

    def __init__(self, parser: OutputParser, wrapped: bool):
        self.parser, self.wrapped = parser, wrapped
        self.end_tag = TOOL_CLOSE if wrapped else FUNC_CLOSE
        self.keeps_end_tag = not wrapped  # a bare block's </function> is part of the XML it parses
        self.body = ""
        self.style: str | None = None  # json | xml | glm
        self.glm: GlmCallBlock | None = None
        self.index: int | None = None  # the open call's index
        self.opened: list[int] = []
        self.pos = 0  # how far the body has been consumed
        # json streaming state
        self.depth, self.in_str, self.esc, self.done = 0, False, False, False
        # xml state
        self.name = ""
        self.num_params = 0
        self.cut_off = False  # the output ended inside the block: the model never wrote its end tag

    def extend(self, text: str, out: list[Event]) -> None:
        self.body += text
        if self.style is None:
            head = self.body.lstrip()
            if not head:
                return
            if head.startswith("<"):
                self.style = "xml"
            elif head.startswith("{") or not self.parser.glm_calls:
                self.style = "json"
            else:  # NAME<arg_key>...: the whole body so far goes to the block reader
                self.style, self.glm, text = "glm", GlmCallBlock(self.parser.param_schemas), self.body
        if self.style == "glm":
            self.index = block_events(self.parser, self.glm.feed(text), out, self.index)
        elif self.style == "json":
            self._json_progress(out)
        else:
            self._xml_progress(out, final=False)

    # ---------------------------------------------------------------- Hermes JSON
    def _json_progress(self, out: list[Event]) -> None:
        if self.index is None:
            m = _JSON_HEAD.match(self.body)
            if not m:
                return
            try:
                name = json.loads('"' + m.group(1) + '"')
            except json.JSONDecodeError:
                return
            self.index = self.parser._new_call(name, out)
            self.opened.append(self.index)
            self.pos = m.end()
        start, i = self.pos, self.pos
        while i < len(self.body) and not self.done:
            c = self.body[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
            i += 1
        if i > start:
            out.append(Event("tool_args", self.body[start:i], call=self.index))
        self.pos = i

    def _json_close(self, out: list[Event]) -> None:
        if self.index is not None:
            return
        try:
            obj = json.loads(self.body)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            self._as_text(out)
            return
        self.index = self.parser._new_call(name, out)
        self.opened.append(self.index)
        out.append(Event("tool_args", args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                         call=self.index))

    # ---------------------------------------------------------------- Qwen3-Coder XML
    def _xml_progress(self, out: list[Event], final: bool) -> None:
        while True:
            if self.index is None:
                m = _FUNC_HEAD.match(self.body, self.pos)
                if not m:
                    return
                self.name = m.group(1).strip()
                self.index = self.parser._new_call(self.name, out)
                self.opened.append(self.index)
                self.num_params, self.pos = 0, m.end()
                continue
            rest = self.body[self.pos:]
            lead = len(rest) - len(rest.lstrip())
            rest = rest[lead:]
            if rest.startswith(FUNC_CLOSE):
                self._xml_end_function(out)
                self.pos += lead + len(FUNC_CLOSE)
                continue
            if not rest.startswith(PARAM_OPEN):
                return
            gt = rest.find(">")
            if gt < 0:
                return
            pname = rest[len(PARAM_OPEN):gt].strip()
            value_from = gt + 1
            ends = [(p, t) for t in (PARAM_CLOSE, PARAM_OPEN, FUNC_CLOSE) if (p := rest.find(t, value_from)) >= 0]
            if ends:
                end, tag = min(ends)
            elif final:
                end, tag = len(rest), ""
            else:
                return
            self._xml_param(pname, rest[value_from:end], out)
            self.pos += lead + end + (len(PARAM_CLOSE) if tag == PARAM_CLOSE else 0)

    def _xml_param(self, pname: str, raw: str, out: list[Event]) -> None:
        # The template writes "<parameter=p>\nvalue\n</parameter>": one newline each side is framing.
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        schema = self.parser.param_schemas.get(self.name, {}).get(pname)
        value = coerce_text(raw, schema)
        sep = "{" if self.num_params == 0 else ", "
        self.num_params += 1
        out.append(Event("tool_args", sep + json.dumps(pname, ensure_ascii=False) + ": "
                         + json.dumps(value, ensure_ascii=False), call=self.index))

    def _xml_end_function(self, out: list[Event]) -> None:
        out.append(Event("tool_args", "{}" if self.num_params == 0 else "}", call=self.index))
        out.append(Event("tool_end", call=self.index))
        self.index = None

    # ---------------------------------------------------------------- end of block
    def close(self, out: list[Event]) -> None:
        if self.style == "glm":
            self.index = block_events(self.parser, self.glm.close(self.cut_off), out, self.index)
            if not self.glm.calls:
                self._as_text(out)
            return
        if self.style == "xml":
            self._xml_progress(out, final=True)
            if self.index is not None:
                self._xml_end_function(out)
            if not self.opened:
                self._as_text(out)
            return
        if self.style == "json":
            self._json_close(out)
        if self.index is not None:
            out.append(Event("tool_end", call=self.index))
            self.index = None

    def _as_text(self, out: list[Event]) -> None:
        # Not a call after all: give the text back rather than lose it -- unless the output was cut
        # off before the call's name, when it is neither text the model meant nor a call.
        if self.cut_off:
            return
        raw = (TOOL_OPEN + self.body + TOOL_CLOSE) if self.wrapped else self.body
        self.parser.content_seen = True
        out.append(Event("content", raw))


class GemmaBody:
    """One <|tool_call> block of Gemma 4: its calls as events."""
    end_tag, keeps_end_tag = GEMMA_CALL_CLOSE, False

    def __init__(self, parser: OutputParser):
        self.parser, self.block = parser, GemmaCallBlock(parser.param_schemas)
        self.index = -1
        self.cut_off = False

    def extend(self, text: str, out: list[Event]) -> None:
        self.index = block_events(self.parser, self.block.feed(text), out, self.index)

    def close(self, out: list[Event]) -> None:
        self.index = block_events(self.parser, self.block.close(self.cut_off), out, self.index)
        if not self.block.calls and not self.cut_off:  # not a call after all: the text as written
            self.parser.content_seen = True
            out.append(Event("content", GEMMA_CALL_OPEN + self.block.text + GEMMA_CALL_CLOSE))


def block_events(parser: OutputParser, items: list[tuple[str, str]], out: list[Event], index) -> int:
    """A block reader's ("start" | "args" | "end", text) items as events; returns the open call's index."""
    for kind, text in items:
        if kind == "start":
            index = parser._new_call(text, out)
        elif kind == "args":
            out.append(Event("tool_args", text, call=index))
        else:
            out.append(Event("tool_end", call=index))
    return index
