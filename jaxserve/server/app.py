"""The FastAPI application: routes, API-key guard, body-size limit, server-load tracking, engine start and stop."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

import jaxserve
from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxserve.engine.core_client import EngineCoreClient
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.replicas import DataParallelEngine, build_replicas
from jaxserve.engine.served_model import ServedModel
from jaxserve.server.chat import ChatServing
from jaxserve.server.completions import CompletionServing
from jaxserve.server.config import ServerConfig
from jaxserve.server.dashboard import add_dashboard_routes
from jaxserve.server.embeddings import EmbeddingsServing
from jaxserve.server.errors import EXCEPTION_HANDLERS, APIError, error_response
from jaxserve.server.messages_api import MessagesServing
from jaxserve.server.metrics import ServerMetrics, cache_config_info
from jaxserve.server.models import ServedModels
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
)
from jaxserve.server.responses_api import ResponsesServing
from jaxserve.server.serving import OpenAIServing
from jaxserve.server.tokenization import TokenizationServing

logger = logging.getLogger("jaxserve")


def _metrics(config: ServerConfig, served: ServedModel, replica_stats) -> ServerMetrics:
    """The server's Prometheus metrics for `served`, reading the engine counters from `replica_stats()`."""
    return ServerMetrics(config.metrics_prefix, config.served_model_name, replica_stats, served.max_model_len,
                         cache_config_info(served.kv_cache))


@dataclasses.dataclass(frozen=True)
class Handlers:
    """The route handlers, each over the same engine facade and served names."""

    models: ServedModels
    completions: CompletionServing
    chat: ChatServing
    tokenization: TokenizationServing
    embeddings: EmbeddingsServing
    responses: ResponsesServing
    messages: MessagesServing

    @classmethod
    def over(cls, engine: AsyncLLMEngine | DataParallelEngine | EngineCoreClient, config: ServerConfig) -> Handlers:
        """Every handler over `engine`."""
        config.check_reasoning(engine.model.reasoning)
        models = ServedModels(engine, config)
        chat = ChatServing(engine, config, models)
        pooling = EmbeddingsServing(OpenAIServing(engine, config, models))
        return cls(models, CompletionServing(engine, config, models), chat,
                   TokenizationServing(engine, config, models), pooling,
                   ResponsesServing(chat, config.max_stored_responses), MessagesServing(chat))


