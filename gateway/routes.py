"""The HTTP routes: each parses its body (FastAPI, with the types of protocol.py), hands it to its
serving object and returns what that gives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .metrics import REGISTRY, all_processes_registry
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_models import ServingModels
from .serving_tokenization import ServingTokenization


@dataclass(frozen=True)
class Servings:
    """One serving object per endpoint family, made once by the app factory."""

    chat: ServingChat
    completion: ServingCompletion
    models: ServingModels
    tokenization: ServingTokenization


def api_router(servings: Servings, *, all_processes_metrics: bool = False) -> APIRouter:
    """all_processes_metrics: /metrics adds up every API server process's (--api-server-count)."""
    # The return annotations are FastAPI's response models: `Any` (no model) where a handler may return
    # a ready Response, `dict[str, Any]` where it returns JSON; they shape /openapi.json.
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await servings.chat.create(body, request)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await servings.completion.create(body, request)

    @router.get("/health")
    async def health() -> Response:
        return servings.models.health()

    @router.get("/version")
    async def version_route() -> dict[str, Any]:
        return servings.models.version()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return servings.models.models()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await servings.tokenization.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await servings.tokenization.detokenize(body)

    @router.get("/metrics/targets")
    async def metrics_targets() -> list[dict[str, Any]]:
        return servings.models.metrics_targets()

    @router.get("/metrics")
    async def metrics() -> Response:
        registry = all_processes_registry() if all_processes_metrics else REGISTRY
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
