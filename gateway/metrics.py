"""Prometheus metrics of the gateway, served at /metrics, recorded by a plain ASGI middleware and by the
router and the streams.

Every metric lives in the gateway's own registry, not prometheus_client's global one: with
--disable-frontend-multiprocessing the worker's vLLM shares this process, and its `vllm:` metrics of the
same names would collide. vLLM's names are used where vLLM has the same measure (TTFT, inter-token
latency, end-to-end latency, tokens, finished requests), so dashboards made for vLLM read the gateway.

With --api-server-count N > 1 every process writes its values to files in PROMETHEUS_MULTIPROC_DIR
(prometheus_client's multiprocess mode, set up by the parent before the children import this module) and
/metrics renders `all_processes_registry`, which adds them up: counters and histograms sum; the worker
gauges take the worst (circuit state), the least (ready) or the highest (load) of the processes' views.

A plain ASGI wrapper rather than Starlette's BaseHTTPMiddleware, which re-queues every chunk of a
streaming response through an extra task and memory stream: a cost paid per token.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "taco_llm_gateway_requests_total", "HTTP requests answered, by route and status", ["route", "status"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "taco_llm_gateway_response_head_seconds",
    "Time to the response head (for streams: until the first token is ready)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
TIME_TO_FIRST_TOKEN = Histogram(
    "vllm:time_to_first_token_seconds", "Time from the request's arrival to its first output token",
    ["model_name"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "vllm:inter_token_latency_seconds", "Time between two engine messages of a stream, per output token",
    ["model_name"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
E2E_LATENCY = Histogram(
    "vllm:e2e_request_latency_seconds", "Time from the request's arrival to its last output token",
    ["model_name"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "vllm:prompt_tokens", "Prompt tokens of finished requests", ["model_name"], registry=REGISTRY,
)
GENERATION_TOKENS = Counter(
    "vllm:generation_tokens", "Output tokens relayed to clients", ["model_name"], registry=REGISTRY,
)
REQUEST_SUCCESS = Counter(
    "vllm:request_success", "Generate requests that finished, by finish reason", ["model_name", "finished_reason"],
    registry=REGISTRY,
)

# Routing: policy is round_robin, least_load or cache_aware; reason says why this worker won
# (prefix_match, shared_cache, balance, least_load, round_robin, ...).
ROUTING_DECISIONS = Counter(
    "taco_llm_router_decisions", "Workers chosen for requests, by policy and reason", ["policy", "reason"],
    registry=REGISTRY,
)
# The routing prefix-hit rate is hit_chunks / lookup_chunks: the share of the prompts' prefix chunks that
# the chosen worker was believed to hold (cache_aware only).
PREFIX_LOOKUP_CHUNKS = Counter(
    "taco_llm_router_prefix_lookup_chunks", "Prefix chunks of routed prompts (cache_aware)", registry=REGISTRY,
)
PREFIX_VIEW_LOOKUPS = Counter(
    "taco_llm_router_prefix_view_lookups",
    "Workers' prefix matches by where they came from: shared (what the worker published that its KV cache "
    "holds) or approximate (what this gateway sent it)", ["view"], registry=REGISTRY,
)
PREFIX_HIT_CHUNKS = Counter(
    "taco_llm_router_prefix_hit_chunks",
    "Prefix chunks the chosen worker was believed to hold, on the worker or in its shared cache service",
    ["where"], registry=REGISTRY,
)
RETRIES = Counter(
    "taco_llm_router_retries", "Requests sent again to another worker before their first token, by gRPC code",
    ["code"], registry=REGISTRY,
)
MIGRATIONS = Counter(
    "taco_llm_router_migrations", "Streams continued on another worker after theirs failed, by outcome",
    ["outcome"], registry=REGISTRY,
)
CIRCUIT_STATE = Gauge(
    "taco_llm_worker_circuit_state", "Each worker's circuit breaker: 0 closed, 1 half-open, 2 open", ["worker"],
    registry=REGISTRY, multiprocess_mode="livemax",
)
WORKER_READY = Gauge(
    "taco_llm_worker_ready", "1 while the worker is in the pool and serving, else 0", ["worker"], registry=REGISTRY,
    multiprocess_mode="livemin",
)
WORKER_LOAD = Gauge(
    "taco_llm_worker_load",
    "Each worker's load: running and waiting requests and KV-cache usage (from GetLoad), and this "
    "gateway's streams on it", ["worker", "kind"], registry=REGISTRY, multiprocess_mode="livemax",
)

def all_processes_registry() -> CollectorRegistry:
    """A registry of every API server process's metrics, read afresh from PROMETHEUS_MULTIPROC_DIR."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry


def _can_add_counts(child: Any) -> bool:
    """Whether this prometheus_client's histogram child has the parts BatchedObserver adds counts to: its
    bucket bounds, and bucket and sum values with inc(). prometheus_client has no public way to add n
    observations at once; if a later release moves these, BatchedObserver observes one by one instead."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    return (isinstance(bounds, list) and isinstance(buckets, list) and len(buckets) == len(bounds)
            and all(hasattr(b, "inc") for b in buckets) and hasattr(total, "inc"))


class BatchedObserver:
    """A histogram child observed per engine message: counted here and added to the child every
    FLUSH_EVERY observations (and by `flush`), since Histogram.observe takes a lock and scans the buckets
    in Python for each value. The counts are the same; a scrape may see the last few late. Where the
    child lacks the parts this needs (_can_add_counts), each value is observed at once."""

    FLUSH_EVERY = 64
    __slots__ = ("_batched", "_bounds", "_child", "_counts", "_sum", "_unflushed")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        self._batched = _can_add_counts(child)
        self._bounds: list[float] = child._upper_bounds if self._batched else []
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._unflushed = 0

    def observe(self, value: float) -> None:
        if not self._batched:
            self._child.observe(value)
            return
        # The first bucket whose upper bound is at least the value, as Histogram.observe picks.
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value
        self._unflushed += 1
        if self._unflushed >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._unflushed:
            return
        buckets = self._child._buckets
        for i, count in enumerate(self._counts):
            if count:
                buckets[i].inc(count)
                self._counts[i] = 0
        self._child._sum.inc(self._sum)
        self._sum = 0.0
        self._unflushed = 0


_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
           "/version", "/metrics", "/metrics/targets"}


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
