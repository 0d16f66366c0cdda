"""The HTTP routes: each parses its body (FastAPI, with the types of protocol.py), hands it to its
serving object and returns what that gives.

Every route documents what it answers in /openapi.json: its body's model, its answers' models by status
(protocol.py), and the media types (JSON, server-sent events, Prometheus text). The handlers return
ready dicts or Responses, so the models document and never filter (`response_model=None`).
tests/test_openapi_schema.py checks that every route documents its body and answers, and
tests/test_fuzz_gateway.py fuzzes the running gateway against this schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from .anthropic_protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesStreamEvent,
)
from .auth import isolated_cache_salt, require_operator
from .fleet_adapters import FleetAdapters
from .metrics import REGISTRY, all_processes_registry
from .protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthStatus,
    InvocationRequest,
    InvocationResponse,
    LoadLoraAdapterRequest,
    LoadResponse,
    MetricsTargetGroup,
    ModelList,
    ServerInfo,
    StreamEvent,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
    VersionResponse,
)
from .responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest, ResponseStreamEvent
from .server_load import ServerLoad
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_messages import ServingMessages
from .serving_models import ServingModels
from .serving_responses import ServingResponses
from .serving_tokenization import ServingTokenization

# FastAPI's `responses=` entries, keyed by status (an int, or "4XX" for a range).
Responses = dict[int | str, dict[str, Any]]


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# What any route may refuse with. "4XX" also keeps FastAPI from documenting its 422, which this app
# never sends (a body that does not parse is a 400, as in vLLM's server); its entry covers the
# refusals of the request limits (431 for headers, ...), all OpenAI error JSON too.
_REFUSALS: Responses = {
    401: _error("Missing or invalid API key (the server runs with --api-key)."),
    429: _error("Over the key's rate limit; Retry-After says when to try again."),
    "4XX": _error("Any other refusal of the request, as OpenAI error JSON naming the field."),
}
# What a route that reads a body adds: a bad field, an unknown model, a body over the size limit.
_BODY_REFUSALS: Responses = {
    400: _error("A field is invalid (the error's `param` names it), or the body is not JSON."),
    404: _error("The model is not served (code `model_not_found`)."),
    413: _error("The body is over the size limit."),
}
# The fleet-wide routes (runtime LoRA adapters): a named tenant's key is refused; without
# VLLM_ALLOW_RUNTIME_LORA_UPDATING they answer 404, as vLLM's server, which has no such routes then.
_OPERATOR_ONLY: Responses = {
    403: _error("A named tenant's key: only the operator's key may change the fleet's adapters."),
    404: _error("No such adapter to unload (`param`: lora_name), or runtime LoRA updating is off."),
}
# No worker can take the request right now: retry after Retry-After seconds.
_UNAVAILABLE: Responses = {503: _error("No worker is ready for the model; retry after Retry-After seconds.")}


def _ok(model: type[BaseModel], description: str, *, streams: bool = False) -> Responses:
    """A 200 answer of `model` as JSON; where the request may ask for a stream, also server-sent events."""
    answer: dict[str, Any] = {"model": model, "description": description}
    if streams:
        answer["content"] = {"text/event-stream": {"schema": StreamEvent.model_json_schema()}}
    return {200: answer}


def _answers(*parts: Responses) -> Responses:
    merged: Responses = {}
    for part in parts:
        merged.update(part)
    return merged


@dataclass(frozen=True)
class Servings:
    """One serving object per endpoint family, made once by the app factory."""

    chat: ServingChat
    completion: ServingCompletion
    # LoRA adapters loaded at runtime across the fleet.
    adapters: FleetAdapters
    messages: ServingMessages
    models: ServingModels
    responses: ServingResponses
    tokenization: ServingTokenization
    # What /load counts: the generating routes' requests under way.
    server_load: ServerLoad


def api_router(servings: Servings, *, all_processes_metrics: bool = False) -> APIRouter:
    """all_processes_metrics: /metrics adds up every API server process's (--api-server-count)."""
    router = APIRouter()
    generate_answers = _answers(_REFUSALS, _BODY_REFUSALS, _UNAVAILABLE)

    @router.post("/v1/chat/completions", response_model=None, responses=_answers(
        _ok(ChatCompletionResponse, "The reply; with `stream: true`, chat.completion.chunk events.", streams=True),
        generate_answers))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        body.cache_salt = isolated_cache_salt(request, body.cache_salt)  # before routing reads it
        return await servings.server_load.counted(servings.chat.create(body, request))

    @router.post("/v1/completions", response_model=None, responses=_answers(
        _ok(CompletionResponse, "The completion; with `stream: true`, text_completion events.", streams=True),
        generate_answers))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        body.cache_salt = isolated_cache_salt(request, body.cache_salt)
        return await servings.server_load.counted(servings.completion.create(body, request))

    # OpenAI's Responses API: stored responses are the tenant's own (serving_responses.store_scope).
    not_stored: Responses = {404: _error("No stored response of this id for this key's tenant (never "
                                         "stored, expired or deleted); code `response_not_found`.")}

    @router.post("/v1/responses", response_model=None, responses=_answers(
        {200: {"model": ResponseObject,
               "description": "The response (with `background: true`, queued: poll GET /v1/responses/{id}); "
                              "with `stream: true`, its typed events (response.created, ..., "
                              "response.completed).",
               "content": {"text/event-stream": {"schema": ResponseStreamEvent.model_json_schema()}}}},
        generate_answers))
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        return await servings.server_load.counted(servings.responses.create(
            body, request, cache_salt=isolated_cache_salt(request, body.cache_salt)))

    @router.get("/v1/responses/{response_id}", response_model=None, responses=_answers(
        _ok(ResponseObject, "The stored response, at its present status."), not_stored, _REFUSALS))
    async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
        return await servings.responses.retrieve(response_id, request)

    @router.post("/v1/responses/{response_id}/cancel", response_model=None, responses=_answers(
        _ok(ResponseObject, "The background response, cancelled; one already finished, as it is."),
        not_stored, {400: _error("The response was not created with `background: true`.")}, _REFUSALS))
    async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
        return await servings.responses.cancel(response_id, request)

    @router.delete("/v1/responses/{response_id}", response_model=None, responses=_answers(
        _ok(DeletedResponse, "The response is deleted (one under way is stopped)."), not_stored, _REFUSALS))
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await servings.responses.delete(response_id, request)

    # Anthropic's Messages API: its answers and its errors take Anthropic's shape (errors.py).
    anthropic_refusals: Responses = {
        status: {"model": AnthropicErrorResponse, "description": entry["description"]}
        for status, entry in _answers(_REFUSALS, _BODY_REFUSALS, _UNAVAILABLE).items()}

    @router.post("/v1/messages", response_model=None, responses=_answers(
        {200: {"model": MessagesResponse,
               "description": "The message; with `stream: true`, Anthropic's events (message_start, "
                              "content_block_*, message_delta, message_stop).",
               "content": {"text/event-stream": {"schema": MessagesStreamEvent.model_json_schema()}}}},
        anthropic_refusals))
    async def messages(body: MessagesRequest, request: Request) -> Any:
        return await servings.server_load.counted(
            servings.messages.create(body, request, cache_salt=isolated_cache_salt(request, None)))

    @router.post("/v1/messages/count_tokens", response_model=None, responses=_answers(
        _ok(CountTokensResponse, "The conversation's prompt tokens, as the model's chat template renders it."),
        anthropic_refusals))
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, Any]:
        return await servings.messages.count_tokens(body)

    @router.post("/v1/chat/completions/batch", response_model=None, responses=_answers(
        _ok(ChatCompletionResponse, "One choice per conversation, choice i for conversation i; the usage summed."),
        generate_answers))
    async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request) -> Any:
        body.cache_salt = isolated_cache_salt(request, body.cache_salt)
        return await servings.server_load.counted(servings.chat.create_batch(body, request))

    @router.post("/invocations", response_model=None, responses=_answers(
        _ok(InvocationResponse, "SageMaker's entry point: a body with `messages` is a chat completion, one "
            "with `prompt` a completion; answered as those routes answer (streamed with `stream: true`).",
            streams=True),
        generate_answers))
    async def invocations(body: InvocationRequest, request: Request) -> Any:
        inner = body.root
        inner.cache_salt = isolated_cache_salt(request, inner.cache_salt)
        if isinstance(inner, ChatCompletionRequest):
            return await servings.server_load.counted(servings.chat.create(inner, request))
        return await servings.server_load.counted(servings.completion.create(inner, request))

    # SageMaker's health check, which sends GET or POST.
    ping_answers = _answers(_ok(HealthStatus, "A worker is ready."), _REFUSALS, _UNAVAILABLE)

    @router.get("/ping", response_model=None, responses=ping_answers)
    @router.post("/ping", response_model=None, responses=ping_answers)
    async def ping() -> dict[str, Any]:
        return servings.models.ping()

    @router.get("/load", response_model=None, responses=_answers(
        _ok(LoadResponse, "Requests on the generating routes this gateway process is answering."), _REFUSALS))
    async def load() -> dict[str, Any]:
        return servings.models.load()

    @router.get("/server_info", response_model=None, responses=_answers(
        _ok(ServerInfo, "This gateway's version and routing, and its workers as its health checks see them."),
        _REFUSALS))
    async def server_info() -> dict[str, Any]:
        return servings.models.server_info()

    @router.get("/health", response_model=None, responses={
        200: {"model": HealthStatus, "description": "A worker is ready."},
        503: {"model": HealthStatus, "description": "No worker is ready; retry after Retry-After seconds."},
        # Only the request limits refuse here: /health needs no API key.
        "4XX": _error("The request is over a limit (its headers' size)."),
    })
    async def health() -> Response:
        return servings.models.health()

    @router.get("/version", response_model=None, responses=_answers(
        _ok(VersionResponse, "This server's version and its workers' vLLM version."), _REFUSALS))
    async def version_route() -> dict[str, Any]:
        return servings.models.version()

    @router.get("/v1/models", response_model=None, responses=_answers(
        _ok(ModelList, "The served models and LoRA adapters."), _REFUSALS, _UNAVAILABLE))
    async def models() -> dict[str, Any]:
        return servings.models.models()

    @router.post("/tokenize", response_model=None, responses=_answers(
        _ok(TokenizeResponse, "The prompt's (or the rendered chat's) token ids."), _REFUSALS, _BODY_REFUSALS,
        _UNAVAILABLE))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await servings.tokenization.tokenize(body)

    @router.post("/detokenize", response_model=None, responses=_answers(
        _ok(DetokenizeResponse, "The token ids' text."), _REFUSALS, _BODY_REFUSALS, _UNAVAILABLE))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await servings.tokenization.detokenize(body)

    @router.get("/metrics/targets", response_model=None, responses={
        200: {"description": "The workers' /metrics, as Prometheus HTTP service discovery.",
              "content": {"application/json": {"schema": {
                  "type": "array", "items": MetricsTargetGroup.model_json_schema()}}}},
        **_REFUSALS,
    })
    async def metrics_targets() -> list[dict[str, Any]]:
        return servings.models.metrics_targets()

    # vLLM's runtime LoRA routes, answered as vLLM's are (a line of text); on every worker of the base model.
    def _text_answers(description: str, refusals: Responses) -> Responses:
        return {200: {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}},
                **{status: {"description": entry["description"],
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
                   for status, entry in refusals.items()}}

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_text_answers(
        "The adapter is loaded on every ready worker of its base model, and given to workers that join.",
        _answers(_REFUSALS, _BODY_REFUSALS, _OPERATOR_ONLY, _UNAVAILABLE)))
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
        require_operator(request, "loading a LoRA adapter")
        return PlainTextResponse(await servings.adapters.load(
            body.lora_name, body.lora_path, base_model_name=body.base_model_name, inplace=bool(body.load_inplace)))

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_text_answers(
        "The adapter is unloaded from every worker that holds it.",
        _answers(_REFUSALS, _BODY_REFUSALS, _OPERATOR_ONLY, _UNAVAILABLE)))
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
        require_operator(request, "unloading a LoRA adapter")
        return PlainTextResponse(await servings.adapters.unload(body.lora_name))

    # PlainTextResponse documents the 200 as text; the refusals stay JSON, by their schema's reference
    # (a `model` entry would take the route's text media type).
    @router.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition."},
        **{status: {"description": entry["description"],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
           for status, entry in _REFUSALS.items()},
    })
    async def metrics() -> Response:
        registry = all_processes_registry() if all_processes_metrics else REGISTRY
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
