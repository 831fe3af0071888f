"""Incremental output parsing: reasoning (<think>, Gemma 4's thought channel), content and tool calls, over any chunking.

The engine hands over text in arbitrary pieces (several tokens per step under speculation, a tag
split over two steps...). `OutputParser.feed(piece)` returns the events that piece completes and
holds back only text that could still be the start of a tag. Feeding the same text in any chunks
yields events that aggregate to the same reasoning, content and calls, so a non-streamed response
(the parser fed everything) equals the reassembled stream.

Tool-call bodies: Hermes/Qwen JSON (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and
Qwen3-Coder XML (`<function=NAME><parameter=P>value</parameter></function>`, wrapped in
<tool_call> or bare), recognised by the body's first character whatever the template says; and
Gemma 4's `<|tool_call>call:NAME{key:value}<tool_call|>` (gemma4_tools.py). Where the template
teaches the arg_key format (GLM, Laguna: call_format "glm"), a <tool_call> body that starts with a name
is read as `NAME<arg_key>K</arg_key><arg_value>V</arg_value>` (glm_tools.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .gemma4_tools import CALL_CLOSE as GEMMA_CALL_CLOSE
from .gemma4_tools import CALL_OPEN as GEMMA_CALL_OPEN
from .gemma4_tools import QUOTE as GEMMA_QUOTE
from .gemma4_tools import GemmaCallBlock
from .glm_tools import TAGS as GLM_TAGS
from .glm_tools import GlmCallBlock
from .tool_values import coerce_text

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Reasoning markers: <think>...</think> (Qwen, DeepSeek...) and Gemma 4's thought channel,
# <|channel>thought\n...<channel|> (the newline after it is framing, stripped like "<think>\n").
REASONING_OPENS = (THINK_OPEN, "<|channel>thought")
REASONING_CLOSES = (THINK_CLOSE, "<channel|>")
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
CALL_OPENS = (TOOL_OPEN, GEMMA_CALL_OPEN)  # what opens a call (banned under tool_choice none)
# The tags the parser reads: where a tokenizer makes one of them special, special tokens stay in the text.
PARSED_TAGS = (*REASONING_OPENS, *REASONING_CLOSES, "<|channel>", TOOL_OPEN, TOOL_CLOSE, GEMMA_CALL_OPEN,
               GEMMA_CALL_CLOSE, GEMMA_QUOTE, *GLM_TAGS)
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


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an opened reasoning section (the output starts there)."""
    return prompt.rstrip().endswith(REASONING_OPENS)


