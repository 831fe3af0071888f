"""The FastAPI app: routes, API-shaped errors, auth, body limit, CORS, /health, /v1/models, /metrics;
and `serve`, which runs it under uvicorn with the AsyncEngine."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager, contextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..config import EngineArgs
from ..engine.async_engine import AsyncEngine
from ..engine.build import summary
from ..engine.engine import LLMEngine
from . import dashboard, protocol
from .body import read_json, validate
from .constrain import GrammarFactory
from .errors import APIError, api_of, refused
from .config import ServerConfig
from .metrics import Metrics
from .openapi import openapi_schema
from .request_limits import WorkLedger
from .tools import tool_format
from .turn_end import TurnEnd

log = logging.getLogger("lucebox.server")
LOOP_PARSE_BYTES = 256 << 10  # bodies larger than this are parsed and validated off the event loop


class ServerState:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, model_id: str, request_processors):
        self.engine, self.config, self.model_id = engine, config, model_id
        self.tokenizer = engine.tokenizer
        self.metrics = Metrics(model_id)
        self.dashboard = dashboard.Dashboard(engine.stats)
        self.grammars = GrammarFactory(self.tokenizer, engine.vocab_size, engine.eos_token_ids)
        self.tool_format = tool_format(self.tokenizer.chat_templates)
        self.turn_end = TurnEnd.of(self.tokenizer)
        self._request_processors = request_processors
        stats = engine.stats()
        capacity = stats.kv_capacity_tokens
        if stats.kv_flash is not None:  # KVFlash: a pooled context lives in host memory, its pool on the device
            capacity = max(capacity, engine.kv_room(True))
        self.work = WorkLedger(config, capacity)

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
        sampler = asyncio.create_task(state.dashboard.run())
        yield
        sampler.cancel()
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

    # Unexpected exceptions are answered by _Guard (a handler here would re-raise, dropping the connection).
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
        problem = engine.health_problem  # a crashed engine loop or a shutdown in progress
        if problem is not None:
            raise APIError(503, problem, code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def _models(request: Request):
        return models_listing(state, "client_version" in request.query_params)

    @app.get("/v1/models/{model:path}")
    async def _model(model: str):
        return models_listing(state, False)["data"][0] | {"id": model if model else state.model_id}

    @app.get("/openapi.json")
    async def _openapi():
        return openapi_schema(app.title, app.version, bool(config.api_key))

    @app.get("/metrics")
    async def _metrics():
        return PlainTextResponse(state.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    dashboard.install(app, state)

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
    """The JSON body as `model`: over --max-body-bytes is a 413; malformed or too deeply nested JSON,
    wrong types, out-of-range values and token ids outside the vocabulary are 400s naming the field."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise APIError(413, f"the request body exceeds {config.max_body_bytes} bytes (--max-body-bytes)")
            chunks.append(chunk)
    except ClientDisconnect as e:  # a client that gave up mid-upload (Claude Code's retries do)
        raise APIError(499, "the client closed the connection before its request body arrived") from e
    raw, context = b"".join(chunks), {"vocab_size": request.app.state.lucebox.engine.vocab_size}
    if len(raw) < LOOP_PARSE_BYTES:
        return validate(model, read_json(raw), context)
    return await asyncio.to_thread(lambda: validate(model, read_json(raw), context))  # the loop stays free


class _Guard:
    """ASGI middleware: the API key and the declared body size, checked before any route runs; and
    the last word on unexpected exceptions: a JSON 500 in the API's shape on a connection that stays
    usable (Starlette's own handler re-raises after answering, and uvicorn then drops the connection)."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config
        self.key = config.api_key.encode("utf-8") if config.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        error = self.refusal(scope)
        if error is not None:
            response: Response = refused(error, scope["method"], path).response(api_of(path))
            return await response(scope, receive, send)
        started = False

        async def send_watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except Exception as e:
            if started:  # half a response cannot be mended: uvicorn closes the connection
                raise
            log.exception("internal error on %s %s", scope["method"], path)
            response = APIError(500, f"internal server error: {type(e).__name__}").response(api_of(path))
            await response(scope, receive, send)

    def refusal(self, scope) -> APIError | None:
        headers = {k.lower(): v for k, v in scope["headers"]}
        preflight = scope["method"] == "OPTIONS" and self.config.cors_origins
        if self.key is not None and scope["path"] != "/health" and not dashboard.is_public(scope["path"]) and not preflight and not self.authorized(headers):
            return APIError(401, "invalid or missing API key: send Authorization: Bearer <key> or x-api-key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.config.max_body_bytes:
            return APIError(413, f"the request body exceeds {self.config.max_body_bytes} bytes (--max-body-bytes)")
        return None

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        """Either header may carry the key; each is compared in constant time (hmac.compare_digest)."""
        auth = headers.get(b"authorization", b"")
        bearer = auth[7:].strip() if auth[:7].lower() == b"bearer " else None
        given = [k for k in (bearer, headers.get(b"x-api-key")) if k is not None]
        return any([hmac.compare_digest(k, self.key) for k in given])


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
    # Requests still running at --graceful-timeout end with an error event; uvicorn's own limit comes
    # a little later, so that those last events reach their clients before it cancels the connections.
    server = _graceful_server(uvicorn.Config(app, host=config.host, port=config.port,
                                             timeout_keep_alive=int(config.idle_timeout),
                                             timeout_graceful_shutdown=int(config.graceful_timeout) + 3,
                                             log_level="info" if verbose else "warning"),
                              on_exit=lambda: engine.begin_shutdown(config.graceful_timeout))
    server.run()
    llm_engine.shutdown()  # tensor-parallel ranks exit with the server
    return 0


def _graceful_server(config, on_exit: Callable[[], None]):
    """A uvicorn.Server whose SIGTERM / SIGINT first calls on_exit (the engine stops admitting), and
    which then exits 0: a clean shutdown, not death by the signal uvicorn re-raises."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_exit()
            super().handle_exit(sig, frame)

        @contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    return GracefulServer(config)
