"""OpenAI-style errors, and the mapping from the engine's gRPC statuses to HTTP."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from taco_llm.protos.rich_status import details_of

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    500: "server_error",
    503: "service_unavailable",
}

_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    # A prompt longer than the context: vLLM's own server answers 400 for it.
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 408,
    grpc.StatusCode.CANCELLED: 499,
}


class APIError(Exception):
    """An error that reaches the client as OpenAI error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # Sent with the answer: Retry-After on a 503, when no worker can take the request yet.
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error"),
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def anthropic_body(self) -> dict[str, object]:
        """Anthropic's error shape, for the Messages API's routes. It has no `param`: the message
        starts with the field's name instead."""
        message = f"{self.param}: {self.message}" if self.param else self.message
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer to send; `path` (the route's, without a root path) picks the error's shape."""
        body = self.anthropic_body() if speaks_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers or None)


# The Messages API's routes: their errors take Anthropic's shape, whoever refuses the request.
ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    return path in ANTHROPIC_ROUTES


def service_unavailable(message: str, *, retry_after: int = 1, code: str = "no_engine_ready") -> APIError:
    """A 503 the client may retry after `retry_after` seconds (Retry-After)."""
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, code=code,
                    headers={"Retry-After": str(max(1, retry_after))})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


# Codes whose messages the worker writes for the client (a field out of range, a prompt too long, an
# unknown model...): shown as they are. Any other code's message may be the gRPC library's own (a
# socket error with the worker's address) or an engine's internals: it is logged, and the client is
# told what went wrong in its own terms (_SERVER_FAULTS).
_CLIENT_MESSAGE_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
})
_SERVER_FAULTS = {
    grpc.StatusCode.UNAVAILABLE: "no engine worker could be reached to serve this request; retry later",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the engine worker did not answer in time",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
    grpc.StatusCode.UNAUTHENTICATED: "the gateway could not authenticate to the engine worker "
                                     "(its --engine-api-key)",
    grpc.StatusCode.PERMISSION_DENIED: "the gateway is not allowed to call the engine worker",
}
_ENGINE_FAILED = "the engine failed while serving this request"


def client_message(error: grpc.aio.AioRpcError) -> str:
    """What a client may read of a worker's error: the worker's own message where it wrote it for the
    client; otherwise a description in the client's terms. Never an address or a library message."""
    code = error.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details_of(error).reason is None:
        # Not the worker's refusal (it names a reason) but gRPC's own: a message past its size limit.
        return "the request is too large to pass to the engine worker"
    if code in _CLIENT_MESSAGE_CODES:
        return error.details() or code.name
    return _SERVER_FAULTS.get(code, _ENGINE_FAILED)


def client_param(field: str, param_names: Mapping[str, str] | None) -> str:
    """The request field a worker's proto field path stands for: `chat.messages[2].content_parts[0]` is
    the client's `messages[2].content[0]`. The longest mapped prefix is replaced; then each later part
    named in `param_names` as `.part` (`.content_parts`) is renamed. A path with neither is shown as is."""
    if not param_names:
        return field
    if field in param_names:
        return param_names[field]
    best = ""
    for proto_name in param_names:
        if len(proto_name) > len(best) and field.startswith(proto_name) and field[len(proto_name)] in ".[":
            best = proto_name
    head, rest = (param_names[best], field[len(best):]) if best else ("", field)
    return head + re.sub(r"\.(\w+)", lambda part: "." + param_names.get(part.group(0), part.group(1)), rest)


def field_path(parts: Iterable[str | int]) -> str:
    """`messages[0].content`, as OpenAI names a field inside a request."""
    path = ""
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else f"{path}.{part}" if path else str(part)
    return path


def from_grpc(error: grpc.aio.AioRpcError, param_names: Mapping[str, str] | None = None) -> APIError:
    """Turns a worker's gRPC status into the HTTP error vLLM's server gives for the same input.

    The status's rich details (protos/errors.proto) give the field and the reason; the message is only
    shown, and only where the worker wrote it for the client (client_message). `param_names` maps the
    proto field the worker names to the request field the client sent.
    """
    code = error.code()
    status = _GRPC_TO_HTTP.get(code, 500)
    if code not in _CLIENT_MESSAGE_CODES:
        logger.warning("engine worker call failed: %s: %s", code.name, error.details())
    details = details_of(error)
    param = client_param(details.field, param_names) if details.field else None
    code_name = "model_not_found" if status == 404 else None
    return APIError(status, client_message(error), param=param, code=code_name)


def from_validation(error: RequestValidationError) -> APIError:
    """A body that does not parse: vLLM's server answers 400 for it, not FastAPI's 422."""
    return bad_request(_validation_message(error), _validation_param(error))


def _client_location(loc: Iterable[str | int], body: Any) -> list[str | int]:
    """The path of a field as the client wrote it. Pydantic puts the member of a union it tried into the
    location (`prompt.str`, `prompt.list[int]`); those are no keys of the body, so only the keys and indexes
    the body has are kept, and a last key it lacks (a missing field)."""
    parts = [part for part in loc if part != "body"]
    path: list[str | int] = []
    current = body
    for i, part in enumerate(parts):
        if isinstance(part, int):
            path.append(part)
            current = current[part] if isinstance(current, list) and 0 <= part < len(current) else None
        elif isinstance(current, dict) and part in current:
            path.append(part)
            current = current[part]
        elif i == len(parts) - 1 and (isinstance(current, dict) or (current is None and not path)):
            path.append(part)
    return path


def _validation_param(error: RequestValidationError) -> str | None:
    for item in error.errors():
        loc = _client_location(item.get("loc", ()), error.body)
        if loc:
            return field_path(loc)
    return None


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        loc = field_path(_client_location(item.get("loc", ()), error.body)) or "body"
        if item.get("type") == "json_invalid":
            ctx = item.get("ctx") or {}
            parts.append(f"the request body is not valid JSON: {ctx.get('error', item.get('msg'))}")
        else:
            parts.append(f"{loc}: {item.get('msg')}")
    # A union's members each report their own failure, which reads the same once their tags are gone.
    return "; ".join(dict.fromkeys(parts)) or "invalid request"
