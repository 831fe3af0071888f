"""Chat templates: jinja2 in a sandbox, set up like transformers so prompts render identically.

Chat templates ship inside checkpoints (tokenizer_config.json, chat_template.jinja, GGUF metadata), so
they are untrusted code: a GGUF template once gave code execution through an unsandboxed jinja2
(CVE-2024-34359). Rendering therefore runs in jinja2's ImmutableSandboxedEnvironment, with the
extra hardening transformers adds (no dunder names in namespaces, a `dict` without class access,
inputs rebuilt from plain JSON types). Renders are bounded in time and size (template_sandbox.py), and
templates sent in requests are off unless the server allows them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from ..errors import RequestError
from .template_sandbox import BoundedSandbox, RenderBudget, TemplateBudgetError, bounded, weight

# Names a message's reasoning may come under; templates read the first one (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Real chat templates are a few KB (the largest known ones ~40 KB).
MAX_REQUEST_TEMPLATE_BYTES = 128 << 10
MAX_TOJSON_INDENT = 64


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt text.
    if isinstance(indent, int) and indent > MAX_TOJSON_INDENT or isinstance(indent, str) and len(indent) > MAX_TOJSON_INDENT:
        raise TemplateBudgetError(f"tojson indent is limited to {MAX_TOJSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (no `dict.__class__` tricks)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore-prefixed names, which could shadow CPython internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace: `namespace(self=1)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed names on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text; raises RequestError on a syntax error."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"the chat template does not compile: {e.message} (template line {e.lineno})") from e


def _plain(value: Any) -> Any:
    """Rebuild template inputs from JSON types only.

    Rich objects (pydantic models, enums, numpy scalars, images) carry methods the sandbox does not know
    to be dangerous; templates only need their data.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[Any]) -> list[dict]:
    out = []
    for i, message in enumerate(_plain(list(messages))):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object with a role and content, got {message!r}")
        # APIs send `content: null` / `tool_calls: null`; many templates render "None" for those but
        # handle a missing key, so (like transformers) drop the keys whose value is None.
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    source: str,
    messages: Sequence[Any],
    *,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `source` the way transformers' `apply_chat_template(..., tokenize=False)` does.

    `special_tokens` (bos_token, eos_token, ...) are template variables; `template_kwargs` override them.
    Any failure inside the template (raise_exception, sandbox violation, bad message shape) is a RequestError.
    """
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping) and not callable(getattr(tool, "model_dump", None)):
                raise RequestError(f"tools[{i}] must be a JSON schema object, got {type(tool).__name__}")
    template = compile_chat_template(source)
    inputs = dict(
        messages=_normalize_messages(messages),
        tools=_plain(list(tools)) if tools is not None else None,
        documents=_plain(list(documents)) if documents is not None else None,
        **_plain({**(special_tokens or {}), **template_kwargs}),
    )
    try:
        with bounded(RenderBudget.for_inputs(weight(inputs, 1 << 40))):
            return template.render(add_generation_prompt=add_generation_prompt, **inputs)
    except TemplateBudgetError as e:
        raise RequestError(f"chat template error: {e}") from None
    except RecursionError:
        raise RequestError("chat template error: it recurses too deeply") from None
    except jinja2.TemplateError as e:
        raise RequestError(f"chat template error: {e.message or e}") from e
    except Exception as e:  # a template is a program: TypeError, KeyError... all mean it rejected the input
        raise RequestError(f"chat template error: {type(e).__name__}: {e}") from e


def check_request_template(template_kwargs: Mapping[str, Any], model_templates: Mapping[str, str],
                           allow_custom: bool) -> None:
    """A request may pick one of the model's templates by name; its own template text is code from the
    network, rendered only where the server allows it (--allow-request-chat-template) and small."""
    template = template_kwargs.get("chat_template")
    if template is None or (isinstance(template, str) and template in model_templates):
        return
    if not isinstance(template, str):
        raise RequestError("chat_template_kwargs.chat_template must be a string: a template name or its text")
    if not allow_custom:
        names = ", ".join(sorted(model_templates)) or "none"
        raise RequestError("chat_template_kwargs.chat_template: this server does not render chat templates sent "
                           "in requests (start it with --allow-request-chat-template to allow them); the model's "
                           f"templates, which a request may name: {names}")
    if len(template.encode("utf-8", "surrogatepass")) > MAX_REQUEST_TEMPLATE_BYTES:
        raise RequestError(f"chat_template_kwargs.chat_template is over the {MAX_REQUEST_TEMPLATE_BYTES}-byte limit "
                           "for templates sent in requests")
