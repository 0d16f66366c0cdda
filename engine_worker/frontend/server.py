"""The worker's grpc.aio server: the Engine service, gRPC health, and server reflection."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import multiprocess
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from taco_llm.grpc_decoding import RequestDecodingInterceptor
from taco_llm.grpc_security import add_port
from taco_llm.preflight import report_exit_reason
from taco_llm.protos import engine_pb2_grpc
from taco_llm.protos.engine_limits import ENGINE_SERVICE, GRPC_MESSAGE_LIMIT, KEEPALIVE_SERVER_OPTIONS

from .. import die_with_parent
from ..handoff import PROMETHEUS_MULTIPROC_DIR
from ..lookahead_settings import ConfigError, configure_lookahead
from ..vllm_internals import get_prometheus_registry
from .args import WorkerArgs
from .auth import ApiKeyInterceptor
from .cache_incarnation import CacheServiceIncarnation
from .drain import drain
from .engine import LoadTracker, resolve_default_model, start_engine
from .prefix_publisher import PrefixPublisher, PublishError, events_endpoint
from .registry import Registrar
from .service import EngineService
from .tracing import Tracing

logger = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    """A start-up that cannot go on; its message names the flag and says why."""


# Once the streams are done (or cut), calls still open (a GetLoad, a Tokenize) get this long to answer.
STOP_GRACE_SECONDS = 1.0
# How often the worker asks whether the engine is alive while no stream would tell it.
ENGINE_CHECK_SECONDS = 0.5
# How often the worker compares the engine's stall with --engine-stall-timeout.
PROGRESS_CHECK_SECONDS = 0.5


async def _watch_engine(engine: AsyncLLM, on_engine_dead: Callable[[], None]) -> None:
    """Calls on_engine_dead once the engine has died. A stream learns it from its own call, but an idle
    worker would otherwise go on answering SERVING with nothing behind it (vLLM's client notices the
    EngineCore process's death in a thread of its own and only marks the engine dead)."""
    while True:
        await asyncio.sleep(ENGINE_CHECK_SECONDS)
        try:
            await engine.check_health()
        except EngineDeadError:
            logger.error("the engine's processes have died; stopping (exit code 1) so that a supervisor restarts "
                         "this worker")
            on_engine_dead()
            return


async def _watch_progress(stalled_seconds: Callable[[], float], limit: float,
                          health_service: health.aio.HealthServicer) -> None:
    """NOT_SERVING on gRPC health (the server's and the Engine service's) while the engine has gone more
    than `limit` seconds without finishing a step with requests to run, SERVING again once it steps.
    The worker stays up and keeps its streams: a stall may end (a long step, a paused process), and a
    gateway decides what to do with streams on a worker that says NOT_SERVING. Cancelled before a drain,
    which then owns the health status."""
    stalled = False
    while True:
        await asyncio.sleep(PROGRESS_CHECK_SECONDS)
        seconds = stalled_seconds()
        if (seconds > limit) == stalled:
            continue
        stalled = not stalled
        if stalled:
            logger.warning("the engine has finished no step for %.1fs with requests to run (--engine-stall-timeout "
                           "%gs): NOT_SERVING until it does", seconds, limit)
        else:
            logger.warning("the engine is making progress again: SERVING")
        status = health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
        for name in ("", ENGINE_SERVICE):
            await health_service.set(name, status)


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
            raise WorkerStartError(str(error)) from None
    if args.metrics_port is not None:
        # Before the engine starts, so that its processes write their metrics where we can read them.
        registry = _metrics_registry()
    events_at = None
    if args.registry is not None and args.registry.publish_prefix_cache is not False:
        try:
            events_at = events_endpoint(args.engine, asked=bool(args.registry.publish_prefix_cache))
        except PublishError as error:
            raise WorkerStartError(str(error)) from None
    load = LoadTracker()
    die_with_parent.arm()  # before the engine's processes start: they must not outlive this one
    engine = start_engine(args.engine, load, prometheus=args.metrics_port is not None)
    served = _served_names(args)
    hurry = hurry or asyncio.Event()
    engine_died = asyncio.Event()

    def on_engine_dead() -> None:
        engine_died.set()
        hurry.set()  # nothing left to drain into

    tracing = Tracing(args.engine.otlp_traces_endpoint)
    cache_incarnation = (CacheServiceIncarnation(args.prefix_cache_service, args.cache_service_client)
                         if args.prefix_cache_service else None)
    service = EngineService(engine, served, on_engine_dead=on_engine_dead, frontend=args.frontend, load=load,
                            tracing=tracing, prefix_cache_service=args.prefix_cache_service or "",
                            metrics_port=args.metrics_port or 0, cache_incarnation=cache_incarnation)

    interceptors: list[grpc.aio.ServerInterceptor] = [*tracing.interceptors]
    if args.api_key:
        interceptors.append(ApiKeyInterceptor(args.api_key))
    interceptors.append(RequestDecodingInterceptor())  # after the key check: see taco_llm/grpc_decoding.py
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_SERVER_OPTIONS,  # gateways ping every 2 s to find partitions
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
        add_port(server, address, args.grpc_tls)  # TLS with --grpc-tls-*
    except RuntimeError as error:
        engine.shutdown()
        raise WorkerStartError(f"--grpc-host/--grpc-port: cannot listen on {address} ({error})") from None
    await server.start()
    if args.metrics_port is not None:
        try:
            prometheus_client.start_http_server(args.metrics_port, args.grpc_host, registry)
        except OSError as error:
            await server.stop(0)
            engine.shutdown()
            raise WorkerStartError(f"--metrics-port: cannot serve metrics on {args.grpc_host}:{args.metrics_port} "
                                   f"({error})") from None
    for name in ("", ENGINE_SERVICE):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"taco_llm worker: serving {', '.join(served)} over gRPC at {address}", flush=True)
    registrar = None
    publisher = None
    if args.registry is not None:
        worker_id = uuid.uuid4().hex
        if events_at is not None:
            # Before the record says so: a gateway that reads it finds the (empty) set already there.
            publisher = PrefixPublisher(args.registry.url, worker_id, ttl=args.registry.ttl, endpoint=events_at)
            await publisher.start()
            service.prefix_publisher = publisher
        registrar = Registrar(args.registry.url, args.registry.advertise_address, service.served_model_names,
                              ttl=args.registry.ttl, readdress=args.registry.current_address, worker_id=worker_id,
                              publishes_prefix_cache=publisher is not None)
        await registrar.start()

    stats_task = None
    if not args.engine.disable_log_stats:
        stats_task = asyncio.create_task(_log_stats(engine, args.log_stats_interval))
    watch_task = asyncio.create_task(_watch_engine(engine, on_engine_dead))
    progress_task = asyncio.create_task(
        _watch_progress(service.engine_stalled_seconds, args.engine_stall_timeout, health_service))
    incarnation_task = asyncio.create_task(cache_incarnation.run()) if cache_incarnation is not None else None
    stop_wait = asyncio.create_task(stop.wait())
    dead_wait = asyncio.create_task(engine_died.wait())
    await asyncio.wait({stop_wait, dead_wait}, return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down%s", " (the engine died)" if engine_died.is_set() else "")
    for task in (stop_wait, dead_wait, stats_task, watch_task, progress_task, incarnation_task):
        if task is not None:
            task.cancel()
    await drain(service.gate, service.cut_streams, health_service, registrar,
                timeout=float(args.engine.shutdown_timeout), hurry=hurry)
    await server.stop(STOP_GRACE_SECONDS)
    if publisher is not None:
        await publisher.stop()
    with contextlib.suppress(Exception):
        engine.shutdown()
    tracing.shutdown()
    if engine_died.is_set():
        report_exit_reason("the engine's processes died")
        return 1
    return 0
