"""Middleware for `--middleware` tests: one http function, one ASGI class; each marks its responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response


async def mark_function(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    response = await call_next(request)
    response.headers["x-sample-function"] = request.url.path
    return response


class MarkClass:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def marked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-sample-class", b"yes")]
            await send(message)

        await self.app(scope, receive, marked if scope["type"] == "http" else send)


NOT_MIDDLEWARE = 42
