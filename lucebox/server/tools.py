"""Tools across the three APIs: one ToolSpec shape, the template's tool list, call ids, and which
native call format (Hermes JSON, Qwen3-Coder XML, Gemma 4's or GLM / Laguna's arg_key tags) the
model's chat template teaches."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .errors import APIError

EMPTY_SCHEMA = {"type": "object", "properties": {}}
# A freeform (Responses "custom") tool is offered to the model as a function of one string.
CUSTOM_SCHEMA = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


@dataclass
class ToolSpec:
    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: dict(EMPTY_SCHEMA))
    custom: bool = False  # answered with custom_tool_call items carrying the raw "input" string


def check_tools(specs: list[ToolSpec], param: str) -> list[ToolSpec]:
    seen = set()
    for i, t in enumerate(specs):
        if not t.name:
            raise APIError(400, f"{param}[{i}] has no name", param=f"{param}[{i}]")
        if t.name in seen:
            raise APIError(400, f"{param}: the tool name {t.name!r} is declared twice", param=param)
        if not isinstance(t.parameters, dict):
            raise APIError(400, f"{param}[{i}]: the parameters schema must be a JSON object", param=f"{param}[{i}]")
        seen.add(t.name)
    return specs


def template_tools(specs: list[ToolSpec]) -> list[dict] | None:
    """The tools as chat templates expect them (OpenAI function shape)."""
    if not specs:
        return None
    out = []
    for t in specs:
        fn = {"name": t.name, "parameters": t.parameters}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def tool_format(chat_templates: dict[str, str]) -> str:
    """'gemma4' when the template teaches Gemma 4's <|tool_call>call:NAME{...} calls, 'glm' for
    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value> (GLM 4.5+, Laguna), 'xml' for
    Qwen3-Coder's <function=...> calls, else 'hermes' JSON."""
    text = " ".join(chat_templates.values())
    if "<|tool_call>call:" in text:
        return "gemma4"
    if "<arg_key>" in text:
        return "glm"
    return "xml" if "<function=" in text else "hermes"


def param_schemas(specs: list[ToolSpec]) -> dict[str, dict[str, dict]]:
    return {t.name: dict((t.parameters or {}).get("properties") or {}) for t in specs}


def call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def arguments_object(arguments) -> dict | str:
    """Arguments for a template: templates write dicts with |tojson; unparseable text stays as is."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return {} if arguments is None else arguments


def assistant_tool_call(name: str, arguments, id_: str | None = None) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": arguments_object(arguments)}}
    if id_:
        call["id"] = id_
    return call


def parse_arguments(text: str) -> dict:
    """A call's arguments as an object (Anthropic's tool_use.input). Arguments cut off by max_tokens
    keep the members that were complete (what Anthropic returns for a truncated tool_use); text that
    is no JSON object at all gives {}."""
    value = _loads(text) if text.strip() else {}
    if value is None:
        value = _complete_prefix(text)
    if isinstance(value, dict):
        return value
    return {} if value is None else {"value": value}


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _complete_prefix(text: str) -> dict | None:
    """The longest prefix of a truncated JSON object that parses once its open brackets are closed."""
    stack, in_str, esc, cuts = [], False, False, []
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if stack and stack[-1] == "]":
                    cuts.append((i + 1, "".join(reversed(stack))))  # a complete string element
            continue
        if c == '"':
            in_str = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
            cuts.append((i + 1, "".join(reversed(stack))))
        elif c == "," and stack:
            cuts.append((i, "".join(reversed(stack))))  # everything before this comma was complete
    for end, closers in reversed(cuts):
        value = _loads(text[:end] + closers)
        if isinstance(value, dict):
            return value
    return None
