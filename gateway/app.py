"""The gateway's FastAPI application: routes, error handlers, and the engine pool's life."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.middleware.cors import CORSMiddleware

from protos import engine_pb2
from taco_llm.version import package_version

from . import to_engine, user_middleware
from .auth import ApiKeyMiddleware
from .engine_pool import EnginePool
from .errors import APIError, bad_request, from_grpc
from .metrics import MetricsMiddleware
from .openai_routes import engine_metadata, router
from .protocol import DetokenizeRequest, TokenizeRequest
from .tls import TlsOptions

logger = logging.getLogger(__name__)


@dataclass
class GatewaySettings:
    engines: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    uvicorn_log_level: str = "info"
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    # Sent to the workers as gRPC metadata when they require a key.
    engine_api_key: str | None = None
    health_interval: float = 1.0
    root_path: str = ""
    # Required of HTTP clients (`Authorization: Bearer KEY`) on every route but /health.
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    middleware: list[str] = field(default_factory=list)  # import paths, checked by gateway.__main__.parse
    tls: TlsOptions | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def _validation_param(error: RequestValidationError) -> str | None:
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        if loc:
            return ".".join(loc)
    return None


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
        if item.get("type") == "json_invalid":
            ctx = item.get("ctx") or {}
            parts.append(f"the request body is not valid JSON: {ctx.get('error', item.get('msg'))}")
        else:
            parts.append(f"{loc}: {item.get('msg')}")
    return "; ".join(parts) or "invalid request"


def create_app(settings: GatewaySettings, pool: EnginePool | None = None) -> FastAPI:
    key = settings.engine_api_key
    pool = pool or EnginePool(settings.engines, settings.health_interval,
                              (("authorization", f"Bearer {key}"),) if key else ())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="taco-llm", version=package_version(), lifespan=lifespan, root_path=settings.root_path)
    app.state.settings = settings
    app.state.pool = pool
    app.include_router(router)
    # The last added runs first: metrics see every answer, CORS headers go on refusals too, and a
    # user's middleware sees requests before the key check, as in vLLM.
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    for path in settings.middleware:
        user_middleware.install(app, user_middleware.load_middleware(path))
    app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                       allow_credentials=settings.allow_credentials, allow_methods=settings.allowed_methods,
                       allow_headers=settings.allowed_headers)
    app.add_middleware(MetricsMiddleware)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        # vLLM's server answers 400, not FastAPI's 422, for a body it cannot use.
        return bad_request(_validation_message(error), _validation_param(error)).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(error).__name__}").response()

    @app.get("/health")
    async def health() -> Response:
        if not pool.ready_clients():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version_route() -> dict[str, Any]:
        engines = sorted({c.info.engine_version for c in pool.ready_clients() if c.info is not None})
        return {"version": package_version(), "vllm": engines[0] if len(engines) == 1 else engines}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = []
        for name, info in pool.models():
            # A LoRA adapter is a model of its own, whose parent is the base model it adapts (as in vLLM).
            lora = next((a for a in info.lora_adapters if a.name == name), None)
            data.append({"id": name, "object": "model", "created": info.created, "owned_by": "taco-llm",
                         "root": lora.path if lora else info.model_path,
                         "parent": lora.base_model_name if lora else None, "max_model_len": info.max_model_len})
        if not data:
            raise pool.unavailable()
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        engine_request = to_engine.tokenize_request(body)
        client = pool.pick(engine_request.model or None)
        try:
            reply = await client.stub.Tokenize(engine_request, metadata=engine_metadata(request))
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error, to_engine.TOKENIZE_PARAMS) from None
        result: dict[str, Any] = {"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                                  "tokens": list(reply.token_ids)}
        if body.return_token_strs:
            result["token_strs"] = list(reply.token_strs)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        client = pool.pick(body.model)
        try:
            reply = await client.stub.Detokenize(
                engine_pb2.DetokenizeRequest(model=body.model or "", token_ids=body.tokens),
                metadata=engine_metadata(request),
            )
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error, {"token_ids": "tokens"}) from None
        return {"prompt": reply.text}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
