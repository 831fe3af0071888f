"""Every failure a user can cause is a LuceboxError with a message a person can act on."""


class LuceboxError(Exception):
    """Base class: the CLI prints these without a traceback; the server maps them to API errors."""


class CheckpointError(LuceboxError):
    """A model file is missing, truncated, corrupt or does not fit its config."""


class UnsupportedError(LuceboxError):
    """An architecture, tensor type or feature lucebox does not support."""


class RequestError(LuceboxError):
    """A request (prompt, sampling parameter, flag) is invalid."""


class ContextLengthError(RequestError):
    """A prompt plus its requested output does not fit the context window. The numbers ride along so
    that an API can word the error as its clients expect (Claude Code parses Anthropic's wording)."""

    def __init__(self, message: str, prompt_tokens: int | None = None, max_tokens: int | None = None,
                 context: int | None = None):
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context


class OverloadError(LuceboxError):
    """The engine's waiting queue is full; the request was not accepted (retry later)."""


class HostKVFullError(OverloadError):
    """Every block of the host KV store (KVFlash's host backing) is taken (retry once others finish)."""
