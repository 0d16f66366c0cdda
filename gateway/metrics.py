"""Prometheus metrics of the gateway, served at /metrics, recorded by a plain ASGI middleware.

A plain ASGI wrapper rather than Starlette's BaseHTTPMiddleware, which re-queues every chunk of a
streaming response through an extra task and memory stream: a cost paid per token.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "taco_llm_gateway_requests_total", "HTTP requests answered, by route and status", ["route", "status"]
)
LATENCY = Histogram(
    "taco_llm_gateway_response_head_seconds",
    "Time to the response head (for streams: until the first token is ready)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
           "/version", "/metrics"}


def observe_request(path: str, status: int, seconds: float) -> None:
    # Unknown paths share one label, so that a scan cannot grow the label set without bound.
    route = path if path in _ROUTES else "other"
    REQUESTS.labels(route, str(status)).inc()
    LATENCY.labels(route).observe(seconds)


class MetricsMiddleware:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope.get("path", "")

        async def send_and_observe(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                observe_request(path, message["status"], time.perf_counter() - start)
            await send(message)

        await self.app(scope, receive, send_and_observe)
