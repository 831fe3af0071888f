"""Issue 35's hostile requests, one test per finding, over real HTTP (uvicorn on a free port): each
is a 4xx in the API's own error shape naming the field, and the keep-alive connection it came on
still serves the next request. An internal error is a JSON 500 on a connection that stays usable."""
from __future__ import annotations

import http.client
import json

import pytest

from lucebox import LLM
from lucebox.engine.async_engine import AsyncEngine
from lucebox.server.app import ServerConfig, create_app
from lucebox.server.body import MAX_JSON_DEPTH, json_depth
from tests.server_helpers import ServerThread, build_model

CHAT, COMPLETIONS, RESPONSES, MSGS, COUNT = ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                                             "/v1/messages", "/v1/messages/count_tokens")
USER = [{"role": "user", "content": "hi"}]
GOOD = {CHAT: {"messages": USER, "max_tokens": 2}, COMPLETIONS: {"prompt": "hi", "max_tokens": 2},
        RESPONSES: {"input": "hi", "max_output_tokens": 2},
        MSGS: {"model": "m", "max_tokens": 2, "messages": USER}, COUNT: {"model": "m", "messages": USER}}


def _explode(api: str, body: dict):
    """Test hook (create_app's request_processors): model "boom" raises inside the route."""
    if body.get("model") == "boom":
        raise RuntimeError("a bug inside the server")
    return []


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = LLM(str(build_model(tmp_path_factory.mktemp("hostile-model"))), max_model_len=256)
    srv = ServerThread(create_app(AsyncEngine(llm.engine), ServerConfig(), "tiny", _explode)).start()
    srv.vocab = llm.engine.model.config.vocab_size
    yield srv
    srv.stop()


class Connection:
    """One keep-alive HTTP/1.1 connection (http.client): a dropped connection fails the next request."""

    def __init__(self, server):
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)

    def post(self, path: str, body) -> tuple[int, dict]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.conn.request("POST", path, raw, {"content-type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        assert r.getheader("content-type", "").startswith("application/json"), data[:200]
        assert not r.will_close, "the server closed the keep-alive connection"
        return r.status, json.loads(data)

    def close(self):
        self.conn.close()


def refused(server, path: str, body, param: str | None = None, status: int = 400) -> str:
    """Send `body`, expect `status` in the API's shape (naming `param`), then a good request on the same
    connection; returns the error message."""
    conn = Connection(server)
    try:
        code, err = conn.post(path, body)
        assert code == status, err
        if path.startswith(MSGS):
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
            message = err["error"]["message"]
        else:
            assert set(err["error"]) == {"message", "type", "param", "code"}, err
            assert err["error"]["type"] == "invalid_request_error"
            message = err["error"]["message"]
            if param is not None:
                assert err["error"]["param"] == param, err
        if param is not None:
            assert param in message, message
        sock = conn.conn.sock
        code, ok = conn.post(path, GOOD[path])
        assert code == 200, ok
        assert conn.conn.sock is sock  # the very same connection served it
        return message
    finally:
        conn.close()


@pytest.mark.parametrize("path", [CHAT, MSGS])
@pytest.mark.parametrize("levels", [5000, 200_000])
def test_deep_json_is_a_400_naming_the_depth(server, path, levels):
    for open_, close in (("[", "]"), ('{"a":', "}")):
        body = ('{"messages": ' + open_ * levels + "1" + close * levels + "}").encode()
        message = refused(server, path, body)
        assert str(MAX_JSON_DEPTH) in message and str(levels + 1) in message
    # brackets inside strings are text, not nesting
    refused(server, CHAT, {"messages": [{"role": "user", "content": "[" * 10000}], "top_p": 7}, "top_p")


def test_json_just_within_the_depth_limit_is_parsed(server):
    schema: dict = {"type": "object", "properties": {"x": {"type": "string"}}}

    def body(schema):
        return {"model": "m", "messages": USER, "tools": [{"name": "f", "input_schema": schema}]}
    while json_depth(json.dumps(body({"type": "object", "properties": {"x": schema}})).encode()) <= MAX_JSON_DEPTH:
        schema = {"type": "object", "properties": {"x": schema}}
    body = body(schema)
    assert json_depth(json.dumps(body).encode()) == MAX_JSON_DEPTH
    code, answer = Connection(server).post(COUNT, body)
    assert code == 200 and answer["input_tokens"] > 100, answer


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    (CHAT, {"messages": USER, "stop": ["\udfff"]}, "stop.0"),
    (MSGS, {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, "messages.0.content.0.text"),
    (RESPONSES, {"input": "x", "instructions": "\ud83d"}, "instructions"),
])
def test_lone_surrogate_is_a_400(server, path, body, param):
    raw = json.dumps(body).encode()  # json escapes them: \ud800, valid JSON, no valid text
    assert b"\\ud" in raw or b"\\udc" in raw or b"\\udf" in raw
    message = refused(server, path, raw)
    assert param in message and "surrogate" in message
    # a surrogate pair is a real character: accepted
    refused_pair = {"messages": [{"role": "user", "content": "\ud83d\ude00"}], "max_tokens": 2}
    code, _ = Connection(server).post(CHAT, json.dumps(refused_pair).encode())
    assert code == 200


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]},
     "messages.0.content.0.text"),
    (MSGS, {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": {"t": 1}}]}]}, "messages.0.content.0.text"),
    (MSGS, {"model": "m", "max_tokens": 2, "system": [{"type": "text", "text": 3}], "messages": USER},
     "system.0.text"),
    (MSGS, {"model": "m", "max_tokens": 2, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "text", "text": 7}]}]}]},
     "messages.1.content.0.content.0.text"),
    (MSGS, {"model": "m", "max_tokens": 2, "messages": [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": 1}]}, *USER]},
     "messages.0.content.0.thinking"),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_text", "text": 1.5}]}]},
     "input.0.content.0.text"),
    (COUNT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, None),
])
def test_non_string_text_in_content_parts_is_a_400(server, path, body, param):
    refused(server, path, body, param)


