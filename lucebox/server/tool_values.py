"""A tool call's argument values typed by the tool's JSON schema: the XML and Gemma 4 call formats
write values as text, and the schema says whether `3` is the number 3 or the string "3"."""
from __future__ import annotations

import json


def schema_types(schema) -> set[str]:
    """The string entries of a schema's "type" (a client may put any JSON there)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    return {k for k in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(k, str)}


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    return value


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (or 1e999): they would make the arguments invalid JSON."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite_float)


def coerce_text(raw: str, schema) -> object:
    """A parameter's text typed by its schema: strings stay strings, other types take the JSON the
    text spells (or a boolean's spelling), and text that spells none stays text."""
    kinds = schema_types(schema)
    if not kinds or "string" in kinds:
        return raw
    try:
        return strict_json(raw)
    except ValueError:
        if "boolean" in kinds and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        return raw
