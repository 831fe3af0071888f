"""API errors: one exception type, rendered in the OpenAI or the Anthropic shape by the route's API."""
from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from ..engine.async_engine import EngineDeadError
from ..errors import ContextLengthError, LuceboxError, OverloadError, RequestError

# Anthropic names its error types after the HTTP status.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
                 500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, anthropic_message: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.anthropic_message = anthropic_message  # Anthropic's own wording, where clients parse it

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type or _OPENAI_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.anthropic_message or self.message}}

    def response(self, api: str) -> JSONResponse:
        body = self.anthropic_body() if api == "anthropic" else self.openai_body()
        headers = {"retry-after": "1"} if self.status in (429, 503) else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def context_error(message: str, prompt_tokens: int | None, max_tokens: int | None, context: int | None) -> APIError:
    """A context overflow: OpenAI's code, and Anthropic's wording, which Claude Code matches to shrink
    max_tokens or compact the conversation (its fallbacks key on these exact phrases)."""
    anthropic = None
    if prompt_tokens is not None and context is not None:
        if max_tokens is None or prompt_tokens >= context:
            anthropic = f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum"
        else:
            anthropic = (f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {max_tokens} > "
                         f"{context}, decrease input length or `max_tokens` and try again")
    return APIError(400, message, param="messages", code="context_length_exceeded", anthropic_message=anthropic)


def from_lucebox(e: LuceboxError) -> APIError:
    """The engine's errors, mapped to the status a client should act on."""
    if isinstance(e, ContextLengthError):
        return context_error(str(e), e.prompt_tokens, e.max_tokens, e.context)
    if isinstance(e, OverloadError):
        return APIError(503, str(e), code="overloaded")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, RequestError):
        return APIError(400, str(e), code="invalid_request")
    return APIError(400, str(e))


log = logging.getLogger("lucebox.server")


def refused(error: APIError, method: str, path: str) -> APIError:
    """Log why a request was refused, one line (the client may show only a status), and pass it on."""
    log.warning("%s %s -> %d: %s", method, path, error.status, error.message)
    return error


def api_of(path: str) -> str:
    """Which API's error shape a path speaks."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"