def _chat_tool(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": USER, "tools": [_chat_tool(parameters={"type": "object", "properties": ["a"]})]},
     "tools.0.function.parameters"),
    (CHAT, {"messages": USER, "tools": [_chat_tool(parameters={"type": "object", "properties": {"a": 1}})]},
     "tools.0.function.parameters"),
    (CHAT, {"messages": USER, "tools": [_chat_tool(parameters={"type": "object", "required": "a"})]},
     "tools.0.function.parameters"),
    (MSGS, {"model": "m", "max_tokens": 2, "messages": USER,
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": "x"}}]},
     "tools.0.input_schema"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"properties": 3}}]},
     "tools.0.parameters"),
])
def test_tool_properties_that_are_not_an_object_are_a_400(server, path, body, param):
    refused(server, path, body, param)


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": USER, "tools": [_chat_tool(name=["f"])]}, "tools.0.function.name"),
    (CHAT, {"messages": USER, "tools": [_chat_tool()], "tool_choice": {"type": "function", "function": {
        "name": ["f"]}}}, "tool_choice.function.name"),
    (CHAT, {"messages": USER, "tools": [_chat_tool()], "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice.function"),
    (MSGS, {"model": "m", "max_tokens": 2, "messages": USER, "tools": [{"name": ["f"]}]}, "tools.0.name"),
    (MSGS, {"model": "m", "max_tokens": 2, "messages": USER, "tools": [{"name": "f"}],
            "tool_choice": {"type": "tool", "name": ["f"]}}, "tool_choice.name"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": ["f"]}]}, "tools.0.name"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "custom", "name": {"n": 1}}]}, "tools.0.name"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}],
                 "tool_choice": {"type": "function", "name": ["f"]}}, "tool_choice.name"),
])
def test_tool_names_given_as_lists_are_a_400(server, path, body, param):
    refused(server, path, body, param)


