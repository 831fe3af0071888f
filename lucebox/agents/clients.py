"""The coding agents and chat apps `lucebox launch` runs: one table, each client with its install
command, its program, and a writer of its documented provider configuration inside a private home.

Every writer takes a Setup (where the server is, the key, the model id, the context) and returns the
environment the client needs; the files it writes live under setup.home, so the person's own
configuration is never read or changed and nothing points at a hosted service."""
from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KEY_VAR = "LUCEBOX_API_KEY"  # the environment variable clients read the server's key from


@dataclass
class Setup:
    home: Path  # the client's private home (a temporary directory)
    url: str  # the server's root, e.g. http://127.0.0.1:8000 (no /v1)
    api_key: str
    model: str  # the served model id
    context: int  # the server's context window in tokens
    max_output: int = 4096  # output tokens a client may ask for per turn
    workdir: Path | None = None  # where the client runs (Codex trusts it)

    @property
    def v1(self) -> str:
        return self.url.rstrip("/") + "/v1"


@dataclass(frozen=True)
class Client:
    name: str  # lucebox launch NAME
    binary: str  # the program looked up on PATH
    install: tuple[str, ...]  # the command that installs it
    api: str  # the lucebox API it speaks: anthropic | responses | chat
    configure: Callable[[Setup], dict[str, str]]  # writes its config under setup.home, returns its environment
    args: tuple[str, ...] = ()  # arguments placed before the person's own
    # a web app: arguments binding it to "{port}" on this machine only, and the path that answers once it is up
    web_args: tuple[str, ...] = ()
    web_ready: str = "/health"

    @property
    def install_command(self) -> str:
        return " ".join(self.install)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _write_json(path: Path, data) -> Path:
    return _write(path, json.dumps(data, indent=2) + "\n")


def base_env(setup: Setup) -> dict[str, str]:
    """Every client: a private HOME and XDG directories, and the key under LUCEBOX_API_KEY."""
    home = setup.home
    return {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
            KEY_VAR: setup.api_key}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _toml_table(name: str | None, values: dict) -> str:
    head = [f"[{name}]"] if name else []
    return "\n".join(head + [f"{k} = {_toml_value(v)}" for k, v in values.items()]) + "\n"


def configure_codex(setup: Setup) -> dict[str, str]:
    """$CODEX_HOME/config.toml: a Responses-API provider (wire_api = "responses") at the server's /v1."""
    codex_home = setup.home / ".codex"
    root = {"model": setup.model, "model_provider": "lucebox", "model_context_window": setup.context,
            # lucebox returns the model's <think> text as raw reasoning, not as an OpenAI summary
            "show_raw_agent_reasoning": True, "check_for_update_on_startup": False}
    provider = {"name": "lucebox", "base_url": setup.v1, "env_key": KEY_VAR, "wire_api": "responses",
                # a long first prompt prefills for minutes on a CPU: no idle timeout, no retries that repeat it
                "stream_idle_timeout_ms": 3_600_000, "request_max_retries": 0, "stream_max_retries": 0}
    text = _toml_table(None, root) + "\n" + _toml_table("model_providers.lucebox", provider)
    if setup.workdir is not None:
        text += "\n" + _toml_table(f"projects.{json.dumps(str(setup.workdir))}", {"trust_level": "trusted"})
    _write(codex_home / "config.toml", text)
    return base_env(setup) | {"CODEX_HOME": str(codex_home)}


