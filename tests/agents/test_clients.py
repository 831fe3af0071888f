"""Every client's configuration writer: the files parse in their own format and carry the server's URL,
key, model and context; everything lives under the private home."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from lucebox.agents.clients import CLIENTS, KEY_VAR, Setup, client
from lucebox.errors import LuceboxError


@pytest.fixture
def setup(tmp_path):
    return Setup(tmp_path / "home", "http://127.0.0.1:4321", "sekret", "default", 65536, 2048,
                 workdir=tmp_path / "work")


def test_codex_config_is_a_responses_provider(setup):
    env = CLIENTS["codex"].configure(setup)
    config = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    assert config["model"] == "default" and config["model_provider"] == "lucebox"
    assert config["model_context_window"] == 65536
    provider = config["model_providers"]["lucebox"]
    assert provider["base_url"] == "http://127.0.0.1:4321/v1" and provider["wire_api"] == "responses"
    assert env[provider["env_key"]] == "sekret"
    assert config["projects"][str(setup.workdir)]["trust_level"] == "trusted"
    assert Path(env["CODEX_HOME"]).is_relative_to(setup.home)


def test_opencode_config_is_an_openai_compatible_provider(setup):
    env = CLIENTS["opencode"].configure(setup)
    config = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    provider = config["provider"]["lucebox"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == "http://127.0.0.1:4321/v1"
    assert provider["options"]["apiKey"] == "{env:%s}" % KEY_VAR and env[KEY_VAR] == "sekret"
    assert provider["models"]["default"]["limit"] == {"context": 65536, "output": 2048}
    assert config["model"] == config["small_model"] == "lucebox/default"
    assert config["autoupdate"] is False and env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"


def test_claude_code_gets_anthropic_url_token_and_no_network_extras(setup):
    env = CLIENTS["claude-code"].configure(setup)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:4321"  # Claude Code appends /v1/messages itself
    assert env["ANTHROPIC_AUTH_TOKEN"] == "sekret"
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "default"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"
    state = json.loads((Path(env["CLAUDE_CONFIG_DIR"]) / ".claude.json").read_text())
    assert state["hasCompletedOnboarding"] is True


def test_open_webui_gets_one_openai_connection_and_starts_offline(setup):
    env = CLIENTS["openwebui"].configure(setup)
    assert env["OPENAI_API_BASE_URLS"] == "http://127.0.0.1:4321/v1" and env["OPENAI_API_KEYS"] == "sekret"
    assert env["ENABLE_OLLAMA_API"] == "False" and env["WEBUI_AUTH"] == "False"
    # no sentence-transformers model is loaded or downloaded at start
    assert env["RAG_EMBEDDING_ENGINE"] == "openai" and env["BYPASS_EMBEDDING_AND_RETRIEVAL"] == "True"
    assert env["OFFLINE_MODE"] == "True" and env["HF_HUB_OFFLINE"] == "1"
    assert Path(env["DATA_DIR"]).is_relative_to(setup.home) and len(env["WEBUI_SECRET_KEY"]) == 64
    c = CLIENTS["openwebui"]
    assert c.args == ("serve",) and c.web_args == ("--host", "127.0.0.1", "--port", "{port}")


def test_hermes_config_is_a_custom_endpoint_with_an_output_limit(setup):
    env = CLIENTS["hermes"].configure(setup)
    model = json.loads((Path(env["HERMES_HOME"]) / "config.yaml").read_text())["model"]  # JSON is YAML
    assert model == {"default": "default", "provider": "custom", "base_url": "http://127.0.0.1:4321/v1",
                     "api_key": "sekret", "context_length": 65536, "max_tokens": 2048}


def test_pi_models_json_and_default(setup):
    env = CLIENTS["pi"].configure(setup)
    agent = Path(env["PI_CODING_AGENT_DIR"])
    provider = json.loads((agent / "models.json").read_text())["providers"]["lucebox"]
    assert provider["baseUrl"] == "http://127.0.0.1:4321/v1" and provider["api"] == "openai-completions"
    assert env[provider["apiKey"]] == "sekret"  # pi reads an environment variable of that name
    assert provider["models"][0]["id"] == "default" and provider["models"][0]["contextWindow"] == 65536
    assert json.loads((agent / "settings.json").read_text()) == {"defaultProvider": "lucebox", "defaultModel": "default"}


def test_openclaw_provider_and_default_model(setup):
    env = CLIENTS["openclaw"].configure(setup)
    config = json.loads(Path(env["OPENCLAW_CONFIG_PATH"]).read_text())
    provider = config["models"]["providers"]["lucebox"]
    assert provider["baseUrl"] == "http://127.0.0.1:4321/v1" and provider["apiKey"] == "sekret"
    assert config["agents"]["defaults"]["model"]["primary"] == "lucebox/default"


@pytest.mark.parametrize("name", list(CLIENTS))
def test_every_client_lives_in_the_private_home(setup, name):
    env = CLIENTS[name].configure(setup)
    assert env["HOME"] == str(setup.home) and env[KEY_VAR] == "sekret"
    written = [p for p in setup.home.rglob("*") if p.is_file()]
    assert all(p.is_relative_to(setup.home) for p in written)
    assert CLIENTS[name].install[0] in ("npm", "pip")


def test_unknown_client_names_the_known_ones():
    with pytest.raises(LuceboxError, match="unknown client 'vim'.*codex"):
        client("vim")
