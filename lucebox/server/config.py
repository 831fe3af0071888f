"""ServerConfig: every `lucebox serve` setting (importable without the web stack, for --help)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import RequestError


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    cors_origins: list[str] = field(default_factory=list)  # empty: CORS off
    max_body_bytes: int = 64 << 20
    keepalive: float = 15.0  # seconds without output before an SSE keep-alive / ping
    request_timeout: float = 0.0  # seconds per request; 0: none
    idle_timeout: float = 60.0  # seconds an idle keep-alive connection stays open
    graceful_timeout: float = 30.0  # seconds in-flight requests get at shutdown
    constrain_auto_tools: bool = True  # with tool_choice auto, a <tool_call> must match a declared tool's schema
    # Output cap for requests that set none (Codex sends no max_output_tokens); None: the context's room.
    default_max_tokens: int | None = None
    allow_request_chat_template: bool = False  # chat_template_kwargs.chat_template text is code from the network

    HELP = {
        "host": "address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)",
        "port": "TCP port",
        "api_key": "require this key (Authorization: Bearer KEY or x-api-key: KEY); default: no auth",
        "served_model_name": "model id reported by /v1/models (default: the model path's name)",
        "cors_origins": "allow browser requests from these origins (repeatable; '*' for any); default: CORS off",
        "max_body_bytes": "largest accepted request body, in bytes",
        "keepalive": "seconds without output before an SSE keep-alive comment / ping event",
        "request_timeout": "abort a request after this many seconds (0: never)",
        "idle_timeout": "close idle keep-alive connections after this many seconds",
        "graceful_timeout": "seconds in-flight requests may take to finish at shutdown",
        "default_max_tokens": "output tokens for requests that set no limit (default: what the context window leaves)",
        "allow_request_chat_template": "render chat templates sent in requests (chat_template_kwargs.chat_template, "
                                       "up to 128 KiB, sandboxed and time-limited); default: only the model's own",
    }

    def __post_init__(self):
        if self.default_max_tokens is not None and (not isinstance(self.default_max_tokens, int)
                                                    or self.default_max_tokens < 1):
            raise RequestError(f"--default-max-tokens must be a positive integer, got {self.default_max_tokens!r}")
