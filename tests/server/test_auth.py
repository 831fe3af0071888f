"""--api-key: every route but /health needs the key, sent as Authorization: Bearer or x-api-key (the
official SDKs' two ways), compared in constant time; a refusal is a 401 in the route's API shape."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from lucebox import LLM
from lucebox.engine.async_engine import AsyncEngine
from lucebox.server import app as app_module
from lucebox.server import dashboard
from lucebox.server.app import ServerConfig, create_app
from tests.server_helpers import ServerThread, build_model

KEY = "sekret-key-42"
USER = [{"role": "user", "content": "hi"}]
BODIES = {"/v1/chat/completions": {"messages": USER, "max_tokens": 1},
          "/v1/completions": {"prompt": "hi", "max_tokens": 1},
          "/v1/responses": {"input": "hi", "max_output_tokens": 1},
          "/v1/messages": {"model": "m", "max_tokens": 1, "messages": USER},
          "/v1/messages/count_tokens": {"model": "m", "messages": USER}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = LLM(str(build_model(tmp_path_factory.mktemp("auth-model"))), max_model_len=128)
    app = create_app(AsyncEngine(llm.engine), ServerConfig(api_key=KEY), "tiny")
    srv = ServerThread(app).start()
    srv.app = app
    yield srv
    srv.stop()


def routes(app) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, path parameters filled in."""
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path.replace("{model:path}", "some/model")))
    return out


def call(server, method, path, headers=None):
    return httpx.request(method, server.url + path, json=BODIES.get(path) if method == "POST" else None,
                         headers=headers or {}, timeout=60)


def test_every_route_but_health_refuses_a_missing_or_wrong_key(server):
    served = routes(server.app)
    assert {p for _, p in served} >= set(BODIES) | {"/health", "/v1/models", "/metrics", "/openapi.json"}
    utf8 = "ключ".encode()  # a header that is not ASCII must be a 401, not a failed comparison
    assert ("GET", "/dashboard/data") in served
    for method, path in served:
        if path == "/health":
            continue
        if dashboard.is_public(path):  # the status page's HTML, JS and CSS: no data, which needs the key
            assert call(server, method, path).status_code in (200, 404)
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY},
                        {"Authorization": "Basic " + KEY}, {"x-api-key": KEY + "x"}, {"x-api-key": utf8},
                        {"Authorization": b"Bearer " + utf8}, {"Authorization": "Bearer"}):
            r = call(server, method, path, headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            body = r.json()
            if path.startswith("/v1/messages"):
                assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
            else:
                assert body["error"]["type"] == "authentication_error" and "API key" in body["error"]["message"]


def test_every_route_accepts_the_key_in_either_header(server):
    for method, path in routes(server.app):
        for headers in ({"Authorization": "Bearer " + KEY}, {"authorization": "bearer  " + KEY},
                        {"x-api-key": KEY}, {"x-api-key": KEY, "Authorization": "Bearer someone-else"}):
            r = call(server, method, path, headers)
            assert r.status_code == 200, (method, path, headers, r.text)


def test_health_needs_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200


def test_official_sdks_authenticate(server):
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == "tiny"
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    assert claude.messages.count_tokens(model="m", messages=USER).input_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="m", messages=USER)


def test_keys_are_compared_in_constant_time(server, monkeypatch):
    compared = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    assert call(server, "GET", "/v1/models", {"x-api-key": "nope"}).status_code == 401
    assert call(server, "GET", "/v1/models", {"Authorization": "Bearer " + KEY}).status_code == 200
    assert compared == [(b"nope", KEY.encode()), (KEY.encode(), KEY.encode())]
