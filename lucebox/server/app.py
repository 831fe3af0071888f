"""The FastAPI app: routes, API-shaped errors, auth, body limit, CORS, /health, /v1/models, /metrics;
and `serve`, which runs it under uvicorn with the AsyncEngine."""
from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..config import EngineArgs
from ..engine.async_engine import AsyncEngine
from ..engine.build import summary
from ..engine.engine import LLMEngine
from . import protocol
from .constrain import GrammarFactory
from .errors import APIError, api_of, refused
from .config import ServerConfig
from .metrics import Metrics
from .tools import tool_format

log = logging.getLogger("lucebox.server")


class ServerState:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, model_id: str, request_processors):
        self.engine, self.config, self.model_id = engine, config, model_id
        self.tokenizer = engine.tokenizer
        self.metrics = Metrics(model_id)
        self.grammars = GrammarFactory(self.tokenizer, engine.vocab_size, engine.eos_token_ids)
        self.tool_format = tool_format(self.tokenizer.chat_templates)
        self._request_processors = request_processors

    def model_name(self, requested: str | None) -> str:
        return self.model_id

    def extra_processors(self, api: str, body: dict) -> list:
        """Test hook: logits processors a test adds to force a model's output (see create_app)."""
        return list(self._request_processors(api, body) or []) if self._request_processors else []


def create_app(engine: AsyncEngine, config: ServerConfig | None = None, model_id: str | None = None,
               request_processors: Callable[[str, dict], list] | None = None) -> FastAPI:
    """`request_processors(api, body) -> [logits processor]` is for tests only: a tiny random model
    cannot be trusted to write tool calls, so tests force its output through this hook while the
    parsing, streaming and engine paths stay the production ones."""
    config = config or ServerConfig()
    state = ServerState(engine, config, model_id or config.served_model_name or "lucebox", request_processors)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()

    app = FastAPI(title="lucebox", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lucebox = state
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in config.cors_origins)
    app.add_middleware(_Guard, config=config)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return refused(e, request.method, request.url.path).response(api_of(request.url.path))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return refused(APIError(e.status_code, message), request.method, request.url.path).response(
            api_of(request.url.path))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal server error: {type(e).__name__}").response(api_of(request.url.path))

    from . import anthropic, completions, openai_chat, responses

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await openai_chat.chat_completions(state, request, await parse_body(request, protocol.ChatCompletionRequest, config))

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions.completions(state, request, await parse_body(request, protocol.CompletionRequest, config))

    @app.post("/v1/responses")
    async def _responses(request: Request):
        return await responses.responses(state, request, await parse_body(request, protocol.ResponsesRequest, config))

    @app.post("/v1/messages")
    async def _messages(request: Request):
        return await anthropic.messages(state, request, await parse_body(request, protocol.MessagesRequest, config))

    @app.post("/v1/messages/count_tokens")
    async def _count(request: Request):
        return await anthropic.count_tokens(state, await parse_body(request, protocol.CountTokensRequest, config))

    @app.get("/health")
    async def _health():
        if not engine.is_running:
            raise APIError(503, "the engine is not running")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def _models(request: Request):
        return models_listing(state, "client_version" in request.query_params)

    @app.get("/v1/models/{model:path}")
    async def _model(model: str):
        return models_listing(state, False)["data"][0] | {"id": model if model else state.model_id}

    @app.get("/metrics")
    async def _metrics():
        return PlainTextResponse(state.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    return app


def models_listing(state, codex: bool) -> dict:
    ctx = state.engine.max_model_len
    card = {"id": state.model_id, "object": "model", "created": int(time.time()), "owned_by": "lucebox",
            "root": state.model_id, "context_length": ctx, "max_model_len": ctx, "max_context_length": ctx}
    body = {"object": "list", "data": [card]}
    if codex:  # Codex's /models schema (it sends ?client_version=...)
        levels = [{"effort": e, "description": f"{e} reasoning effort"} for e in ("low", "medium", "high")]
        body["models"] = [{"slug": state.model_id, "display_name": state.model_id, "description": "served by lucebox",
                           "default_reasoning_level": "low", "supported_reasoning_levels": levels,
                           "shell_type": "shell_command", "visibility": "list", "supported_in_api": True,
                           "priority": 0, "context_window": ctx, "max_context_window": ctx,
                           "supports_parallel_tool_calls": True, "supports_reasoning_summaries": False,
                           "apply_patch_tool_type": "freeform", "truncation_policy": {"mode": "tokens", "limit": ctx}}]
    return body


async def parse_body(request: Request, model, config: ServerConfig):
    """The JSON body as `model`; malformed JSON, wrong types and missing fields are 400s naming the field."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > config.max_body_bytes:
            raise APIError(413, f"the request body exceeds {config.max_body_bytes} bytes (--max-body-bytes)")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        message = "is required" if err["type"] == "missing" else err["msg"]
        raise APIError(400, f"invalid request: {loc or 'body'}: {message}", param=loc or None) from e


class _Guard:
    """ASGI middleware: API key and the declared body size, checked before any route runs."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = None
        if self.config.api_key and path != "/health" and scope["method"] != "OPTIONS":
            auth = headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key")
            if key != self.config.api_key:
                error = APIError(401, "invalid or missing API key: send Authorization: Bearer <key> or x-api-key")
        length = headers.get("content-length")
        if error is None and length and length.isdigit() and int(length) > self.config.max_body_bytes:
            error = APIError(413, f"the request body exceeds {self.config.max_body_bytes} bytes (--max-body-bytes)")
        if error is not None:
            response: Response = refused(error, scope["method"], path).response(api_of(path))
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def serve(engine_args: EngineArgs, config: ServerConfig, verbose: bool = False, processors_for=None) -> int:
    """`lucebox serve`: load the model, start the engine, run uvicorn until SIGINT / SIGTERM.
    `processors_for(engine)` -> a request_processors hook (test only: `lucebox serve --script`)."""
    import gc
    import sys

    import uvicorn

    llm_engine = LLMEngine.from_args(engine_args)
    print(summary(llm_engine), file=sys.stderr)
    engine = AsyncEngine(llm_engine)
    model_id = config.served_model_name or engine.model_name or "lucebox"
    app = create_app(engine, config, model_id, processors_for(engine) if processors_for else None)
    # What startup made (the model, its graphs, torch's and the server's modules: ~230K objects) lives
    # as long as the server: out of the garbage collector's sight, a full collection, which stalls
    # every running request, takes microseconds instead of ~80 ms.
    gc.freeze()
    print(f"[lucebox serving {model_id} on http://{config.host}:{config.port} "
          f"(OpenAI /v1/chat/completions /v1/completions /v1/responses, Anthropic /v1/messages)]", file=sys.stderr)
    uvicorn.run(app, host=config.host, port=config.port, timeout_keep_alive=int(config.idle_timeout),
                timeout_graceful_shutdown=int(config.graceful_timeout) or None,
                log_level="info" if verbose else "warning")
    return 0
