"""Prometheus metrics of the gateway, served at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "taco_llm_gateway_requests_total", "HTTP requests answered, by route and status", ["route", "status"]
)
LATENCY = Histogram(
    "taco_llm_gateway_request_seconds",
    "Time to the response head (streams: until the first token is ready)",
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
