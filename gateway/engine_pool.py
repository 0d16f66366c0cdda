"""The engine workers behind the gateway: their health, the models they serve, and routing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.protos import engine_pb2, engine_pb2_grpc
from taco_llm.protos.engine_limits import ENGINE_SERVICE, GRPC_MESSAGE_LIMIT

from .errors import APIError

logger = logging.getLogger(__name__)

# Long prompts and many logprobs make big messages; the gRPC default of 4 MiB is too small.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's default reconnect backoff grows to 120 s; a worker that is starting or restarting should
    # be found within a couple of seconds.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
MISSED_CHECKS_BEFORE_UNREADY = 3


@dataclass(eq=False)
class EngineClient:
    """One engine worker, seen from the gateway."""

    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    info: engine_pb2.ModelInfo | None = None
    ready: bool = False
    in_flight: int = 0
    missed_checks: int = 0
    last_error: str = field(default="", repr=False)
    # Sent on the gateway's own calls (GetModelInfo), for workers started with --api-key.
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @classmethod
    def connect(cls, address: str, metadata: tuple[tuple[str, str], ...] = ()) -> EngineClient:
        channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return cls(address, channel, engine_pb2_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel),
                   metadata=metadata)

    def serves(self, model: str) -> bool:
        return self.info is not None and model in self.info.served_model_names

    async def refresh(self, timeout: float) -> None:
        try:
            reply = await self.health.Check(
                health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=timeout, wait_for_ready=True
            )
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving and self.info is None:
                self.info = await self.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=timeout,
                                                         metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            self.last_error = f"{error.code().name}: {error.details()}"
            self.missed_checks += 1
            # A busy worker can miss a health deadline; only a refused connection, or several misses
            # in a row, take it out of rotation.
            serving = (self.ready and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                       and self.missed_checks < MISSED_CHECKS_BEFORE_UNREADY)
        else:
            self.missed_checks = 0
        if serving != self.ready:
            logger.info("engine %s is %s", self.address, "ready" if serving else "not ready")
        if not serving:
            # A worker that restarts may come back with another model or other limits.
            self.info = None
        self.ready = serving


class EnginePool:
    """Routes each request to the least-busy ready worker that serves its model."""

    def __init__(self, addresses: Sequence[str], health_interval: float = 1.0,
                 metadata: tuple[tuple[str, str], ...] = ()):
        if not addresses:
            raise ValueError("at least one --engine HOST:PORT is needed")
        self.addresses = list(addresses)
        # Channels belong to the event loop that creates them: made in start(), on the server's loop.
        self.clients: list[EngineClient] = []
        self.health_interval = health_interval
        self.metadata = metadata
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.clients = [EngineClient.connect(a, self.metadata) for a in self.addresses]
        await self.refresh()
        self._task = asyncio.create_task(self._watch(), name="engine-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(c.channel.close() for c in self.clients), return_exceptions=True)

    async def refresh(self) -> None:
        timeout = max(self.health_interval, 1.0)
        await asyncio.gather(*(c.refresh(timeout) for c in self.clients))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.refresh()
            except Exception:  # the watcher must outlive any one failure
                logger.exception("engine health check failed")

    def ready_clients(self) -> list[EngineClient]:
        return [c for c in self.clients if c.ready and c.info is not None]

    def default_model(self) -> str:
        for client in self.ready_clients():
            assert client.info is not None
            return client.info.served_model_names[0]
        raise self.unavailable()

    def models(self) -> list[tuple[str, engine_pb2.ModelInfo]]:
        """Every served name once, with the info of a worker serving it."""
        seen: dict[str, engine_pb2.ModelInfo] = {}
        for client in self.ready_clients():
            assert client.info is not None
            for name in client.info.served_model_names:
                seen.setdefault(name, client.info)
        return list(seen.items())

    def pick(self, model: str | None) -> EngineClient:
        ready = self.ready_clients()
        if not ready:
            raise self.unavailable()
        if model:
            candidates = [c for c in ready if c.serves(model)]
            if not candidates:
                raise APIError(
                    404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
                )
        else:
            candidates = ready
        least = min(c.in_flight for c in candidates)
        return random.choice([c for c in candidates if c.in_flight == least])

    def unavailable(self) -> APIError:
        details = "; ".join(f"{c.address}: {c.last_error or 'starting'}" for c in self.clients)
        return APIError(503, f"No engine worker is ready ({details}).", code="no_engine_ready")
