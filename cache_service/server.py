"""The cache service's grpc.aio server: its servicers, the gRPC health service, and reflection."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from taco_llm.grpc_decoding import RequestDecodingInterceptor
from taco_llm.grpc_security import ApiKeyInterceptor, add_port
from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc, lookahead_pb2, lookahead_pb2_grpc

# One limit for every service of this server, the lookahead index's too.
from taco_llm.protos.engine_limits import KEEPALIVE_SERVER_OPTIONS
from taco_llm.protos.kv_cache_limits import GRPC_MESSAGE_LIMIT

from .config import CacheServiceConfig
from .kv_servicer import KVBlockStoreServicer
from .lookahead_servicer import LookaheadIndexServicer

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECONDS = 5.0


@dataclass
class Servicer:
    """One service this process offers: its full proto name, and how to add it to the server."""

    name: str
    add_to_server: Callable[[grpc.aio.Server], None]
    # Releases what the servicer holds (window file descriptors, Redis connections) once the server
    # has stopped taking calls.
    close: Callable[[], Awaitable[None]]


def servicers(config: CacheServiceConfig, incarnation: str) -> list[Servicer]:
    """Every service of the cache service, in one place. Each gets the whole config; `incarnation` names
    this run (StatsResponse.incarnation)."""
    kv = KVBlockStoreServicer(config, incarnation=incarnation)
    lookahead = LookaheadIndexServicer(config.redis_url)
    return [
        Servicer(kv_cache_pb2.DESCRIPTOR.services_by_name["KVBlockStore"].full_name,
                 lambda server: kv_cache_pb2_grpc.add_KVBlockStoreServicer_to_server(kv, server), kv.close),
        Servicer(lookahead_pb2.DESCRIPTOR.services_by_name["LookaheadIndex"].full_name,
                 lambda server: lookahead_pb2_grpc.add_LookaheadIndexServicer_to_server(lookahead, server),
                 lookahead.close),
    ]


async def serve(config: CacheServiceConfig, stop: asyncio.Event) -> int:
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [ApiKeyInterceptor(config.api_key, flag="the cache service's --api-key")] if config.api_key else [])
    interceptors.append(RequestDecodingInterceptor())  # after the key check: see taco_llm/grpc_decoding.py
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.so_reuseport", 0),
        # Workers ping every 2 s to find a service cut off: taken, not answered with GOAWAY too_many_pings.
        *KEEPALIVE_SERVER_OPTIONS,
    ], interceptors=interceptors or None)
    # Drawn at every start: the blocks live in this process's memory, so a new run starts empty, and
    # workers and gateways tell a restart from an outage by this id changing.
    incarnation = uuid.uuid4().hex
    offered = servicers(config, incarnation)
    for servicer in offered:
        servicer.add_to_server(server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    names = [s.name for s in offered]
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{config.grpc_host}:{config.grpc_port}"
    try:
        add_port(server, address, config.grpc_tls)
    except RuntimeError as error:
        logger.error("cannot listen on %s (--grpc-host/--grpc-port): %s", address, error)
        return 1
    await server.start()
    for name in ("", *names):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    security = ", ".join([*(["mutual TLS" if config.grpc_tls.client_ca else "TLS"] if config.grpc_tls else []),
                          *(["API key"] if config.api_key else [])]) or "plain text, no key"
    print(f"taco_llm cache-service: serving {', '.join(names)} over gRPC at {address} ({security}; "
          f"KV budget {config.kv_budget_bytes} bytes; incarnation {incarnation})", flush=True)
    await stop.wait()
    logger.info("shutting down")
    await health_service.enter_graceful_shutdown()
    await server.stop(SHUTDOWN_GRACE_SECONDS)
    for servicer in offered:
        await servicer.close()
    return 0