def closes_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends by closing reasoning itself (Laguna with thinking off writes
    `</think>`): the output starts in content, and its leading newline is framing."""
    return prompt.rstrip().endswith(REASONING_CLOSES)


def _held_prefix(text: str, tags) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


class OutputParser:
    """One per generated output. `param_schemas[tool][param]` coerces XML parameter strings;
    `call_format` is the template's (tools.tool_format)."""

    def __init__(self, *, tools: bool = True, reasoning: bool = True, in_reasoning: bool = False,
                 param_schemas: dict[str, dict[str, dict]] | None = None, call_format: str = "hermes",
                 after_reasoning: bool = False):
        self.tools, self.reasoning = tools, reasoning
        self.glm_calls = call_format == "glm"
        self.param_schemas = param_schemas or {}
        self.mode = "reasoning" if in_reasoning else "content"
        self.buf = ""
        # leading whitespace of a section is not part of it
        self.strip_lead = in_reasoning or after_reasoning
        self.num_calls = 0
        self.content_seen = False
        self._call: _CallBody | None = None

    # ------------------------------------------------------------------ public
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        return out

    # ------------------------------------------------------------------ modes
    def _step(self, out: list[Event], final: bool) -> bool:
        if self.mode == "tool":
            return self._tool_step(out, final)
        if self.mode == "reasoning":
            tags = list(REASONING_CLOSES)
        else:
            tags = (list(REASONING_OPENS) if self.reasoning else []) + \
                ([TOOL_OPEN, FUNC_OPEN, GEMMA_CALL_OPEN] if self.tools else [])
        found = [(self.buf.find(t), t) for t in tags]
        found = [(p, t) for p, t in found if p >= 0]
        if found:
            pos, tag = min(found)
            self._text(out, self.buf[:pos].rstrip())
            self.buf = self.buf[pos:] if tag == FUNC_OPEN else self.buf[pos + len(tag):]
            if tag in REASONING_CLOSES:
                self.mode = "content"
            elif tag in REASONING_OPENS:
                self.mode = "reasoning"
            else:
                self.mode = "tool"
                self._call = _GemmaBody(self) if tag == GEMMA_CALL_OPEN else _CallBody(self, wrapped=tag == TOOL_OPEN)
            self.strip_lead = True
            return True
        if final:
            self._text(out, self.buf.rstrip())
            self.buf = ""
            return False
        hold = _held_prefix(self.buf, tags) if tags else 0
        # Trailing whitespace waits too: before a tag or at the end it is dropped.
        upto = len(self.buf[:len(self.buf) - hold].rstrip())
        self._text(out, self.buf[:upto])
        self.buf = self.buf[upto:]
        return False

    def _text(self, out: list[Event], text: str) -> None:
        # A section's leading whitespace is framing ("</think>\n\n"), except between two pieces of
        # content, where it separates them.
        if self.strip_lead and not (self.mode == "content" and self.content_seen):
            text = text.lstrip()
        if text:
            self.strip_lead = False
            self.content_seen |= self.mode == "content"
            out.append(Event(self.mode, text))

    def _tool_step(self, out: list[Event], final: bool) -> bool:
        call = self._call
        end_tag = call.end_tag
        pos = self.buf.find(end_tag)
        if pos >= 0:
            cut = pos + len(end_tag)
            call.extend(self.buf[:cut] if call.keeps_end_tag else self.buf[:pos], out)
            self.buf = self.buf[cut:]
        elif final:
            call.extend(self.buf, out)
            self.buf = ""
            call.cut_off = True
        else:
            hold = _held_prefix(self.buf, [end_tag])
            call.extend(self.buf[:len(self.buf) - hold], out)
            self.buf = self.buf[len(self.buf) - hold:]
            return False
        call.close(out)
        self._call, self.mode, self.strip_lead = None, "content", True
        return pos >= 0

    def _new_call(self, name: str, out: list[Event]) -> int:
        index = self.num_calls
        self.num_calls += 1
        out.append(Event("tool_start", call=index, name=name))
        return index


class _CallBody:
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
            self.index = _block_events(self.parser, self.glm.feed(text), out, self.index)
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
            self.index = _block_events(self.parser, self.glm.close(self.cut_off), out, self.index)
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


class _GemmaBody:
    """One <|tool_call> block of Gemma 4: its calls as events."""
    end_tag, keeps_end_tag = GEMMA_CALL_CLOSE, False

    def __init__(self, parser: OutputParser):
        self.parser, self.block = parser, GemmaCallBlock(parser.param_schemas)
        self.index = -1
        self.cut_off = False

    def extend(self, text: str, out: list[Event]) -> None:
        self.index = _block_events(self.parser, self.block.feed(text), out, self.index)

    def close(self, out: list[Event]) -> None:
        self.index = _block_events(self.parser, self.block.close(self.cut_off), out, self.index)
        if not self.block.calls and not self.cut_off:  # not a call after all: the text as written
            self.parser.content_seen = True
            out.append(Event("content", GEMMA_CALL_OPEN + self.block.text + GEMMA_CALL_CLOSE))


def _block_events(parser: OutputParser, items: list[tuple[str, str]], out: list[Event], index) -> int:
    """A block reader's ("start" | "args" | "end", text) items as events; returns the open call's index."""
    for kind, text in items:
        if kind == "start":
            index = parser._new_call(text, out)
        elif kind == "args":
            out.append(Event("tool_args", text, call=index))
        else:
            out.append(Event("tool_end", call=index))
    return index


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    calls: list = None  # [[name, arguments]]

    @classmethod
    def of(cls, events: list[Event]) -> ParsedOutput:
        p = cls(calls=[])
        for e in events:
            if e.kind == "content":
                p.content += e.text
            elif e.kind == "reasoning":
                p.reasoning += e.text
            elif e.kind == "tool_start":
                p.calls.append([e.name, ""])
            elif e.kind == "tool_args":
                p.calls[e.call][1] += e.text
        return p
