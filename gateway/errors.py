"""OpenAI-style errors, and the mapping from the engine's gRPC statuses to HTTP."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from taco_llm.protos.rich_status import details_of

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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def service_unavailable(message: str, *, retry_after: int = 1, code: str = "no_engine_ready") -> APIError:
    """A 503 the client may retry after `retry_after` seconds (Retry-After)."""
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, code=code,
                    headers={"Retry-After": str(max(1, retry_after))})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def from_grpc(error: grpc.aio.AioRpcError, param_names: Mapping[str, str] | None = None) -> APIError:
    """Turns a worker's gRPC status into the HTTP error vLLM's server gives for the same input.

    The status's rich details (protos/errors.proto) give the field and the reason; the message is only
    shown. `param_names` maps the proto field the worker names to the request field the client sent.
    """
    status = _GRPC_TO_HTTP.get(error.code(), 500)
    details = details_of(error)
    param = details.field
    if param and param_names:
        param = param_names.get(param, param)
    message = error.details() or error.code().name
    if status >= 500 and status != 503:
        message = f"the engine failed this request: {message}"
    code = "model_not_found" if status == 404 else None
    return APIError(status, message, param=param, code=code)


def from_validation(error: RequestValidationError) -> APIError:
    """A body that does not parse: vLLM's server answers 400 for it, not FastAPI's 422."""
    return bad_request(_validation_message(error), _validation_param(error))


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
