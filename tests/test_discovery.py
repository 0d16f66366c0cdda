"""The gateway's pool membership: workers registered in a real Redis join and leave it, and health checks
take dead, cut-off and NOT_SERVING workers out of rotation in time.

The workers are tiny in-process gRPC servers with just Health and Engine.GetModelInfo/GetLoad: this
tests the gateway's membership, not the engine.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.gateway.engine_pool import EngineClient, EnginePool
from taco_llm.gateway.metrics import REGISTRY
from taco_llm.protos import engine_pb2, engine_pb2_grpc, registry_pb2
from taco_llm.protos.registry_keys import REGISTRY_KEY_PREFIX

from .support import free_port

# The async fixtures live on the session's loop (pyproject's asyncio_default_fixture_loop_scope).
pytestmark = pytest.mark.asyncio(loop_scope="session")

# The brief's bounds, with room for a loaded test machine.
JOIN_WITHIN = 2.0
LEAVE_WITHIN = 2.0
OUT_OF_ROTATION_WITHIN = 2.0


class Freezer:
    """While frozen, every call hangs (a worker stopped, or cut off, that still holds its connection)."""

    def __init__(self) -> None:
        self.thawed = asyncio.Event()
        self.thawed.set()


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, name: str, freezer: Freezer) -> None:
        self.name = name
        self.freezer = freezer

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        await self.freezer.thawed.wait()
        return engine_pb2.ModelInfo(served_model_names=[self.name], max_model_len=2048)

    async def GetLoad(self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> engine_pb2.Load:
        await self.freezer.thawed.wait()
        return engine_pb2.Load(num_running_requests=1, kv_cache_usage=0.25)


class FakeHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, freezer: Freezer) -> None:
        self.freezer = freezer
        self.status = health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        await self.freezer.thawed.wait()
        return health_pb2.HealthCheckResponse(status=self.status)


class Worker:
    """A fake worker on a free port; `stop` kills it as a crash would (no goodbye)."""

    def __init__(self, name: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.freezer = Freezer()
        self.engine = FakeEngine(name, self.freezer)
        self.health = FakeHealth(self.freezer)
        self.server = grpc.aio.server()

    async def start(self) -> None:
        engine_pb2_grpc.add_EngineServicer_to_server(self.engine, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(None)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    folder: Path = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(20)


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client: aioredis.Redis = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()


@pytest.fixture
async def workers() -> AsyncIterator[list[Worker]]:
    started = [Worker("m"), Worker("m")]
    for worker in started:
        await worker.start()
    yield started
    for worker in started:
        await worker.stop()


async def _register(registry: aioredis.Redis, worker: Worker, *, ttl_ms: int = 6000) -> str:
    key = f"{REGISTRY_KEY_PREFIX}{worker.port}"
    record = registry_pb2.WorkerRecord(worker_id=str(worker.port), address=worker.address,
                                       served_model_names=["m"])
    await registry.set(key, record.SerializeToString(), px=ttl_ms)
    return key


async def _within(seconds: float, condition: Callable[[], bool], what: str) -> float:
    start = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - start
        assert elapsed < seconds, f"{what}: not within {seconds} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def _ready(pool: EnginePool) -> set[str]:
    return {c.address for c in pool.ready_clients()}


def _members(pool: EnginePool) -> set[str]:
    return {c.address for c in pool.clients}


def _member(pool: EnginePool, address: str) -> EngineClient:
    return next(c for c in pool.clients if c.address == address)


async def test_registered_workers_join_and_leave(registry: aioredis.Redis, redis_url: str,
                                                 workers: list[Worker]) -> None:
    first, second = workers
    pool = EnginePool(registry_url=redis_url)
    await pool.start()
    try:
        assert pool.clients == []
        key = await _register(registry, first)
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address}, "a registered worker joins")
        client = _member(pool, first.address)
        assert client.info is not None and list(client.info.served_model_names) == ["m"]
        await _within(1.0, lambda: client.reported is not None, "its load is read")
        assert REGISTRY.get_sample_value("taco_llm_worker_ready", {"worker": first.address}) == 1
        assert REGISTRY.get_sample_value("taco_llm_worker_load", {"worker": first.address,
                                                                  "kind": "kv_cache_usage"}) == 0.25

        # A key that expires (its worker stopped heartbeating) takes its worker out.
        await _register(registry, second, ttl_ms=1500)
        await _within(1.4, lambda: second.address in _ready(pool), "the second joins")
        await _within(LEAVE_WITHIN, lambda: second.address not in _members(pool), "an expired key leaves")

        # A stream under way keeps the channel of a worker whose key was deleted, until it ends.
        client.in_flight = 1
        await registry.delete(key)
        await _within(LEAVE_WITHIN, lambda: first.address not in _members(pool), "a deleted key leaves")
        assert REGISTRY.get_sample_value("taco_llm_worker_ready", {"worker": first.address}) is None
        await asyncio.sleep(0.3)
        load = await client.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=1)
        assert load.kv_cache_usage == 0.25, "the leaving worker's channel is still open for its stream"
        client.in_flight = 0
        await asyncio.sleep(0.5)
        with pytest.raises(Exception):  # noqa: B017 - grpc raises its own UsageError on a closed channel
            await client.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=1)
    finally:
        await pool.close()


async def test_dead_and_not_serving_workers_leave_rotation(registry: aioredis.Redis, redis_url: str,
                                                           workers: list[Worker]) -> None:
    first, second = workers
    for worker in workers:
        await _register(registry, worker)
    pool = EnginePool(registry_url=redis_url)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address, second.address}, "both join")
        first.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await _within(OUT_OF_ROTATION_WITHIN, lambda: _ready(pool) == {second.address}, "NOT_SERVING")
        assert first.address in _members(pool), "its key is still there: it stays a member, out of rotation"
        first.health.status = health_pb2.HealthCheckResponse.SERVING
        await _within(OUT_OF_ROTATION_WITHIN, lambda: first.address in _ready(pool), "SERVING again")

        await second.stop()
        elapsed = await _within(OUT_OF_ROTATION_WITHIN, lambda: _ready(pool) == {first.address}, "a killed worker")
        assert elapsed < OUT_OF_ROTATION_WITHIN
        assert "UNAVAILABLE" in _member(pool, second.address).why_not_ready()
    finally:
        await pool.close()


async def test_a_registry_outage_keeps_the_members(registry: aioredis.Redis, redis_url: str,
                                                   workers: list[Worker]) -> None:
    first, _ = workers
    static = workers[1]
    await _register(registry, first)
    pool = EnginePool([static.address], registry_url=redis_url, list_interval=0.2)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address, static.address}, "both ready")
        # Redis answering nothing (the whole database gone) removes registered members, never --engine ones.
        await registry.flushdb()
        await _within(LEAVE_WITHIN, lambda: _members(pool) == {static.address}, "static members stay")
        await _register(registry, first)
        await _within(JOIN_WITHIN, lambda: first.address in _ready(pool), "rejoins")
        # Redis unreachable: the pool keeps what it has.
        assert pool._registry is not None
        await pool._registry.close()
        pool._registry._redis = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        await asyncio.sleep(1.0)
        assert _ready(pool) == {first.address, static.address}
    finally:
        await pool.close()


async def test_a_frozen_worker_leaves_rotation_at_the_second_missed_deadline() -> None:
    worker = Worker("m")
    await worker.start()
    pool = EnginePool([worker.address])
    await pool.start()
    try:
        assert _ready(pool) == {worker.address}
        client = _member(pool, worker.address)

        worker.freezer.thawed.clear()
        started = time.monotonic()
        await _within(OUT_OF_ROTATION_WITHIN + 0.5, lambda: client.missed_checks > 0 or not client.ready,
                      "a missed deadline is noticed")
        await _within(OUT_OF_ROTATION_WITHIN, lambda: not client.ready, "a frozen worker leaves rotation")
        assert time.monotonic() - started <= OUT_OF_ROTATION_WITHIN + 0.3
    finally:
        worker.freezer.thawed.set()
        await pool.close()
        await worker.stop()
