"""The gateway's pool membership: workers registered in a real Redis (by the worker's own Registrar) join
and leave it, an emptied registry does not empty the fleet, a restarted worker is a new member, health
checks take dead, cut-off and NOT_SERVING workers out of rotation in time, and cache affinity is
forgotten only where the cache went.

The workers are tiny in-process gRPC servers with just Health and Engine.GetModelInfo/GetLoad: this
tests the gateway's membership, not the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from taco_llm.engine_worker.frontend.registry import Registrar
from taco_llm.gateway.engine_pool import EngineClient, EnginePool
from taco_llm.gateway.metrics import REGISTRY
from taco_llm.gateway.prefix_index import CHUNK_CHARS
from taco_llm.gateway.routing import RouteKey
from taco_llm.protos import engine_pb2, engine_pb2_grpc, registry_pb2
from taco_llm.protos.engine_limits import ENGINE_SERVICE

from .support import free_port

# The async fixtures live on the session's loop (pyproject's asyncio_default_fixture_loop_scope).
pytestmark = pytest.mark.asyncio(loop_scope="session")

# The brief's bounds, with room for a loaded test machine.
JOIN_WITHIN = 2.0
OUT_OF_ROTATION_WITHIN = 2.0
# Registered workers' --registry-ttl here: short, so that expiry and absence are seen quickly.
TTL = 1.5
# A key gone (deleted, or expired) is missed for a TTL before its member leaves; then a listing.
LEAVE_WITHIN = TTL + 2.0


class Freezer:
    """While frozen, every call hangs (a worker stopped, or cut off, that still holds its connection)."""

    def __init__(self) -> None:
        self.thawed = asyncio.Event()
        self.thawed.set()


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, name: str, freezer: Freezer) -> None:
        self.name = name
        self.freezer = freezer
        self.created = 1_700_000_000  # ModelInfo.created: a restarted engine has another
        self.cache_service = ""       # ModelInfo.prefix_cache_service
        self.cache_incarnation = ""   # Load.prefix_cache_incarnation

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        await self.freezer.thawed.wait()
        return engine_pb2.ModelInfo(served_model_names=[self.name], max_model_len=2048, created=self.created,
                                    prefix_cache_service=self.cache_service)

    async def GetLoad(self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> engine_pb2.Load:
        await self.freezer.thawed.wait()
        return engine_pb2.Load(num_running_requests=1, kv_cache_usage=0.25,
                               prefix_cache_incarnation=self.cache_incarnation)


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


class Registered:
    """A worker's registry entry, written by the worker's own Registrar: `stop` deletes it (a drain),
    `kill` stops its heartbeat and leaves the key to expire (a crash)."""

    def __init__(self, url: str, worker: Worker, *, ttl: float = TTL, instance: str | None = None) -> None:
        self.registrar = Registrar(url, worker.address, ["m"], ttl=ttl, instance=instance or worker.address)

    @property
    def worker_id(self) -> str:
        return self.registrar.record.worker_id

    async def start(self) -> Registered:
        await self.registrar.start()
        return self

    async def kill(self) -> None:
        assert self.registrar.heartbeats is not None
        self.registrar.heartbeats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.registrar.heartbeats
        self.registrar.heartbeats = None

    async def stop(self) -> None:
        await self.registrar.stop()


@pytest.fixture
async def registrations() -> AsyncIterator[list[Registered]]:
    """Registered entries, stopped at the end of the test."""
    made: list[Registered] = []
    yield made
    for entry in made:
        if entry.registrar.heartbeats is not None:
            await entry.stop()
        else:
            with contextlib.suppress(Exception):
                await entry.registrar.client.aclose()


async def _register(made: list[Registered], url: str, worker: Worker, **kwargs: float | str | None) -> Registered:
    entry = Registered(url, worker, **kwargs)  # type: ignore[arg-type]
    made.append(entry)
    return await entry.start()


async def _within(seconds: float, condition: Callable[[], bool], what: str) -> float:
    start = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - start
        assert elapsed < seconds, f"{what}: not within {seconds} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _holds(seconds: float, condition: Callable[[], bool], what: str) -> None:
    """`condition` stays true, checked every 20 ms, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert condition(), what
        await asyncio.sleep(0.02)


