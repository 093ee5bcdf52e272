"""The FastAPI application: routes, API-key guard, body-size limit, engine start and stop."""

from __future__ import annotations

import secrets
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import Response
from starlette.exceptions import HTTPException

import jaxserve
from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.engine import LLMEngine
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import EXCEPTION_HANDLERS, APIError, error_response
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.server.serving import OpenAIServing


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The app serving `engine`; the engine thread runs between the app's startup and shutdown."""
    metrics = ServerMetrics(config.metrics_prefix, config.served_model_name, lambda: async_engine.stats())
    async_engine = AsyncLLMEngine(engine, config.max_waiting_requests, on_outputs=metrics.observe_outputs,
                                  stream_interval=config.stream_interval)
    serving = OpenAIServing(async_engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        yield
        await async_engine.stop()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan,
                  exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.state.async_engine = async_engine

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_guard(config.api_key))])
    v1.add_api_route("/completions", serving.completions, methods=["POST"], response_model=None)
    v1.add_api_route("/chat/completions", serving.chat, methods=["POST"], response_model=None)
    v1.add_api_route("/models", serving.models, methods=["GET"])
    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs, 503 once it has stopped or failed."""
        return Response(status_code=200 if async_engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        """The jaxserve version."""
        return {"version": jaxserve.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """Token ids of a prompt or of chat messages."""
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        """Text of token ids."""
        return serving.detokenize(body)

    return app


def _api_key_guard(api_key: str | None):
    """A dependency that requires `Authorization: Bearer <api_key>` (nothing when no key is set)."""
    expected = f"Bearer {api_key}".encode()

    async def check(authorization: str | None = Header(default=None)) -> None:
        if api_key is None:
            return
        if authorization is None or not secrets.compare_digest(authorization.encode(), expected):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key")

    return check


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, by Content-Length or as it streams in."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, self._message())(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than the limit of {self.max_bytes} bytes"
