"""The gateway's FastAPI application: its settings, and the factory that assembles the serving objects,
routes, middleware, error handlers and the engine pool's life."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from taco_llm.grpc_security import ClientTls
from taco_llm.version import package_version

from . import user_middleware
from .args import DEFAULT_RESPONSES_MAX_BYTES, DEFAULT_RESPONSES_TTL, DEFAULT_STREAM_STALL_TIMEOUT
from .auth import ApiKeyMiddleware, route_path
from .engine_pool import EnginePool
from .errors import APIError, from_validation
from .fleet_adapters import FleetAdapters, MemoryAdapterBook, RedisAdapterBook
from .from_engine import TokenText
from .metrics import MetricsMiddleware
from .rate_limits import RateLimiter
from .request_limits import RequestLimits, RequestLimitsMiddleware
from .response_store import MemoryResponseStore, RedisResponseStore, ResponseStore
from .routes import Servings, api_router
from .server_load import ServerLoad
from .serving import EngineCalls, engine_metadata
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_messages import ServingMessages
from .serving_models import ServingModels
from .serving_responses import ServingResponses
from .serving_tokenization import ServingTokenization
from .tenants import ApiKeys, RateLimits
from .tls import TlsOptions
from .tracing import install_tracing

logger = logging.getLogger(__name__)


@dataclass
class GatewaySettings:
    # Workers given by address (--engine); never leave the pool. With registry_url, more join by themselves.
    engines: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    uvicorn_log_level: str = "info"
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    # Sent to the workers as gRPC metadata when they require a key.
    engine_api_key: str | None = None
    engine_tls: ClientTls | None = None  # --engine-tls-*: None dials the workers in plain text
    # The fleet (args.ROUTING_FLAGS): discovery, routing, failover and traces.
    routing: str = "cache_aware"
    registry_url: str | None = None
    health_interval: float = 0.5
    max_retries: int = 2
    retry_backoff: float = 0.05
    max_migrations: int = 2
    # --stream-stall-timeout: seconds a stream waits on a worker that shows no progress (0: for ever).
    stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT
    cache_aware_balance_abs_threshold: int = 16
    cache_aware_balance_rel_threshold: float = 1.5
    cache_aware_offload_discount: float = 0.75
    shared_prefix_view: bool = True  # --shared-prefix-view
    otlp_traces_endpoint: str | None = None
    root_path: str = ""
    # Required of HTTP clients (`Authorization: Bearer KEY`) on every route but /health; None: no key.
    api_keys: ApiKeys | None = None
    # --tenant-isolation: named tenants get their own cache_salt (tenants.py); --rate-limit-*-per-minute.
    tenant_isolation: bool = True
    rate_limits: RateLimits = field(default_factory=RateLimits)
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    middleware: list[str] = field(default_factory=list)  # import paths, checked by gateway.__main__.parse
    tls: TlsOptions | None = None
    # --stream-interval: at most one chunk per this many tokens of a choice (see from_engine.coalesced).
    stream_interval: int = 1
    # Seconds the streams under way get to finish on SIGTERM (--shutdown-timeout).
    shutdown_timeout: int = 5
    # --api-server-count: gateway processes on the port; api_server_index: which one this is (None: the
    # only one, or the parent that starts them).
    api_server_count: int = 1
    api_server_index: int | None = None
    # --max-request-body-bytes, --max-header-bytes, --max-json-depth, --max-prompts-per-batch.
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    # Stored responses (/v1/responses): a Redis (--responses-store-url, else --registry-url's), or None
    # for this process's memory; --responses-ttl, --responses-max-bytes.
    responses_store_url: str | None = None
    responses_ttl: float = DEFAULT_RESPONSES_TTL
    responses_max_bytes: int = DEFAULT_RESPONSES_MAX_BYTES
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, from the environment: /v1/load_lora_adapter is served.
    runtime_lora_updating: bool = False

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


async def _api_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, APIError)
    return error.response(route_path(request.scope))


async def _validation_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    return from_validation(error).response(route_path(request.scope))


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    # What failed is in the log; the client learns only that it was the server's fault.
    return APIError(500, "the server failed while handling this request").response(route_path(request.scope))


def response_store(settings: GatewaySettings) -> ResponseStore:
    if settings.responses_store_url is None:
        if settings.api_server_count > 1:
            logger.warning("stored responses live in each API server process's memory: give "
                           "--responses-store-url (or --registry-url) for one store all of them read")
        return MemoryResponseStore(ttl=settings.responses_ttl, max_bytes=settings.responses_max_bytes)
    return RedisResponseStore(settings.responses_store_url, ttl=settings.responses_ttl,
                              max_bytes=settings.responses_max_bytes)


def runtime_lora_refusal(settings: GatewaySettings) -> APIError | None:
    """Why /v1/load_lora_adapter and /v1/unload_lora_adapter are refused here, if they are: as in vLLM,
    they need VLLM_ALLOW_RUNTIME_LORA_UPDATING (without it vLLM's server has no such routes: 404); and
    several API server processes need one book they all read (the registry's Redis)."""
    if not settings.runtime_lora_updating:
        return APIError(404, "runtime LoRA updating is off: start the gateway (and the workers) with "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, as vLLM's server wants", code="not_found")
    if settings.api_server_count > 1 and not settings.registry_url:
        return APIError(400, "runtime LoRA adapters with --api-server-count above 1 need --registry-url: the "
                             "processes keep the fleet's adapters there, in one book", code="lora_book_not_shared")
    return None


def create_app(settings: GatewaySettings, pool: EnginePool | None = None) -> FastAPI:
    metadata = engine_metadata(settings.engine_api_key)
    pool = pool or EnginePool(
        settings.engines, health_interval=settings.health_interval, metadata=metadata, routing=settings.routing,
        registry_url=settings.registry_url, balance_abs_threshold=settings.cache_aware_balance_abs_threshold,
        balance_rel_threshold=settings.cache_aware_balance_rel_threshold,
        offload_discount=settings.cache_aware_offload_discount, tls=settings.engine_tls,
        shared_prefix_view=settings.shared_prefix_view,
    )

    engines = EngineCalls(pool, max_retries=settings.max_retries, retry_backoff=settings.retry_backoff,
                          max_migrations=settings.max_migrations,
                          stream_stall_timeout=settings.stream_stall_timeout)
    token_text = TokenText(as_token_ids=settings.return_tokens_as_token_ids)
    server_load = ServerLoad()
    chat = ServingChat(engines, response_role=settings.response_role, token_text=token_text,
                       stream_interval=settings.stream_interval,
                       max_conversations_per_batch=settings.request_limits.max_prompts_per_batch)
    responses = ServingResponses(chat, response_store(settings), token_text)
    # The fleet's runtime LoRA adapters: in the registry's Redis, where every gateway replica reads them.
    adapters = FleetAdapters(pool, RedisAdapterBook(settings.registry_url) if settings.registry_url
                             else MemoryAdapterBook(), refusal=runtime_lora_refusal(settings))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        await adapters.start()
        try:
            yield
        finally:
            await responses.close()  # before the pool: its background responses are written `failed`
            await adapters.close()
            await pool.close()

    app = FastAPI(title="taco-llm", version=package_version(), lifespan=lifespan, root_path=settings.root_path)
    app.state.settings = settings
    app.state.pool = pool

    tokenization = ServingTokenization(engines)
    app.include_router(api_router(Servings(
        chat=chat,
        adapters=adapters,
        messages=ServingMessages(chat, tokenization),
        responses=responses,
        completion=ServingCompletion(engines, token_text=token_text, stream_interval=settings.stream_interval,
                                     max_prompts_per_batch=settings.request_limits.max_prompts_per_batch),
        models=ServingModels(pool, server_load),
        server_load=server_load,
        tokenization=tokenization,
    ), all_processes_metrics=settings.api_server_count > 1))

    # The last added runs first: metrics see every answer, CORS headers go on refusals too, and a
    # user's middleware sees requests before the key check, as in vLLM. Only a client with a key gets
    # its body read (request_limits).
    app.add_middleware(RequestLimitsMiddleware, limits=settings.request_limits)
    limited = settings.rate_limits.requests_per_minute or settings.rate_limits.tokens_per_minute or (
        settings.api_keys is not None and settings.api_keys.has_limits)
    if settings.api_keys or limited:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys,
                           limiter=RateLimiter(settings.rate_limits) if limited else None,
                           isolation=settings.tenant_isolation and settings.api_keys is not None
                           and settings.api_keys.named)
    for path in settings.middleware:
        user_middleware.install(app, user_middleware.load_middleware(path))
    app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                       allow_credentials=settings.allow_credentials, allow_methods=settings.allowed_methods,
                       allow_headers=settings.allowed_headers)
    app.add_middleware(MetricsMiddleware)
    install_tracing(app, settings.otlp_traces_endpoint)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
    return app