def _ready(pool: EnginePool) -> set[str]:
    return {c.address for c in pool.ready_clients()}


def _members(pool: EnginePool) -> set[str]:
    return {c.address for c in pool.clients}


def _member(pool: EnginePool, address: str) -> EngineClient:
    return next(c for c in pool.clients if c.address == address)


def _prompt(seed: str) -> str:
    return "".join(f"{seed}-{i}-".ljust(CHUNK_CHARS, "x") for i in range(8))


def _prefix_match(pool: EnginePool, client: EngineClient, text: str) -> float:
    """The prefix match cache_aware finds on `client` for `text` (routing it there alone)."""
    others = [c for c in pool.clients if c is not client]
    return pool.route(RouteKey(model="m", prefix_text=text), exclude=others).prefix_match


async def test_registered_workers_join_and_leave(registry: aioredis.Redis, redis_url: str, workers: list[Worker],
                                                 registrations: list[Registered]) -> None:
    first, second = workers
    pool = EnginePool(registry_url=redis_url)
    await pool.start()
    try:
        assert pool.clients == []
        entry = await _register(registrations, redis_url, first)
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address}, "a registered worker joins")
        client = _member(pool, first.address)
        assert client.member_id == entry.worker_id, "a registered member is its worker process"
        assert client.info is not None and list(client.info.served_model_names) == ["m"]
        await _within(1.0, lambda: client.reported is not None, "its load is read")
        assert REGISTRY.get_sample_value("taco_llm_worker_ready", {"worker": first.address}) == 1
        assert REGISTRY.get_sample_value("taco_llm_worker_load", {"worker": first.address,
                                                                  "kind": "kv_cache_usage"}) == 0.25

        # A worker that stops heartbeating: its key expires, and a TTL later it leaves.
        crashed = await _register(registrations, redis_url, second)
        await _within(JOIN_WITHIN, lambda: second.address in _ready(pool), "the second joins")
        await crashed.kill()
        await asyncio.wait_for(_key_gone(registry, crashed.registrar.key), TTL + 1.0)
        assert second.address in _members(pool), "a member stays for a TTL after its key is gone"
        await _within(LEAVE_WITHIN, lambda: second.address not in _members(pool), "an expired key leaves")

        # A stream under way keeps the channel of a worker whose key was deleted, until it ends.
        client.in_flight = 1
        await entry.stop()
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


async def _key_gone(registry: aioredis.Redis, key: str) -> None:
    while await registry.exists(key):
        await asyncio.sleep(0.02)


async def test_dead_and_not_serving_workers_leave_rotation(registry: aioredis.Redis, redis_url: str,
                                                           workers: list[Worker],
                                                           registrations: list[Registered]) -> None:
    first, second = workers
    for worker in workers:
        await _register(registrations, redis_url, worker)
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


async def test_a_draining_worker_leaves_rotation_at_once_and_the_pool_a_ttl_later(
        registry: aioredis.Redis, redis_url: str, workers: list[Worker], registrations: list[Registered]) -> None:
    first, second = workers
    draining = await _register(registrations, redis_url, first)
    await _register(registrations, redis_url, second)
    pool = EnginePool(registry_url=redis_url, list_interval=0.2)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address, second.address}, "both join")
        # SIGTERM: the worker reports NOT_SERVING and deletes its key (engine_worker/frontend/drain.py).
        first.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await draining.stop()
        await _within(OUT_OF_ROTATION_WITHIN, lambda: _ready(pool) == {second.address},
                      "a draining worker is out of rotation at once, through its health")
        await _within(LEAVE_WITHIN, lambda: _members(pool) == {second.address}, "and out of the pool a TTL later")
    finally:
        await pool.close()