@pytest.mark.parametrize("key", ["tools", "messages", "add_generation_prompt", "documents", "chat_template"])
def test_chat_template_kwargs_clashing_with_the_servers_own_are_a_400(server, key):
    message = refused(server, CHAT, {"messages": USER, "chat_template_kwargs": {key: []}}, "chat_template_kwargs")
    assert key in message
    # the template's own switches still pass
    code, body = Connection(server).post(CHAT, {"messages": USER, "max_tokens": 2,
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 200, body


def test_completion_token_ids_out_of_range_are_a_400(server):
    vocab = server.vocab
    for ids in ([vocab], [1, vocab + 5], [2**40]):
        assert "vocabulary" in refused(server, COMPLETIONS, {"prompt": ids, "max_tokens": 2}, "prompt")
    refused(server, COMPLETIONS, {"prompt": [2**70], "max_tokens": 2}, "prompt.0")
    refused(server, COMPLETIONS, {"prompt": [-1], "max_tokens": 2}, "prompt.0")
    refused(server, COMPLETIONS, {"prompt": [1, True], "max_tokens": 2}, "prompt.1")
    refused(server, COMPLETIONS, {"prompt": "hi", "stop_token_ids": [vocab]}, "stop_token_ids")
    refused(server, CHAT, {"messages": USER, "stop_token_ids": [-3]}, "stop_token_ids.0")
    refused(server, CHAT, {"messages": USER, "logit_bias": {str(vocab): 1}}, "logit_bias")
    refused(server, CHAT, {"messages": USER, "logit_bias": {"-1": 1}}, "logit_bias")
    refused(server, CHAT, {"messages": USER, "logit_bias": {"5": 1000}}, "logit_bias.5")
    code, body = Connection(server).post(COMPLETIONS, {"prompt": [1, vocab - 1], "max_tokens": 2})
    assert code == 200 and body["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("path,field", [(CHAT, "max_tokens"), (CHAT, "n"), (CHAT, "seed"), (CHAT, "top_k"),
                                        (COMPLETIONS, "logprobs"), (RESPONSES, "max_output_tokens"),
                                        (MSGS, "max_tokens"), (MSGS, "top_k")])
def test_integers_beyond_64_bits_are_a_400(server, path, field):
    refused(server, path, dict(GOOD[path], **{field: 2**80}), field)


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                                 b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
                                 b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
                                 b'{"messages": [{"role": "user", "content": "hi"}], "x": -1e400}'])
def test_non_finite_numbers_are_a_400(server, raw):
    refused(server, CHAT, raw)


def test_max_tokens_beyond_the_context_is_refused_as_openai_does(server):
    message = refused(server, CHAT, {"messages": USER, "max_tokens": 10_000})
    assert "256" in message
    refused(server, MSGS, {"model": "m", "max_tokens": 10_000, "messages": USER})


@pytest.mark.parametrize("path", list(GOOD))
def test_internal_error_is_a_json_500_and_the_connection_stays_usable(server, path):
    if path == COUNT:
        pytest.skip("count_tokens runs no request processors (no hook to break it)")
    conn = Connection(server)
    for stream in (False, True):
        code, err = conn.post(path, dict(GOOD[path], model="boom", stream=stream))
        assert code == 500
        if path == MSGS:
            assert err == {"type": "error", "error": {"type": "api_error",
                                                      "message": "internal server error: RuntimeError"}}
        else:
            assert err["error"]["type"] == "server_error" and "RuntimeError" in err["error"]["message"]
        sock = conn.conn.sock
        code, ok = conn.post(path, GOOD[path])
        assert code == 200 and conn.conn.sock is sock
    conn.close()


def test_a_client_leaving_mid_body_is_no_internal_error(server, caplog):
    import socket
    import time
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100000\r\n\r\n{\"messages\": [")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any("499" in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    messages = [r.getMessage() for r in caplog.records]
    assert any("POST /v1/chat/completions -> 499" in m for m in messages), messages
    assert not any("internal error" in m for m in messages), messages
    conn = Connection(server)
    assert conn.post(CHAT, GOOD[CHAT])[0] == 200
    conn.close()