def configure_opencode(setup: Setup) -> dict[str, str]:
    """opencode.json: an OpenAI-compatible provider (@ai-sdk/openai-compatible) at the server's /v1."""
    model = {"name": setup.model, "tool_call": True, "reasoning": True,
             "limit": {"context": setup.context, "output": setup.max_output}}
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"lucebox": {"npm": "@ai-sdk/openai-compatible", "name": "lucebox",
                                       "options": {"baseURL": setup.v1, "apiKey": "{env:%s}" % KEY_VAR},
                                       "models": {setup.model: model}}},
              "model": f"lucebox/{setup.model}", "small_model": f"lucebox/{setup.model}",
              "enabled_providers": ["lucebox"], "autoupdate": False, "share": "disabled"}
    path = _write_json(setup.home / ".config" / "opencode" / "opencode.json", config)
    return base_env(setup) | {"OPENCODE_CONFIG": str(path), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                              "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                              "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1"}


def configure_claude_code(setup: Setup) -> dict[str, str]:
    """Anthropic base URL and token in the environment; a config dir whose onboarding is done."""
    config_dir = setup.home / ".claude"
    _write_json(config_dir / ".claude.json", {"hasCompletedOnboarding": True, "theme": "dark",
                                             "bypassPermissionsModeAccepted": True})
    _write_json(config_dir / "settings.json", {"includeCoAuthoredBy": False})
    models = {name: setup.model for name in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL",
                                             "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                                             "ANTHROPIC_DEFAULT_HAIKU_MODEL")}
    return base_env(setup) | models | {
        "CLAUDE_CONFIG_DIR": str(config_dir), "ANTHROPIC_BASE_URL": setup.url, "ANTHROPIC_AUTH_TOKEN": setup.api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(setup.max_output),
        # its ~38K-token first prompt prefills for minutes on a CPU: no request or stream-idle timeout before that
        "API_TIMEOUT_MS": "3600000", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
        "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "3600000"}


def configure_open_webui(setup: Setup) -> dict[str, str]:
    """Open WebUI reads its connections from the environment: one OpenAI connection to the server, no Ollama,
    no login, offline (no update check, no Hugging Face downloads), and no local embedding model to load:
    documents go whole into the prompt instead of through retrieval."""
    return base_env(setup) | {
        "DATA_DIR": str(setup.home / "open-webui"), "ENABLE_OPENAI_API": "True",
        # its session-signing key; unset, it writes .webui_secret_key into the current directory
        "WEBUI_SECRET_KEY": secrets.token_hex(32),
        "OPENAI_API_BASE_URLS": setup.v1, "OPENAI_API_KEYS": setup.api_key,
        "ENABLE_OLLAMA_API": "False", "WEBUI_AUTH": "False", "DEFAULT_MODELS": setup.model,
        "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1", "ENABLE_VERSION_UPDATE_CHECK": "False",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "True", "RAG_EMBEDDING_ENGINE": "openai",
        "RAG_OPENAI_API_BASE_URL": setup.v1, "RAG_OPENAI_API_KEY": setup.api_key,
        "ANONYMIZED_TELEMETRY": "False", "SCARF_NO_ANALYTICS": "true", "DO_NOT_TRACK": "true"}


def configure_hermes(setup: Setup) -> dict[str, str]:
    """$HERMES_HOME/config.yaml: a custom OpenAI-compatible endpoint (written as JSON, which is YAML)."""
    hermes_home = setup.home / ".hermes"
    config = {"model": {"default": setup.model, "provider": "custom", "base_url": setup.v1,
                        "api_key": setup.api_key, "context_length": setup.context,
                        # unset, hermes asks for the whole context as output and the server refuses the request
                        "max_tokens": setup.max_output}}
    _write_json(hermes_home / "config.yaml", config)
    return base_env(setup) | {"HERMES_HOME": str(hermes_home)}


def _pi_model(setup: Setup) -> dict:
    return {"id": setup.model, "name": setup.model, "reasoning": True, "input": ["text"],
            "contextWindow": setup.context, "maxTokens": setup.max_output,
            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}


def configure_pi(setup: Setup) -> dict[str, str]:
    """pi's agent dir: models.json with an openai-completions provider, settings.json choosing it."""
    agent_dir = setup.home / ".pi" / "agent"
    provider = {"baseUrl": setup.v1, "api": "openai-completions", "apiKey": KEY_VAR,
                "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                "models": [_pi_model(setup)]}
    _write_json(agent_dir / "models.json", {"providers": {"lucebox": provider}})
    _write_json(agent_dir / "settings.json", {"defaultProvider": "lucebox", "defaultModel": setup.model})
    return base_env(setup) | {"PI_CODING_AGENT_DIR": str(agent_dir), "PI_OFFLINE": "1"}


def configure_openclaw(setup: Setup) -> dict[str, str]:
    """openclaw.json: models.providers.lucebox (openai-completions), the default agent's model on it."""
    state = setup.home / ".openclaw"
    provider = {"baseUrl": setup.v1, "apiKey": setup.api_key, "api": "openai-completions",
                "models": [_pi_model(setup)]}
    config = {"models": {"mode": "merge", "providers": {"lucebox": provider}},
              "agents": {"defaults": {"model": {"primary": f"lucebox/{setup.model}"}}}}
    path = _write_json(state / "openclaw.json", config)
    return base_env(setup) | {"OPENCLAW_STATE_DIR": str(state), "OPENCLAW_CONFIG_PATH": str(path)}


CLIENTS: dict[str, Client] = {c.name: c for c in [
    Client("claude-code", "claude", ("npm", "install", "-g", "@anthropic-ai/claude-code"), "anthropic",
           configure_claude_code),
    Client("codex", "codex", ("npm", "install", "-g", "@openai/codex"), "responses", configure_codex),
    Client("opencode", "opencode", ("npm", "install", "-g", "opencode-ai"), "chat", configure_opencode),
    Client("openwebui", "open-webui", ("pip", "install", "open-webui"), "chat", configure_open_webui,
           args=("serve",), web_args=("--host", "127.0.0.1", "--port", "{port}")),
    Client("hermes", "hermes", ("pip", "install", "hermes-agent"), "chat", configure_hermes),
    Client("pi", "pi", ("npm", "install", "-g", "@mariozechner/pi-coding-agent"), "chat", configure_pi),
    Client("openclaw", "openclaw", ("npm", "install", "-g", "openclaw"), "chat", configure_openclaw),
]}


def client(name: str) -> Client:
    from ..errors import LuceboxError
    if name not in CLIENTS:
        raise LuceboxError(f"unknown client {name!r}; choose one of {', '.join(CLIENTS)}")
    return CLIENTS[name]