async def test_an_emptied_registry_keeps_the_fleet(registry: aioredis.Redis, redis_url: str, workers: list[Worker],
                                                   registrations: list[Registered]) -> None:
    first, _ = workers
    static = workers[1]
    entry = await _register(registrations, redis_url, first)
    pool = EnginePool([static.address], registry_url=redis_url, list_interval=0.2)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address, static.address}, "both ready")
        client = _member(pool, first.address)
        breaker = client.breaker
        pool.record_outcome(client, worker_fault=True)  # one fault: the breaker counts it, still closed
        faults = breaker.failures
        assert faults == 1
        text = _prompt("warm")
        _prefix_match(pool, client, text)
        assert _prefix_match(pool, client, text) == 1.0

        # Redis answers, with no key at all (restarted without persistence, flushed, a lagging replica):
        # the registered member stays, in rotation, until its heartbeat writes the key again (a third of
        # the TTL), with its breaker and its cache affinity.
        await registry.flushdb()
        rejoined = time.monotonic() + TTL
        while time.monotonic() < rejoined:
            assert _ready(pool) == {first.address, static.address}, "an empty listing emptied the fleet"
            await asyncio.sleep(0.02)
        assert await registry.exists(entry.registrar.key), "the worker wrote its key again"
        assert _member(pool, first.address) is client and client.breaker is breaker
        assert breaker.failures == faults
        assert _prefix_match(pool, client, text) == 1.0, "its cache affinity was kept"

        # No heartbeat to write it again (the worker died with Redis's keys): it leaves a TTL later.
        await entry.kill()
        await registry.flushdb()
        gone = time.monotonic()
        await _within(LEAVE_WITHIN, lambda: _members(pool) == {static.address}, "a member missing a TTL leaves")
        assert time.monotonic() - gone >= TTL - 0.1, "it left before its TTL was up"

        # Redis unreachable: the pool keeps what it has.
        await _register(registrations, redis_url, first)
        await _within(JOIN_WITHIN, lambda: first.address in _ready(pool), "rejoins")
        assert pool._registry is not None
        await pool._registry.close()
        pool._registry._redis = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        await _holds(TTL + 1.0, lambda: _ready(pool) == {first.address, static.address}, "an outage keeps members")
    finally:
        await pool.close()


async def test_a_restarted_worker_is_a_new_member(registry: aioredis.Redis, redis_url: str, workers: list[Worker],
                                                  registrations: list[Registered]) -> None:
    first, second = workers
    ttl = 6.0  # long: the old incarnation's key outlives each check below, which must not wait for it
    old = await _register(registrations, redis_url, first, ttl=ttl, instance="worker-a")
    pool = EnginePool(registry_url=redis_url, list_interval=0.2)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address}, "joins")
        client = _member(pool, first.address)
        text = _prompt("restart")
        _prefix_match(pool, client, text)
        pool.record_outcome(client, worker_fault=True)
        client.in_flight = 1  # a stream under way on the old incarnation

        # The container is restarted at a new address; the old process's key has not expired yet.
        await old.kill()
        moved = await _register(registrations, redis_url, second, ttl=ttl, instance="worker-a")
        await _within(JOIN_WITHIN, lambda: _members(pool) == {second.address},
                      "the old incarnation leaves as the new one registers, not when its key expires")
        assert await registry.exists(old.registrar.key)
        load = await client.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=1)
        assert load.kv_cache_usage == 0.25, "the old incarnation's stream keeps its channel until it ends"
        client.in_flight = 0
        await asyncio.sleep(0.5)
        with pytest.raises(Exception):  # noqa: B017 - grpc's UsageError on a closed channel
            await client.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=1)
        await _within(JOIN_WITHIN, lambda: second.address in _ready(pool), "the new one is ready")
        assert pool._watchers.keys() == set(pool.clients), "the old address is no longer health-checked"

        # Restarted again, at the same address: still a new member, with a fresh breaker and no affinity.
        moved_client = _member(pool, second.address)
        _prefix_match(pool, moved_client, text)
        pool.record_outcome(moved_client, worker_fault=True)
        await moved.kill()
        await _register(registrations, redis_url, second, ttl=ttl, instance="worker-a")
        await _within(JOIN_WITHIN, lambda: second.address in _ready(pool) and _member(pool, second.address)
                      is not moved_client, "a new incarnation at the same address is a new member")
        assert len(pool.clients) == 1
        renewed = _member(pool, second.address)
        assert renewed.breaker.failures == 0
        assert _prefix_match(pool, renewed, text) == 0, "the new incarnation's cache is cold"
    finally:
        await pool.close()


