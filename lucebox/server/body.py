"""Request bodies: JSON read with limits that cannot be beaten by the input's shape, then validated
into a protocol model, every failure a 400 naming the field.

json.loads and everything after it (pydantic, the chat template, json.dumps of echoed fields) recurse
once per nesting level, so the depth is measured first by a scan that does not recurse. Lone UTF-16
surrogates (`"\\ud800"`) are valid JSON escapes but no valid text: they would fail later, at encoding."""
from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from .errors import APIError

MAX_JSON_DEPTH = 64  # deep enough for any real tool schema; a client's bug or an attack beyond it
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_OPEN, _CLOSE = np.zeros(256, np.int8), np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE[[ord("]"), ord("}")]] = 1


def json_depth(raw: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text, brackets inside strings ignored (no recursion)."""
    outside = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
    if not outside.size:
        return 0
    steps = _OPEN[outside].astype(np.int64) - _CLOSE[outside]
    return int(np.cumsum(steps).max())


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def read_json(raw: bytes) -> dict:
    """The body as a JSON object; anything else is a 400 saying what is wrong."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests JSON {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
    try:
        data = json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        _check_text(data)
    return data


def _check_text(data: Any) -> None:
    """400 at the first string (key or value) holding a lone surrogate; iterative, depth is bounded anyway."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            _encodable(value, where)
        elif isinstance(value, dict):
            for k, v in value.items():
                _encodable(k, where or "body")
                stack.append((v, f"{where}.{k}" if where else k))
        elif isinstance(value, list):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(value))


def _encodable(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{where}: the text holds a lone UTF-16 surrogate ({text[e.start]!r}), which is not "
                            f"a character", param=where) from e


def validate(model: type[BaseModel], data: dict, context: dict | None = None):
    """`data` as `model`; the first failure (the most specific one) is a 400 naming its field."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise validation_error(e) from e


def validation_error(e: ValidationError) -> APIError:
    errors = [(field_path(err["loc"]), err) for err in e.errors(include_url=False)]
    # A union reports one error per member: a wrong value (out of range, unknown token) says more than
    # a wrong type, and among wrong types the deepest names the field that is really wrong.
    where, first = max(errors, key=lambda pe: (not _type_mismatch(pe[1]), pe[0].count(".")))
    if first["type"] == "missing":
        message = "is required"
    else:
        same = list(dict.fromkeys(err["msg"] for path, err in errors if path == where))
        message = "; or ".join(same)
    return APIError(400, f"invalid request: {where or 'body'}: {message}", param=where or None)


def _type_mismatch(err: dict) -> bool:
    return err["type"].endswith("_type") or err["type"] in ("literal_error", "missing")


def field_path(loc: tuple) -> str:
    """pydantic's error location as the request's field path, without union members' tags."""
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif not _is_tag(p):
            parts.append(p)
    return ".".join(parts)


def _is_tag(part: str) -> bool:
    # pydantic names a union member by its type: str, int, list[...], function-after[...], ModelName
    return ("[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list")
            or part[:1].isupper())
