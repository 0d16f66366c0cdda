"""`--api-key`: every HTTP route but /health wants `Authorization: Bearer KEY`.

A plain ASGI middleware (see metrics.py for why not BaseHTTPMiddleware). CORS preflight requests
(OPTIONS) pass, since browsers never send credentials on them; the CORS middleware answers them.
"""

from __future__ import annotations

import hmac
from typing import Any

from .errors import APIError

OPEN_PATHS = frozenset({"/health"})


def route_path(scope: dict[str, Any]) -> str:
    """The path the router matches: without the root path a proxy (or --root-path) put in front."""
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path != root:
        return path[len(root):]
    return path


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    def allowed(self, scope: dict[str, Any]) -> bool:
        if scope.get("method") == "OPTIONS" or route_path(scope) in OPEN_PATHS:
            return True
        token = bearer_token(scope.get("headers", []))
        # compare_digest: the time taken does not tell an attacker how much of a guess was right.
        return token is not None and hmac.compare_digest(token, self.expected)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        error = APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' (see --api-key).",
                         code="invalid_api_key")
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