async def test_live_workers_sharing_an_instance_name_are_all_kept(
        registry: aioredis.Redis, redis_url: str, workers: list[Worker], registrations: list[Registered],
        caplog: pytest.LogCaptureFixture) -> None:
    """Two replicas given one TACO_LLM_INSTANCE by mistake, both heartbeating: two workers, not a restart
    of one (before: only the later one was ever routed to)."""
    first, second = workers
    await _register(registrations, redis_url, first, instance="same-name")
    await asyncio.sleep(0.05)  # a later start
    await _register(registrations, redis_url, second, instance="same-name")
    pool = EnginePool(registry_url=redis_url, list_interval=0.2)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address, second.address}, "both join")
        await _holds(1.0, lambda: _ready(pool) == {first.address, second.address}, "both stay")
        assert any("same-name" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    finally:
        await pool.close()


async def test_a_missing_member_whose_address_answers_as_another_process_leaves(
        registry: aioredis.Redis, redis_url: str, workers: list[Worker], registrations: list[Registered]) -> None:
    """A member whose key is gone is kept for its TTL (an emptied Redis) and still polled; if its address
    meanwhile answers as another process (the IP given to another worker), it leaves at once rather than
    counting that process as itself (before: it came back ready, as a 'restart', beside the new member)."""
    first, _ = workers
    entry = await _register(registrations, redis_url, first, ttl=6.0)
    pool = EnginePool(registry_url=redis_url, list_interval=0.2, health_interval=0.1)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address}, "joins")
        client = _member(pool, first.address)
        await entry.kill()
        await registry.delete(entry.registrar.key)
        await _within(JOIN_WITHIN, lambda: client.absent_since is not None, "its key missed")
        first.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await _within(OUT_OF_ROTATION_WITHIN, lambda: not client.ready, "out of rotation")
        first.engine.created += 60  # another process now answers at this address
        first.health.status = health_pb2.HealthCheckResponse.SERVING
        await _within(OUT_OF_ROTATION_WITHIN + 1, lambda: client not in pool.clients, "the ghost leaves")
        assert not _ready(pool)
    finally:
        first.health.status = health_pb2.HealthCheckResponse.SERVING
        await pool.close()


async def test_a_worker_registered_at_a_new_address_is_dialed_there(
        registry: aioredis.Redis, redis_url: str, workers: list[Worker], registrations: list[Registered]) -> None:
    first, second = workers
    entry = await _register(registrations, redis_url, first)
    pool = EnginePool(registry_url=redis_url, list_interval=0.2)
    await pool.start()
    try:
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {first.address}, "joins")
        client = _member(pool, first.address)
        text = _prompt("moved")
        _prefix_match(pool, client, text)
        # The same process now reachable elsewhere (its record rewritten with the new address).
        await entry.kill()
        record = registry_pb2.WorkerRecord()
        record.CopyFrom(entry.registrar.record)
        record.address = second.address
        await registry.set(entry.registrar.key, record.SerializeToString(), px=int(TTL * 1000))
        await _within(JOIN_WITHIN, lambda: _ready(pool) == {second.address}, "dialed at its new address")
        moved = _member(pool, second.address)
        assert moved.member_id == client.member_id and moved.breaker is client.breaker
        assert _prefix_match(pool, moved, text) == 1.0, "the same process: its cache went with it"
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