def build_app(engine: LLMEngine | EngineCoreClient | DataParallelEngine, config: ServerConfig,
              observe_steps: bool = True) -> FastAPI:
    """The app serving `engine`: an LLMEngine in this process (its loop on a thread, data-parallel replicas each on
    theirs), or engine-core processes' clients (one, or data-parallel replicas over several); the engine runs
    between the app's startup and shutdown. Without `observe_steps` the engine steps' metrics are left to another
    front end of the same cores (server/front_ends.py)."""
    if isinstance(engine, (EngineCoreClient, DataParallelEngine)):  # engine-core processes' clients
        async_engine = engine
        replica_stats = engine.replica_stats if isinstance(engine, DataParallelEngine) else lambda: [engine.stats()]
        metrics = _metrics(config, engine.model, replica_stats)
        engine.set_hooks(on_outputs=metrics.observe_outputs, on_step=metrics.observe_step if observe_steps else None,
                         on_moves=metrics.observe_moves)
    else:
        metrics = _metrics(config, ServedModel.of(engine), lambda: replica_stats())

        def serve_async(each: LLMEngine) -> AsyncLLMEngine:
            return AsyncLLMEngine(each, config.max_waiting_requests, on_outputs=metrics.observe_outputs,
                                  stream_interval=config.stream_interval, on_step=metrics.observe_step)

        if engine.config.parallel_config.data_parallel_size > 1:
            async_engine = DataParallelEngine(build_replicas(engine, serve_async))
            replica_stats = async_engine.replica_stats
        else:
            async_engine = serve_async(engine)
            replica_stats = lambda: [async_engine.stats()]  # noqa: E731
        engine.on_peer_lost(lambda reason: async_engine.fail(EngineDeadError(f"the multi-host launch broke: {reason}")))
    handlers = Handlers.over(async_engine, config)
    logger.info("sampling defaults from the model's generation config, for the fields a request leaves unset: %s",
                async_engine.model.generation_defaults or "none")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        yield
        await async_engine.stop()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan,
                  exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    load = ServerLoad()
    if config.enable_server_load_tracking:
        app.add_middleware(LoadTracking, load=load)
    if config.allowed_origins:  # outermost: a preflight is answered before the API key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
    app.state.async_engine = async_engine

    _add_api_routes(app, handlers, config)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs, 503 once it has stopped or failed."""
        return Response(status_code=200 if async_engine.is_running else 503)

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # SageMaker's health check, as in vLLM

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
        return handlers.tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        """Text of token ids."""
        return handlers.tokenization.detokenize(body)

    _add_vllm_routes(app, async_engine, handlers, config, load)
    if config.enable_dashboard:
        add_dashboard_routes(app, async_engine, metrics, replica_stats, config.served_model_name,
                             [Depends(_api_key_guard(config.api_key))])
    return app


def _add_api_routes(app: FastAPI, handlers: Handlers, config: ServerConfig) -> None:
    """The API's routes behind the API key: OpenAI's under /v1 (completions, chat and vLLM's batched chat, responses,
    embeddings, models), Anthropic's messages, and vLLM's pooling routes (also outside /v1, as vLLM serves them)."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_guard(config.api_key))])
    v1.add_api_route("/completions", handlers.completions.completions, methods=["POST"], response_model=None)
    v1.add_api_route("/chat/completions", handlers.chat.chat, methods=["POST"], response_model=None)
    v1.add_api_route("/chat/completions/batch", handlers.chat.batch, methods=["POST"], response_model=None)
    responses, messages, embeddings = handlers.responses, handlers.messages, handlers.embeddings
    v1.add_api_route("/responses", responses.create, methods=["POST"], response_model=None)
    v1.add_api_route("/responses/{response_id}", responses.get, methods=["GET"])
    v1.add_api_route("/responses/{response_id}", responses.delete, methods=["DELETE"])
    v1.add_api_route("/responses/{response_id}/input_items", responses.input_items, methods=["GET"])
    v1.add_api_route("/responses/{response_id}/cancel", responses.cancel, methods=["POST"])
    v1.add_api_route("/messages", messages.create, methods=["POST"], response_model=None)
    v1.add_api_route("/messages/count_tokens", messages.count_tokens, methods=["POST"])
    v1.add_api_route("/embeddings", embeddings.create, methods=["POST"], response_model=None)
    v1.add_api_route("/score", embeddings.score, methods=["POST"], response_model=None)
    v1.add_api_route("/rerank", embeddings.rerank, methods=["POST"], response_model=None)
    v1.add_api_route("/models", handlers.models.models, methods=["GET"])
    if config.allow_runtime_lora_updating:
        v1.add_api_route("/load_lora_adapter", handlers.models.load_lora_adapter, methods=["POST"],
                         response_model=None)
        v1.add_api_route("/unload_lora_adapter", handlers.models.unload_lora_adapter, methods=["POST"],
                         response_model=None)
    app.include_router(v1)
    guard = [Depends(_api_key_guard(config.api_key))]  # vLLM serves these outside /v1 too
    app.add_api_route("/score", embeddings.score, methods=["POST"], response_model=None, dependencies=guard)
    app.add_api_route("/rerank", embeddings.rerank, methods=["POST"], response_model=None, dependencies=guard)
    app.add_api_route("/v2/rerank", embeddings.rerank, methods=["POST"], response_model=None, dependencies=guard)
    app.add_api_route("/classify", embeddings.classify, methods=["POST"], response_model=None, dependencies=guard)
    app.add_api_route("/pooling", embeddings.pooling, methods=["POST"], response_model=None, dependencies=guard)


