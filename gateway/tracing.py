"""OpenTelemetry traces of the gateway (--otlp-traces-endpoint, as vLLM's flag).

With an endpoint, each HTTP request gets a server span (FastAPI's instrumentation), and each call to a
worker a client span whose context travels to the worker as W3C `traceparent` gRPC metadata, where the
worker's interceptor continues the trace (engine_worker/frontend/tracing.py). The request's span also
carries how it was routed: the policy, its reason, the worker, the prefix match, retries and migrations.

The gRPC side instruments grpc.aio's channel factories for the whole process, so it must be installed
before the pool makes its channels (the pool makes them in its start, in the app's lifespan, after
create_app). Only the Engine's per-request calls are traced: health and load polls would otherwise each
make a root span every half second per worker.

The provider is the gateway's own, passed to each instrumentation, never made the global one: with
--disable-frontend-multiprocessing vLLM shares the process and sets its own global provider.

Without an endpoint nothing is installed; a request then pays one context-variable read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from taco_llm.protos.engine_limits import ENGINE_SERVICE

if TYPE_CHECKING:
    from fastapi import FastAPI

    from .routing import Route

logger = logging.getLogger(__name__)

SERVICE_NAME = "taco-llm-gateway"
# The Engine calls made on a request's behalf; the rest (GetModelInfo, GetLoad, Abort) are the pool's.
_TRACED_METHODS = ("Generate", "Tokenize", "Detokenize")


def current_span() -> trace.Span:
    """The request's span; a non-recording one when tracing is off."""
    return trace.get_current_span()


def annotate(span: trace.Span, route: Route | None, *, retries: int, migrations: int) -> None:
    """Puts how a request was routed on its span (a no-op when tracing is off)."""
    if not span.is_recording():
        return
    attributes: dict[str, Any] = {"taco_llm.retries": retries, "taco_llm.migrations": migrations}
    if route is not None:
        attributes.update({
            "taco_llm.routing.policy": route.policy,
            "taco_llm.routing.reason": route.reason,
            "taco_llm.routing.prefix_match": route.prefix_match,
            "taco_llm.worker.address": route.client.address,
        })
    span.set_attributes(attributes)


def install_tracing(app: FastAPI, endpoint: str | None) -> None:
    """Sends the app's traces to `endpoint` (OTLP/gRPC); None: does nothing."""
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, filters
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    # As vLLM builds its exporter for the same flag: OTLP over gRPC, plain text (a local collector).
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    # No spans for each ASGI receive and send: a streamed answer sends once per token.
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, excluded_urls="/health,/metrics",
                                       exclude_spans=["receive", "send"])
    grpc_client = GrpcAioInstrumentorClient(filter_=filters.all_of(
        filters.service_name(ENGINE_SERVICE), filters.any_of(*map(filters.method_name, _TRACED_METHODS))))
    if grpc_client.is_instrumented_by_opentelemetry:
        # Another app of this process (a test) installed it with its own provider.
        grpc_client.uninstrument()
    grpc_client.instrument(tracer_provider=provider)
    _flush_on_shutdown(app, provider)
    logger.info("sending traces to %s (--otlp-traces-endpoint)", endpoint)


def _flush_on_shutdown(app: FastAPI, provider: Any) -> None:
    """Wraps the app's lifespan so that the spans still queued are sent once it ends."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        try:
            async with inner(app) as state:
                yield state
        finally:
            # The export blocks (it sends over gRPC): off the event loop.
            await asyncio.to_thread(provider.shutdown)

    app.router.lifespan_context = lifespan
