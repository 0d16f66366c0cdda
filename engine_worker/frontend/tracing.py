"""OpenTelemetry traces of the worker (vLLM's --otlp-traces-endpoint).

The gateway sends its trace context (W3C traceparent) in each call's gRPC metadata. The server
interceptor made here opens the worker's span of the call as that context's child, and Generate hands
the span's context on to vLLM (`trace_headers`), whose own request span then joins the same trace. So one
trace runs from the gateway's HTTP request through this worker to the engine.

vLLM sets up its own tracer provider for its spans (and makes it the global one); the worker's provider
is separate, named `taco-llm-worker`, and passed to the interceptor explicitly. Without the flag nothing
here runs and calls carry no tracing cost.
"""

from __future__ import annotations

import logging

import grpc
from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

logger = logging.getLogger(__name__)

WORKER_SERVICE_NAME = "taco-llm-worker"


class Tracing:
    """The worker's tracer provider and its gRPC server interceptor; `None` endpoint: tracing off."""

    def __init__(self, endpoint: str | None):
        self.provider: TracerProvider | None = None
        self.interceptors: list[grpc.aio.ServerInterceptor] = []
        if endpoint is None:
            return
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: WORKER_SERVICE_NAME}))
        # As vLLM builds its exporter for the same flag: OTLP over gRPC, plain text (a local collector).
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
        # Probes poll the health service every half second: spans of those would drown the requests'.
        self.interceptors.append(aio_server_interceptor(
            tracer_provider=self.provider, filter_=filters.negate(filters.health_check())))
        logger.info("sending traces to %s (--otlp-traces-endpoint)", endpoint)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def trace_headers(self) -> dict[str, str] | None:
        """The current span's context as W3C headers, for vLLM's request span; None when tracing is off
        (vLLM warns about headers it cannot use)."""
        if not self.enabled:
            return None
        headers: dict[str, str] = {}
        propagate.inject(headers)
        return headers or None

    def shutdown(self) -> None:
        """Sends the spans still queued; called once the server has stopped."""
        if self.provider is not None:
            self.provider.shutdown()