async def test_a_status_the_worker_pushes_takes_it_out_between_two_polls() -> None:
    # The worker's real health servicer (grpcio-health-checking's, as engine_worker/frontend/server.py
    # has), which answers Watch: a drain's NOT_SERVING reaches the gateway without waiting for a poll.
    worker = Worker("m")
    pushed = health.aio.HealthServicer()
    await pushed.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    worker.health = pushed  # type: ignore[assignment]
    await worker.start()
    pool = EnginePool([worker.address], health_interval=60.0)  # no second poll within this test
    await pool.start()
    try:
        client = _member(pool, worker.address)
        assert client.ready
        await asyncio.sleep(0.3)  # the Watch stream is open and has its first (SERVING) answer
        await pushed.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        elapsed = await _within(1.0, lambda: not client.ready, "a pushed NOT_SERVING")
        assert elapsed < 1.0 and client.why_not_ready() == "NOT_SERVING"
        assert REGISTRY.get_sample_value("taco_llm_worker_ready", {"worker": worker.address}) == 0
        # Coming back is the polls' decision (they read ModelInfo again): a push alone does not.
        await pushed.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(0.5)
        assert not client.ready
        await pool.refresh()
        assert client.ready
    finally:
        await pool.close()
        await worker.stop()


async def test_affinity_outlives_missed_checks_but_not_a_restart() -> None:
    worker = Worker("m")
    await worker.start()
    pool = EnginePool([worker.address], health_interval=0.1)
    await pool.start()
    try:
        client = _member(pool, worker.address)
        text = _prompt("busy")
        _prefix_match(pool, client, text)
        # A busy worker answers two checks late: out of rotation, then back, its KV cache as warm as before.
        worker.freezer.thawed.clear()
        await _within(OUT_OF_ROTATION_WITHIN + 0.5, lambda: not client.ready, "two missed deadlines")
        worker.freezer.thawed.set()
        await _within(OUT_OF_ROTATION_WITHIN, lambda: client.ready, "ready again")
        assert _prefix_match(pool, client, text) == 1.0, "affinity wiped by a missed health check"

        # Restarted (another ModelInfo.created): its cache is gone, and so is its affinity.
        worker.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await _within(OUT_OF_ROTATION_WITHIN, lambda: not client.ready, "restarting")
        worker.engine.created += 60
        worker.health.status = health_pb2.HealthCheckResponse.SERVING
        await _within(OUT_OF_ROTATION_WITHIN, lambda: client.ready, "restarted")
        assert client.info is not None and client.info.created == worker.engine.created
        assert _prefix_match(pool, client, text) == 0
    finally:
        worker.freezer.thawed.set()
        await pool.close()
        await worker.stop()


async def test_a_restarted_cache_service_is_forgotten_once(workers: list[Worker]) -> None:
    first, second = workers
    for worker in workers:
        worker.engine.cache_service = "cache:1"
        worker.engine.cache_incarnation = "run-1"
    pool = EnginePool([w.address for w in workers], health_interval=0.1)
    await pool.start()
    try:
        a, b = _member(pool, first.address), _member(pool, second.address)
        await _within(1.0, lambda: all(c.reported is not None for c in (a, b)), "loads read")
        before, after = _prompt("before"), _prompt("after")
        _prefix_match(pool, a, before)
        _prefix_match(pool, a, after)
        # Sent to a, warm on b through the cache service they share, at the offload discount.
        assert _prefix_match(pool, b, before) == pytest.approx(0.75)

        # The cache service restarted, empty: b has read its new incarnation, a not yet.
        second.engine.cache_incarnation = "run-2"
        await _within(1.0, lambda: b.reported is not None and b.reported.prefix_cache_incarnation == "run-2",
                      "b reports the new incarnation")
        await asyncio.sleep(0.3)
        assert _prefix_match(pool, b, after) == 0, "the restarted service's shared index was kept"
        assert _prefix_match(pool, a, before) == 1.0, "a's own KV cache is still warm"
        # a's report of the old incarnation is no news: what was sent since stays warm through the service.
        again = _prompt("again")
        _prefix_match(pool, a, again)
        await asyncio.sleep(0.3)
        assert _prefix_match(pool, b, again) == pytest.approx(0.75)
    finally:
        await pool.close()
