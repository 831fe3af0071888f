"""Server-sent events framing shared by the three APIs."""
from __future__ import annotations

import json

from .errors import APIError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def openai_error_event(e: APIError) -> str:
    return sse(e.openai_body())


def anthropic_error_event(e: APIError) -> str:
    return sse(e.anthropic_body(), event="error")
