"""The limits on a request's size and shape, checked before FastAPI and pydantic see it.

A plain ASGI middleware (see metrics.py for why not BaseHTTPMiddleware). It refuses, with OpenAI error
JSON:
- headers larger than --max-header-bytes (431), before anything else is read;
- a body larger than --max-request-body-bytes (413): up front from Content-Length, and otherwise while
  it arrives, so that an endless chunked body is never held whole;
- a JSON body that is not UTF-8, not JSON, nested deeper than --max-json-depth, or holding a lone UTF-16
  surrogate ("\\ud800"), which no protobuf string (nor any UTF-8 text) can carry (400).

FastAPI would answer the first three of the last group with its own 400 ({"detail": ...}, not OpenAI's
shape) and let the surrogate through to fail in the conversion to the worker's request. The body, once
checked, is handed on unchanged; FastAPI parses it again, which costs far less than the request itself.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from .args import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_PROMPTS_PER_BATCH,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
)
from .auth import route_path
from .errors import APIError, field_path

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# A key longer than this is shortened where an error names it: the client sent it, the error echoes it.
_SHOWN_KEY_CHARS = 64


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """--max-request-body-bytes, --max-header-bytes, --max-json-depth, --max-prompts-per-batch."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_prompts_per_batch: int = DEFAULT_MAX_PROMPTS_PER_BATCH

    def __post_init__(self) -> None:
        for flag, value in (("--max-request-body-bytes", self.max_request_body_bytes),
                            ("--max-header-bytes", self.max_header_bytes),
                            ("--max-json-depth", self.max_json_depth),
                            ("--max-prompts-per-batch", self.max_prompts_per_batch)):
            if value < 1:
                raise ValueError(f"{flag} must be 1 or more, not {value}")


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    """The headers' size as sent: each `name: value` line with its CRLF."""
    return sum(len(name) + len(value) + 4 for name, value in headers)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before the app sees it
    return None


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether FastAPI would read the body as JSON: no content type, or a JSON one."""
    for name, value in headers:
        if name.lower() == b"content-type":
            media = value.partition(b";")[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True


def _child(path: str, key: str | int) -> str:
    if isinstance(key, str) and len(key) > _SHOWN_KEY_CHARS:
        key = key[:_SHOWN_KEY_CHARS] + "..."
    return field_path((path, key)) if path else field_path((key,))


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json(value: Any, max_depth: int) -> None:
    """Raises a 400 naming the first place where `value` (parsed JSON) nests deeper than `max_depth`
    containers, or holds a string (or key) with a lone surrogate. Iterative: depth costs no recursion."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                raise APIError(HTTPStatus.BAD_REQUEST, f"{path or 'the request body'} holds a lone UTF-16 "
                               "surrogate (a \\ud800-\\udfff escape without its pair), which is not text",
                               param=path or None)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth >= max_depth:
            raise _too_deep(path, max_depth)
        if isinstance(item, dict):
            for key, child in item.items():
                child_path = _child(path, key)
                if _has_lone_surrogate(key):
                    raise APIError(HTTPStatus.BAD_REQUEST, f"a key in {path or 'the request body'} holds a lone "
                                   "UTF-16 surrogate, which is not text", param=path or None)
                stack.append((child, child_path, depth + 1))
        else:
            stack.extend((child, _child(path, i), depth + 1) for i, child in enumerate(item))


def _too_deep(path: str, max_depth: int) -> APIError:
    where = f" at {path}" if path else ""
    # The field the client sent is the first part of the path; deeper parts would only repeat "[0]".
    field = path.split("[", 1)[0].split(".", 1)[0] or None
    return APIError(HTTPStatus.BAD_REQUEST, f"the request body is nested deeper than {max_depth} levels{where} "
                    "(the server's --max-json-depth)", param=field, code="json_too_deep")


def check_body(body: bytes, max_depth: int) -> None:
    """The JSON body's checks: UTF-8, JSON, depth, no lone surrogates; raises a 400."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, f"the request body is not valid UTF-8 (byte {error.start}): "
                       "JSON must be sent as UTF-8", code="invalid_utf8") from None
    try:
        value = json.loads(text)
    except RecursionError:
        # Nested far past any limit: the parser gave up before the walk could say where.
        raise _too_deep("", max_depth) from None
    except ValueError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {error}",
                       code="invalid_json") from None
    check_json(value, max_depth)


def _too_large(limit: int) -> APIError:
    return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"the request body is larger than {limit} bytes (the server's --max-request-body-bytes)",
                    code="request_too_large")


class RequestLimitsMiddleware:
    def __init__(self, app: Any, limits: RequestLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        limits = self.limits
        size = header_bytes(headers)
        if size > limits.max_header_bytes:
            await APIError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                           f"the request headers are {size} bytes, more than {limits.max_header_bytes} "
                           "(the server's --max-header-bytes)", code="headers_too_large").response(route_path(scope))(
                scope, receive, send)
            return
        length = _content_length(headers)
        if length is not None and length > limits.max_request_body_bytes:
            # Refused before a byte of it is read (and before uvicorn sends `100 Continue`).
            await _too_large(limits.max_request_body_bytes).response(route_path(scope))(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            body, disconnected = await _read_body(receive, limits.max_request_body_bytes)
            if body and not disconnected and _is_json(headers):
                check_body(body, limits.max_json_depth)
        except APIError as error:
            await error.response(route_path(scope))(scope, receive, send)
            return
        await self.app(scope, _replay(body, disconnected, receive), send)


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The whole body, counted as it arrives; (body, whether the client left before sending it all)."""
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunk: bytes = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, disconnected: bool, receive: Receive) -> Receive:
    """A `receive` that gives the body already read as one message, then whatever the client sends next
    (the app watches for its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if disconnected:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
