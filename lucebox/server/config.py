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
    # Per-request limits: one request must not take the server from everyone else.
    max_n: int = 16  # completions per request
    max_stop_sequences: int = 16
    max_top_logprobs: int = 20  # OpenAI's own limit
    max_request_tokens: int | None = None  # n x (prompt + max_tokens); None: the KV pool's capacity
    max_pending_tokens: int | None = None  # the same, summed over admitted requests; None: 8 x max_request_tokens

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
        "max_n": "most completions (n) one request may ask for",
        "max_stop_sequences": "most stop strings one request may give",
        "max_top_logprobs": "most top logprobs per token one request may ask for",
        "max_request_tokens": "most tokens of work one request may ask for: n x (prompt + max_tokens) "
                              "(default: the KV cache's capacity; with --kv-pool-tokens, a pooled context's)",
        "max_pending_tokens": "most tokens of work admitted at once, all requests together; more are refused "
                              "with 503 (default: 8 x --max-request-tokens)",
    }

    def __post_init__(self):
        for name in ("default_max_tokens", "max_request_tokens", "max_pending_tokens"):
            _check_positive(name, getattr(self, name), optional=True)
        for name in ("max_n", "max_stop_sequences"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.max_top_logprobs, int) or self.max_top_logprobs < 0:
            raise RequestError(f"--max-top-logprobs must be an integer >= 0, got {self.max_top_logprobs!r}")
        if self.graceful_timeout < 0:
            raise RequestError(f"--graceful-timeout must be >= 0 seconds, got {self.graceful_timeout!r}")


def _check_positive(name: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
