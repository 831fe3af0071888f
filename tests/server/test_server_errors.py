"""Every failure a client can cause gets the API's own error shape and a 4xx/503, never a 500;
plus auth, body limit, CORS, request timeout, and `lucebox serve` itself."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from lucebox.server.app import ServerConfig
from tests.server_helpers import build_model, free_port, start_server, wait_until_healthy

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("server-errors-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv, llm, _ = start_server(model_dir, max_model_len=512)
    srv.llm = llm
    yield srv
    srv.stop()


def post(server, path, body=None, raw=None, **kw):
    return httpx.post(server.url + path, json=body, content=raw, timeout=30, **kw)


def openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def anthropic_error(r, status, kind):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses"])
def test_malformed_json_is_a_400_in_openai_shape(server, path):
    openai_error(post(server, path, raw=b"{not json", headers={"content-type": "application/json"}), 400)


def test_malformed_json_is_a_400_in_anthropic_shape(server):
    anthropic_error(post(server, MSGS, raw=b"[1, 2", headers={"content-type": "application/json"}), 400,
                    "invalid_request_error")


@pytest.mark.parametrize("body,param", [
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": USER, "top_p": 5}, "top_p"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools.0.function"),
])
def test_wrong_or_missing_fields_name_the_field(server, body, param):
    openai_error(post(server, CHAT, dict(model="m", **body)), 400, param)


def test_unknown_tool_in_tool_choice_is_a_400_on_each_api(server):
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
    err = openai_error(post(server, CHAT, {"messages": USER, "tools": tools,
                                           "tool_choice": {"type": "function", "function": {"name": "zzz"}}}),
                       400, "tool_choice")
    assert "zzz" in err["message"]
    anthropic_error(post(server, MSGS, {"model": "c", "max_tokens": 5, "messages": USER,
                                        "tools": [{"name": "a", "input_schema": {"type": "object"}}],
                                        "tool_choice": {"type": "tool", "name": "zzz"}}), 400, "invalid_request_error")
    openai_error(post(server, "/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "a"}],
                                                "tool_choice": {"type": "function", "name": "zzz"}}), 400)


def test_anthropic_missing_max_tokens_and_bad_blocks(server):
    anthropic_error(post(server, MSGS, {"model": "c", "messages": USER}), 400, "invalid_request_error")
    anthropic_error(post(server, MSGS, {"model": "c", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}), 400, "invalid_request_error")


def test_context_overflow_is_a_400_saying_the_limit(server):
    err = openai_error(post(server, CHAT, {"messages": USER, "max_tokens": 100000}), 400)
    assert err["code"] == "context_length_exceeded" and "512" in err["message"]
    long = [{"role": "user", "content": "word " * 2000}]
    openai_error(post(server, CHAT, {"messages": long}), 400)
    anthropic_error(post(server, MSGS, {"model": "c", "max_tokens": 5, "messages": long}), 400,
                    "invalid_request_error")
    with pytest.raises(openai.BadRequestError):  # the SDK sees it as what it is
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=USER, max_tokens=100000)


def test_over_capacity_is_a_503_and_others_still_work(server):
    engine = server.llm.engine
    saved = engine.args.max_queue
    engine.args.max_queue = 0
    try:
        err = openai_error(post(server, CHAT, {"messages": USER, "max_tokens": 2}), 503)
        assert "busy" in err["message"]
        anthropic_error(post(server, MSGS, {"model": "c", "max_tokens": 2, "messages": USER}), 503,
                        "overloaded_error")
    finally:
        engine.args.max_queue = saved
    assert post(server, CHAT, {"messages": USER, "max_tokens": 2}).status_code == 200


def test_streaming_request_errors_before_headers_get_a_status(server):
    openai_error(post(server, CHAT, {"messages": USER, "max_tokens": 100000, "stream": True}), 400)


def test_unknown_route_and_method_are_shaped(server):
    openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    openai_error(httpx.get(server.url + CHAT), 405)


def test_unsupported_content_and_previous_response_id(server):
    openai_error(post(server, CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "messages[0].content[0].type")
    openai_error(post(server, "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}), 400,
                 "previous_response_id")


def test_invalid_json_schema_in_response_format(server):
    openai_error(post(server, CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}), 400)


# ------------------------------------------------------------------ auth, limits, CORS, timeout
@pytest.fixture(scope="module")
def strict(model_dir):
    config = ServerConfig(api_key="sekret", max_body_bytes=2000, cors_origins=["http://ui.example"],
                          request_timeout=0.5, keepalive=0.1)
    srv, llm, forcing = start_server(model_dir, config=config)
    yield srv
    srv.stop()


def test_api_key_via_bearer_or_x_api_key(strict):
    openai_error(httpx.post(strict.url + CHAT, json={"messages": USER, "max_tokens": 1}), 401)
    anthropic_error(httpx.post(strict.url + MSGS, json={"model": "c", "max_tokens": 1, "messages": USER}), 401,
                    "authentication_error")
    ok = openai.OpenAI(base_url=strict.url + "/v1", api_key="sekret", max_retries=0)
    assert ok.chat.completions.create(model="m", messages=USER, max_tokens=1).choices
    claude = anthropic.Anthropic(base_url=strict.url, api_key="sekret", max_retries=0)
    assert claude.messages.create(model="m", messages=USER, max_tokens=1).usage.output_tokens == 1
    assert httpx.get(strict.url + "/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_body_size_limit_is_a_413(strict):
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    openai_error(httpx.post(strict.url + CHAT, json=big, headers={"x-api-key": "sekret"}), 413)


def test_cors_preflight_only_for_configured_origins(strict, server):
    headers = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(strict.url + CHAT, headers=headers)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = httpx.options(server.url + CHAT, headers=headers)  # CORS off by default
    assert "access-control-allow-origin" not in r.headers


def test_request_timeout_aborts_and_reports(strict):
    body = {"messages": USER, "max_tokens": 400, "ignore_eos": True, "model": "force:slow"}
    err = openai_error(httpx.post(strict.url + CHAT, json=body, headers={"x-api-key": "sekret"}, timeout=30), 504)
    assert "request-timeout" in err["message"]


# ------------------------------------------------------------------ the command
def test_lucebox_serve_runs_and_shuts_down_gracefully(model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lucebox.cli", "serve", "--model", str(model_dir), "--port",
                             str(port), "--max-model-len", "256", "--served-model-name", "mini"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, 60, lambda: proc.stderr.read().decode())
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert models[0]["id"] == "mini" and models[0]["context_length"] == 256
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn finishes in-flight work, then (recent versions) re-raises the signal it caught
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_serve_help_lists_flags_with_defaults():
    out = subprocess.run([sys.executable, "-m", "lucebox.cli", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--cors-origin", "--max-model-len"):
        assert flag in out.stdout
    assert "127.0.0.1" in out.stdout and "8000" in out.stdout


def test_a_request_chat_template_is_refused_by_default_but_a_named_one_is_used(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' * 10 }}"}})
    assert e.value.body["param"] == "chat_template_kwargs" and "--allow-request-chat-template" in e.value.message
    named = next(iter(server.llm.tokenizer.chat_templates))
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"chat_template": named}})
    assert reply.choices[0].message is not None