def _add_vllm_routes(app: FastAPI, engine: AsyncLLMEngine | DataParallelEngine, handlers: Handlers,
                     config: ServerConfig, load: ServerLoad) -> None:
    """vLLM's further routes: /load, /reset_prefix_cache, SageMaker's /invocations, and /tokenizer_info when enabled."""
    guard = [Depends(_api_key_guard(config.api_key))]

    @app.get("/load")
    async def server_load() -> dict:
        """Requests in flight on the generation routes (always 0 without --enable-server-load-tracking)."""
        return {"server_load": load.in_flight}

    @app.post("/reset_prefix_cache", dependencies=guard)
    async def reset_prefix_cache() -> Response:
        """Forget every cached KV page (vLLM's route); pages in use stay in use."""
        try:
            await engine.reset_prefix_cache()
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        return Response(status_code=200)

    if config.enable_weight_updates:
        @app.post("/update_weights_from_disk", dependencies=guard)
        async def update_weights_from_disk(body: UpdateWeightsRequest) -> dict:
            """New weights of the served model from a Hugging Face folder (SGLang's route), between two steps; a 400
            naming what does not fit, the served weights untouched."""
            try:
                version = await engine.update_weights(body.model_path)
            except EngineDeadError as error:
                raise APIError(503, str(error)) from error
            except ValueError as error:
                raise APIError(400, str(error), "model_path") from error
            return {"success": True, "message": f"weights updated from {body.model_path}",
                    "weights_version": version}

    if engine.model.sleep_mode:
        @app.post("/sleep", dependencies=guard)
        async def sleep(level: int = 1) -> Response:
            """vLLM's sleep route: free the devices' memory (LLM.sleep) between two steps; a 400 saying why not."""
            await _engine_call(engine.sleep(level))
            return Response(status_code=200)

        @app.post("/wake_up", dependencies=guard)
        async def wake_up() -> Response:
            """vLLM's wake-up route: take the devices back (LLM.wake_up); a 400 saying why not."""
            await _engine_call(engine.wake_up())
            return Response(status_code=200)

        @app.get("/is_sleeping", dependencies=guard)
        async def is_sleeping() -> dict:
            """Whether the engine sleeps."""
            return {"is_sleeping": engine.is_sleeping()}

    @app.post("/invocations", dependencies=guard, response_model=None)
    async def invocations(raw: Request) -> Response | dict:
        """SageMaker's one route: a body with `messages` is a chat completion, one with `prompt` a completion."""
        body = await _json_body(raw)
        if isinstance(body, dict) and "messages" in body:
            return await handlers.chat.chat(_parse(ChatCompletionRequest, body), raw)
        if isinstance(body, dict) and "prompt" in body:
            return await handlers.completions.completions(_parse(CompletionRequest, body), raw)
        raise APIError(400, "cannot tell the request type: /invocations takes a chat completion request (with "
                            "messages) or a completion request (with prompt)")

    if config.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info", dependencies=guard)
        async def tokenizer_info() -> dict:
            """The tokenizer's configuration and chat template."""
            return handlers.tokenization.tokenizer_info()


async def _engine_call(call) -> object:
    """Await an engine command: a ValueError is a 400 with its message, a dead engine a 503."""
    try:
        return await call
    except EngineDeadError as error:
        raise APIError(503, str(error)) from error
    except ValueError as error:
        raise APIError(400, str(error)) from error


async def _json_body(raw: Request) -> object:
    """The request body parsed as JSON (400 when it is not JSON)."""
    try:
        return await raw.json()
    except ValueError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from error


def _parse(model: type[BaseModel], body: dict) -> BaseModel:
    """`body` as a `model`; a bad body is the same 400 as on that model's own route."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from error


def _api_key_guard(api_key: str | None):
    """A dependency that requires `Authorization: Bearer <api_key>` or, as Anthropic's clients send it,
    `x-api-key: <api_key>` (nothing when no key is set)."""
    expected = f"Bearer {api_key}".encode()

    async def check(authorization: str | None = Header(default=None),
                    x_api_key: str | None = Header(default=None)) -> None:
        if api_key is None:
            return
        bearer = authorization is not None and secrets.compare_digest(authorization.encode(), expected)
        keyed = x_api_key is not None and secrets.compare_digest(x_api_key.encode(), api_key.encode())
        if not (bearer or keyed):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                                "<key>')", None, "invalid_api_key")

    return check


@dataclasses.dataclass
class ServerLoad:
    """vLLM's server load: requests in flight on the generation routes."""

    in_flight: int = 0


class LoadTracking:
    """ASGI middleware: counts each request to a generation route from its arrival until its response,
    streamed or not, has ended, however it ends."""

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
             "/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify", "/pooling",
             "/invocations")

    def __init__(self, app, load: ServerLoad):
        self.app = app
        self.load = load

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


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
