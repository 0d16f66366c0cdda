"""The worker's grpc.aio server: the Engine service, gRPC health, and server reflection."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import tempfile

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import multiprocess
from vllm.v1.engine.async_llm import AsyncLLM

from taco_llm.protos import engine_pb2_grpc
from taco_llm.protos.engine_limits import ENGINE_SERVICE, GRPC_MESSAGE_LIMIT

from ..handoff import PROMETHEUS_MULTIPROC_DIR
from ..lookahead_settings import ConfigError, configure_lookahead
from ..vllm_internals import get_prometheus_registry
from .args import WorkerArgs
from .auth import ApiKeyInterceptor
from .drain import drain
from .engine import LoadTracker, resolve_default_model, start_engine
from .registry import Registrar
from .service import EngineService
from .tracing import Tracing

logger = logging.getLogger(__name__)

# Once the streams are done (or cut), calls still open (a GetLoad, a Tokenize) get this long to answer.
STOP_GRACE_SECONDS = 1.0


async def _log_stats(engine: AsyncLLM, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await engine.do_log_stats()


def _metrics_registry() -> prometheus_client.CollectorRegistry:
    """Where /metrics reads from: this process's metrics (vLLM's stat logger runs here) and those the
    engine's processes write to files (the lookahead proposer's). Called before the engine starts."""
    if os.environ.get(PROMETHEUS_MULTIPROC_DIR):
        # Set by the user before vLLM imported prometheus_client: every process writes files.
        return get_prometheus_registry()
    # Our own folder rather than vLLM's setup_multiprocess_prometheus, whose clean-up at exit fails
    # on its TemporaryDirectory object and logs an error on every shutdown.
    folder = tempfile.mkdtemp(prefix="taco_llm_metrics_")
    atexit.register(shutil.rmtree, folder, True)
    os.environ[PROMETHEUS_MULTIPROC_DIR] = folder
    multiprocess.MultiProcessCollector(prometheus_client.REGISTRY)
    return prometheus_client.REGISTRY


def _served_names(args: WorkerArgs) -> list[str]:
    return list(args.engine.served_model_name or [args.engine.model])


async def serve(args: WorkerArgs, stop: asyncio.Event, *, hurry: asyncio.Event | None = None) -> int:
    """Runs the worker until `stop` is set, then drains it (until `hurry` is set, at the latest)."""
    if args.uses_default_model:
        resolve_default_model(args.engine)
    if args.lookahead is not None:
        try:
            configure_lookahead(args.lookahead, args.engine, _served_names(args)[0],
                                getattr(args, "cache_service", None))
        except ConfigError as error:
            logger.error("%s", error)
            return 1
    if args.metrics_port is not None:
        # Before the engine starts, so that its processes write their metrics where we can read them.
        registry = _metrics_registry()
    load = LoadTracker()
    engine = start_engine(args.engine, load, prometheus=args.metrics_port is not None)
    served = _served_names(args)
    hurry = hurry or asyncio.Event()
    engine_died = asyncio.Event()

    def on_engine_dead() -> None:
        engine_died.set()
        hurry.set()  # nothing left to drain into

    tracing = Tracing(args.engine.otlp_traces_endpoint)
    service = EngineService(engine, served, on_engine_dead=on_engine_dead, frontend=args.frontend, load=load,
                            tracing=tracing, prefix_cache_service=args.prefix_cache_service or "",
                            metrics_port=args.metrics_port or 0)

    interceptors: list[grpc.aio.ServerInterceptor] = [*tracing.interceptors]
    if args.api_key:
        interceptors.append(ApiKeyInterceptor(args.api_key))
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.so_reuseport", 0),
    ], interceptors=interceptors or None)
    engine_pb2_grpc.add_EngineServicer_to_server(service, server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    reflection.enable_server_reflection(
        (ENGINE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{args.grpc_host}:{args.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as error:
        engine.shutdown()
        logger.error("cannot listen on %s (--grpc-host/--grpc-port): %s", address, error)
        return 1
    await server.start()
    if args.metrics_port is not None:
        try:
            prometheus_client.start_http_server(args.metrics_port, args.grpc_host, registry)
        except OSError as error:
            logger.error("cannot serve metrics on %s:%d (--metrics-port): %s", args.grpc_host, args.metrics_port,
                         error)
            await server.stop(0)
            engine.shutdown()
            return 1
    for name in ("", ENGINE_SERVICE):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"taco_llm worker: serving {', '.join(served)} over gRPC at {address}", flush=True)
    registrar = None
    if args.registry is not None:
        registrar = Registrar(args.registry.url, args.registry.advertise_address, service.served_model_names,
                              ttl=args.registry.ttl)
        await registrar.start()

    stats_task = None
    if not args.engine.disable_log_stats:
        stats_task = asyncio.create_task(_log_stats(engine, args.log_stats_interval))
    stop_wait = asyncio.create_task(stop.wait())
    dead_wait = asyncio.create_task(engine_died.wait())
    await asyncio.wait({stop_wait, dead_wait}, return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down%s", " (the engine died)" if engine_died.is_set() else "")
    for task in (stop_wait, dead_wait, stats_task):
        if task is not None:
            task.cancel()
    await drain(service.gate, service.cut_streams, health_service, registrar,
                timeout=float(args.engine.shutdown_timeout), hurry=hurry)
    await server.stop(STOP_GRACE_SECONDS)
    with contextlib.suppress(Exception):
        engine.shutdown()
    tracing.shutdown()
    return 1 if engine_died.is_set() else 0
