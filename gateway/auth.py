"""API keys, tenants and rate limits at the door: every HTTP route but /health wants
`Authorization: Bearer KEY` when keys are configured (--api-key, --api-keys-file), and each request is
counted against its tenant's rate limits (rate_limits.py).

The request's tenant (tenants.Tenant) is put on the ASGI scope's state (`request.state.tenant` in a
handler), for the server-side cache_salt (tenants.cache_salt, applied by `isolated_cache_salt`).

A plain ASGI middleware (see metrics.py for why not BaseHTTPMiddleware). CORS preflight requests
(OPTIONS) pass, since browsers never send credentials on them; the CORS middleware answers them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from .errors import APIError
from .rate_limits import Admission, RateLimiter
from .tenants import ANONYMOUS, ApiKeys, Tenant, cache_salt

OPEN_PATHS = frozenset({"/health"})
TENANT_STATE = "tenant"
# Whether this app salts each tenant's prompts apart (--tenant-isolation with named tenants).
ISOLATION_STATE = "tenant_isolation"


def route_path(scope: Mapping[str, Any]) -> str:
    """The path the router matches: without the root path a proxy (or --root-path) put in front."""
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path != root:
        return path[len(root):]
    return path


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request presents: `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` (its SDK
    sends that one) where there is no Authorization header."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    for name, value in headers:
        if name.lower() == b"x-api-key":
            return value.strip()
    return None


class ApiKeyMiddleware:
    """`keys`: the accepted keys (None or empty: no key wanted); `limiter`: the rate limits (None: none);
    `isolation`: whether the handlers salt each tenant's KV apart (app.state.tenant_isolation)."""

    def __init__(self, app: Any, keys: ApiKeys | None = None, limiter: RateLimiter | None = None,
                 isolation: bool = False):
        self.app = app
        self.keys = keys or None
        self.limiter = limiter
        self.isolation = isolation

    def tenant(self, scope: dict[str, Any]) -> Tenant | None:
        if self.keys is None:
            return ANONYMOUS
        token = bearer_token(scope.get("headers", []))
        return None if token is None else self.keys.tenant_of(token)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS"
                or route_path(scope) in OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        tenant = self.tenant(scope)
        if tenant is None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            error = APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' or "
                                  "'x-api-key: <key>' (see --api-key and --api-keys-file).", code="invalid_api_key")
            error.headers["WWW-Authenticate"] = "Bearer"
            await error.response(route_path(scope))(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state[TENANT_STATE] = tenant
        state[ISOLATION_STATE] = self.isolation
        if self.limiter is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            admission = self.limiter.admit(tenant)
        except APIError as refusal:
            await refusal.response(route_path(scope))(scope, receive, send)
            return
        await self._admitted(admission, scope, receive, send)

    async def _admitted(self, admission: Admission, scope: dict[str, Any], receive: Any, send: Any) -> None:
        extra = [(name.encode(), value.encode()) for name, value in admission.headers.items()]

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and extra:
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        token = admission.charge_tokens_here()
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            Admission.done(token)


def tenant_of(request: Request) -> Tenant | None:
    """The request's tenant, as the middleware found it; None where the app wants no key."""
    tenant = request.scope.get("state", {}).get(TENANT_STATE)
    return tenant if isinstance(tenant, Tenant) else None


def require_operator(request: Request, action: str) -> None:
    """Changes to the whole fleet are the operator's: where keys name tenants, only a key of the default
    tenant (a plain --api-key, or VLLM_API_KEY) may make them; a named tenant's key gets 403."""
    tenant = tenant_of(request)
    if tenant is not None and tenant.name:
        raise APIError(403, f"{action} changes the whole fleet: only the operator's key (a plain --api-key, "
                            f"of no tenant) may do it, not {tenant.label}'s", code="permission_denied")


def isolated_cache_salt(request: Request, client_salt: str | None) -> str | None:
    """The cache_salt a generation request is sent with: under --tenant-isolation the tenant's own
    (tenants.cache_salt), else the client's."""
    tenant = tenant_of(request)
    if not request.scope.get("state", {}).get(ISOLATION_STATE) or tenant is None:
        return client_salt
    return cache_salt(tenant, client_salt)
