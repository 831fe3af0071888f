"""Incremental output parsing: reasoning (<think>, Gemma 4's thought channel), content and tool calls, over any chunking.

The engine hands over text in arbitrary pieces (several tokens per step under speculation, a tag
split over two steps...). `OutputParser.feed(piece)` returns the events that piece completes and
holds back only text that could still be the start of a tag. Feeding the same text in any chunks
yields events that aggregate to the same reasoning, content and calls, so a non-streamed response
(the parser fed everything) equals the reassembled stream.

Tool-call bodies (call_bodies.py): Hermes/Qwen JSON (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and
Qwen3-Coder XML (`<function=NAME><parameter=P>value</parameter></function>`, wrapped in
<tool_call> or bare), recognised by the body's first character whatever the template says; and
Gemma 4's `<|tool_call>call:NAME{key:value}<tool_call|>` (gemma4_tools.py). Where the template
teaches the arg_key format (GLM, Laguna: call_format "glm"), a <tool_call> body that starts with a name
is read as `NAME<arg_key>K</arg_key><arg_value>V</arg_value>` (glm_tools.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .call_bodies import FUNC_OPEN, TOOL_CLOSE, TOOL_OPEN, CallBody, Event, GemmaBody
from .gemma4_tools import CALL_CLOSE as GEMMA_CALL_CLOSE
from .gemma4_tools import CALL_OPEN as GEMMA_CALL_OPEN
from .gemma4_tools import QUOTE as GEMMA_QUOTE
from .glm_tools import TAGS as GLM_TAGS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Reasoning markers: <think>...</think> (Qwen, DeepSeek...) and Gemma 4's thought channel,
# <|channel>thought\n...<channel|> (the newline after it is framing, stripped like "<think>\n").
REASONING_OPENS = (THINK_OPEN, "<|channel>thought")
REASONING_CLOSES = (THINK_CLOSE, "<channel|>")
CALL_OPENS = (TOOL_OPEN, GEMMA_CALL_OPEN)  # what opens a call (banned under tool_choice none)
# The tags the parser reads: where a tokenizer makes one of them special, special tokens stay in the text.
PARSED_TAGS = (*REASONING_OPENS, *REASONING_CLOSES, "<|channel>", TOOL_OPEN, TOOL_CLOSE, GEMMA_CALL_OPEN,
               GEMMA_CALL_CLOSE, GEMMA_QUOTE, *GLM_TAGS)


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
        self._call: CallBody | GemmaBody | None = None

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
                self._call = GemmaBody(self) if tag == GEMMA_CALL_OPEN else CallBody(self, wrapped=tag == TOOL_OPEN)
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
