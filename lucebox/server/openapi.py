"""GET /openapi.json: the served API as OpenAPI 3.1, its request bodies being the very pydantic
models every request is validated against (protocol.py), its errors each API's own shape."""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from . import protocol

_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}


def _obj(required: list[str], **props) -> dict:
    return {"type": "object", "required": required, "properties": props}


_USAGE = {"type": "object"}
# What a 200 holds (non-streamed); streamed answers are text/event-stream.
_RESULTS = {
    "/v1/chat/completions": _obj(["id", "object", "created", "model", "choices", "usage"],
                                 object={"const": "chat.completion"}, choices={"type": "array", "items": _obj(
                                     ["index", "message", "finish_reason"], index={"type": "integer"},
                                     message=_obj(["role"], role={"const": "assistant"},
                                                  content={"type": ["string", "null"]}))}),
    "/v1/completions": _obj(["id", "object", "created", "model", "choices", "usage"],
                            object={"const": "text_completion"}, choices={"type": "array", "items": _obj(
                                ["index", "text", "finish_reason"], text={"type": "string"})}),
    "/v1/responses": _obj(["id", "object", "status", "model", "output"], object={"const": "response"},
                          status={"enum": ["completed", "incomplete"]}, output={"type": "array"}),
    "/v1/messages": _obj(["id", "type", "role", "model", "content", "stop_reason", "usage"],
                         type={"const": "message"}, role={"const": "assistant"}, content={"type": "array"},
                         stop_reason={"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
                         usage=_obj(["input_tokens", "output_tokens"], input_tokens={"type": "integer"},
                                    output_tokens={"type": "integer"})),
    "/v1/messages/count_tokens": _obj(["input_tokens"], input_tokens={"type": "integer", "minimum": 0}),
}
# One server-sent event (schemathesis checks each event of a text/event-stream answer against it).
_EVENT = {"type": "object", "required": ["data"], "properties": {"event": {"type": "string"},
                                                                 "data": {"type": "string"}}}
_STREAMS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}


def openapi_schema(title: str, version: str, api_key: bool) -> dict:
    """api_key: the server requires one (every path but /health)."""
    models = [(m, "validation") for m in protocol.REQUEST_MODELS.values()]
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    paths = {}
    for path, model in protocol.REQUEST_MODELS.items():
        ok = {"application/json": {"schema": _RESULTS[path]}}
        if path in _STREAMS:
            ok["text/event-stream"] = {"schema": _EVENT}
        error = _ANTHROPIC_ERROR if path.startswith("/v1/messages") else _OPENAI_ERROR
        paths[path] = {"post": {
            "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[(model, "validation")]}}},
            "responses": {"200": {"description": "the result", "content": ok},
                          "default": {"description": "an error in the API's own shape",
                                      "content": {"application/json": {"schema": error}}}}}}
    listing = _obj(["object", "data"], object={"const": "list"}, data={"type": "array"})
    paths["/v1/models"] = {"get": {"operationId": "list_models", "responses": {
        "200": {"description": "the served model", "content": {"application/json": {"schema": listing}}},
        "default": {"description": "an error", "content": {"application/json": {"schema": _OPENAI_ERROR}}}}}}
    paths["/health"] = {"get": {"operationId": "health", "security": [], "responses": {
        "200": {"description": "the engine runs", "content": {"application/json": {"schema": _obj(["status"])}}},
        "default": {"description": "it does not", "content": {"application/json": {"schema": _OPENAI_ERROR}}}}}}
    doc = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
           "components": {"schemas": defs.get("$defs", {})}}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        doc["security"] = [{"bearer": []}, {"x-api-key": []}]
    return doc
