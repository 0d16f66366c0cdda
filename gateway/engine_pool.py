"""The engine workers behind the gateway: who they are (--engine, and the registry with --registry-url),
whether each is ready, how loaded, whether its circuit breaker lets requests through, and which one a
request goes to (routing.py's policies).

Each member has its own watch task: every --health-interval, a health Check and a GetLoad under a short
deadline, and all along the worker's health Watch stream, so that a NOT_SERVING the worker pushes (a
drain, an engine stall) takes it out between two polls. A refused connection or NOT_SERVING takes a
worker out of rotation at once; a missed deadline
(a worker frozen or cut off) does at the second miss in a row, so a busy worker that answers one check
late is not dropped. With the defaults (0.5 s, 0.75 s deadline) a dead or cut-off worker is out within
2 s. ModelInfo is read again whenever a worker becomes ready: it may have restarted with other settings.

A registered member is one worker process: its record's worker_id (an incarnation of its instance).
It leaves the pool when its key has been missing from the listings for the record's TTL: a Redis that
answers but lost its keys (restarted empty, flushed, a lagging replica) must not empty the fleet, nor
reset breakers and cache affinity; the workers write their keys again within a third of the TTL. A
draining worker stops getting requests at once all the same: its health says NOT_SERVING. A record of
the same instance (or, for records without one, at the same address) that started later replaces a
member at once: its process is gone, and a restarted container at a new address must not be dialed at
the old one (NVIDIA Dynamo's gateway did, keying workers by name alone). The new incarnation is a new
member even at the same address: a fresh breaker, no cache affinity. A member that leaves stops being
routed to at once; its channel is closed only once the streams the gateway has on it have ended (a
worker that really died fails its streams by itself).

Cache affinity (routing.py) is forgotten only where the cache really went: a worker that answers with
another ModelInfo.created (it restarted), a new member, and a shared cache service that reports a new
incarnation (Load.prefix_cache_incarnation: it restarted, empty). A busy worker that misses two health
deadlines and comes back keeps its affinity: its KV cache is still warm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.grpc_security import ClientTls, aio_channel
from taco_llm.protos import engine_pb2, engine_pb2_grpc, registry_pb2
from taco_llm.protos.engine_limits import ENGINE_SERVICE, GRPC_MESSAGE_LIMIT, KEEPALIVE_CLIENT_OPTIONS
from taco_llm.protos.registry_keys import DEFAULT_TTL_SECONDS, HEARTBEATS_PER_TTL, LIST_INTERVAL_SECONDS

from . import discovery
from .circuit_breaker import BreakerState, CircuitBreaker
from .errors import APIError, service_unavailable
from .metrics import CIRCUIT_STATE, ROUTING_DECISIONS, WORKER_LOAD, WORKER_READY
from .prefix_view import SharedPrefixView
from .routing import Route, RouteKey, make_policy

__all__ = ["EngineClient", "EnginePool", "Route", "RouteKey"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Long prompts and many logprobs make big messages; the gRPC default of 4 MiB is too small.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
    # HTTP/2 pings find a worker cut off by the network within 5 s (engine_limits says how).
    *KEEPALIVE_CLIENT_OPTIONS,
    # gRPC's default reconnect backoff grows to 120 s; a worker that is starting or restarting should
    # be found within a couple of seconds.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Two misses in a row at this deadline, after at most one interval, fit in 2 s at the default interval.
HEALTH_DEADLINE_SECONDS = 0.75
MISSED_CHECKS_BEFORE_UNREADY = 2
# The least time a worker's last GetLoad answer is taken to speak for it (EnginePool.recent_report).
REPORT_FRESH_SECONDS = 5.0
# A full KV cache weighs as this many queued requests: the worker is about to queue or preempt.
KV_CACHE_WEIGHT = 2.0
# How often a leaving member is looked at, until its last stream has ended.
_RETIRE_POLL_SECONDS = 0.2
_LOAD_KINDS = ("running", "waiting", "kv_cache_usage", "gateway_streams")
# Cache-service incarnations remembered per service: a worker that has not read the new one yet reports
# an old one, which must not count as yet another restart.
_INCARNATIONS_KEPT = 16


def _same_worker(a: registry_pb2.WorkerRecord, b: registry_pb2.WorkerRecord) -> bool:
    """Whether two records are incarnations of one worker: one instance, or one address where either
    names no instance."""
    if a.instance and b.instance:
        return a.instance == b.instance
    return a.address == b.address


def _prefix_view_id(record: registry_pb2.WorkerRecord | None) -> str:
    return record.worker_id if record is not None and record.publishes_prefix_cache else ""


def _started(record: registry_pb2.WorkerRecord) -> tuple[int, int, str]:
    """The order of a worker's incarnations: by start, then by heartbeat, then by id (any order, but one)."""
    return record.started_unix_ms, record.heartbeat_unix_ms, record.worker_id


def _replaces(newer: registry_pb2.WorkerRecord, older: registry_pb2.WorkerRecord) -> bool:
    """Whether `newer` is a later incarnation of the worker `older` was: the same worker (_same_worker),
    started after it, once `older` had stopped heartbeating (a beat's slack for the hosts' clocks). Two
    processes that both still heartbeat are two workers, whatever their instance names say: a name given
    to several replicas by mistake must not shrink the fleet to one."""
    if newer.worker_id == older.worker_id or not _same_worker(newer, older) or _started(newer) <= _started(older):
        return False
    beat_ms = (older.ttl_ms or DEFAULT_TTL_SECONDS * 1000) / HEARTBEATS_PER_TTL
    return older.heartbeat_unix_ms <= newer.started_unix_ms + beat_ms


async def _outcome(call: Awaitable[T]) -> T | grpc.aio.AioRpcError:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        return error


@dataclass(eq=False)
class EngineClient:
    """One engine worker, seen from the gateway."""

    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    # Who it is, for membership and cache affinity: its worker_id for a registered worker (one process),
    # its address for an --engine one. The address stays the name logs and /metrics show.
    member_id: str = ""
    # Kept while the worker is not ready, so that its streams under way can still read it; read again
    # when it becomes ready.
    info: engine_pb2.ModelInfo | None = None
    ready: bool = False
    # Streams this gateway has open on it (the streams' code counts them).
    in_flight: int = 0
    missed_checks: int = 0
    # How many times the worker has pushed a status other than SERVING on its health Watch: a poll whose
    # Check was answered before the latest push must not put the worker back in rotation.
    pushed_unready: int = 0
    last_error: str = field(default="", repr=False)
    # Sent on the gateway's own calls (GetModelInfo, GetLoad), for workers started with --api-key.
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # Given with --engine: never leaves the pool. A registered worker leaves when its key does.
    static: bool = True
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker, repr=False)
    # The last GetLoad answer; None until one came (or for a worker without GetLoad).
    reported: engine_pb2.Load | None = field(default=None, repr=False)
    # This gateway's open streams on it when the GetLoad behind `reported` was sent: the streams opened
    # and closed since then are what the worker's count does not show yet. (Counting only those routed
    # since would keep a finished request on the books until the next GetLoad: one worker then looks
    # busy for a whole interval after each short request, and a prefix would hop between workers.)
    in_flight_at_report: int = 0
    # When (time.monotonic) `reported` arrived: a report goes stale when the worker stops answering GetLoad
    # (cut off, or its whole process frozen), while health may fail for other reasons (a drain, a busy
    # worker's late checks) with the engine still stepping.
    reported_at: float | None = field(default=None, repr=False)
    # A registered worker's record, as last listed.
    record: registry_pb2.WorkerRecord | None = field(default=None, repr=False)
    # When (pool clock) its key was first missed from the listings in a row; None while it is listed.
    absent_since: float | None = field(default=None, repr=False)
    # The worker_id its prefix cache is published under (WorkerRecord.publishes_prefix_cache), from its
    # record: "" where it publishes none or is not registered.
    prefix_view_id: str = ""

    def __post_init__(self) -> None:
        self.member_id = self.member_id or self.address

    @classmethod
    def connect(cls, address: str, metadata: tuple[tuple[str, str], ...] = (), *, static: bool = True,
                breaker: CircuitBreaker | None = None, tls: ClientTls | None = None,
                record: registry_pb2.WorkerRecord | None = None) -> EngineClient:
        # One channel for the requests, the health checks and GetLoad: a worker that requires client
        # certificates gets them on each. With TLS the worker's certificate must name `address`.
        channel = aio_channel(address, tls, GRPC_OPTIONS)
        return cls(address, channel, engine_pb2_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel),
                   member_id=record.worker_id if record is not None else address, metadata=metadata,
                   static=static, breaker=breaker or CircuitBreaker(), record=record,
                   prefix_view_id=_prefix_view_id(record))

    @property
    def absence_limit(self) -> float:
        """Seconds its key may be missing before it leaves: its record's TTL."""
        ttl_ms = self.record.ttl_ms if self.record is not None else 0
        return ttl_ms / 1000 if ttl_ms else DEFAULT_TTL_SECONDS

    def superseded_by(self, record: registry_pb2.WorkerRecord) -> bool:
        """Whether `record` is a later incarnation of this registered worker: another process of its
        instance, or (where either names no instance) at its address, started after it."""
        return self.record is not None and _replaces(record, self.record)

    def serves(self, model: str) -> bool:
        return self.info is not None and model in self.info.served_model_names

    @property
    def load(self) -> float:
        """Requests on the worker (running and waiting, by its own count, corrected by the streams this
        gateway opened and closed since it counted, and never below those open now), with a KV-cache
        term; this gateway's own streams for a worker without GetLoad."""
        report = self.reported
        if report is None:
            return float(self.in_flight)
        requests = max(report.num_running_requests + report.num_waiting_requests
                       + self.in_flight - self.in_flight_at_report, self.in_flight)
        return requests + KV_CACHE_WEIGHT * report.kv_cache_usage

    @property
    def cache_group(self) -> str:
        return self.info.prefix_cache_service if self.info is not None else ""

    async def poll(self, deadline: float) -> None:
        """One health Check and GetLoad; updates `ready` (and `info` when it becomes ready)."""
        in_flight_before = self.in_flight
        pushed_before = self.pushed_unready
        check: health_pb2.HealthCheckResponse | grpc.aio.AioRpcError
        load: engine_pb2.Load | grpc.aio.AioRpcError
        check, load = await asyncio.gather(
            _outcome(self.health.Check(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=deadline)),
            _outcome(self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=deadline, metadata=self.metadata)),
        )
        if isinstance(check, grpc.aio.AioRpcError):
            self.last_error = f"{check.code().name}: {check.details()}"
            if check.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.missed_checks += 1
                serving = self.ready and self.missed_checks < MISSED_CHECKS_BEFORE_UNREADY
            else:
                serving = False
        else:
            self.missed_checks = 0
            serving = check.status == health_pb2.HealthCheckResponse.SERVING
            if not serving:
                self.last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
        if isinstance(load, engine_pb2.Load):
            self.reported = load
            self.reported_at = time.monotonic()
            self.in_flight_at_report = in_flight_before
        elif isinstance(load, grpc.aio.AioRpcError) and load.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.reported = None
        if self.pushed_unready != pushed_before:
            serving = False  # the check was answered before the worker said otherwise
        if serving and (not self.ready or self.info is None):
            try:
                self.info = await self.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=deadline,
                                                         metadata=self.metadata)
            except grpc.aio.AioRpcError as error:
                self.last_error = f"GetModelInfo: {error.code().name}: {error.details()}"
                serving = False
        if serving:
            self.last_error = ""
        self.ready = serving

    async def read_info(self, deadline: float) -> None:
        """Its ModelInfo again, where what it serves changed while it stayed ready (a LoRA adapter loaded
        or unloaded at runtime)."""
        self.info = await self.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=deadline,
                                                 metadata=self.metadata)

    def why_not_ready(self) -> str:
        return self.last_error or "starting"


class EnginePool:
    """The workers, their membership and health, and the routing of each request to one of them."""

    def __init__(self, addresses: Sequence[str] = (), *, health_interval: float = 0.5,
                 metadata: tuple[tuple[str, str], ...] = (), routing: str = "cache_aware",
                 registry_url: str | None = None, balance_abs_threshold: float = 16,
                 balance_rel_threshold: float = 1.5, offload_discount: float = 0.75,
                 list_interval: float = LIST_INTERVAL_SECONDS,
                 breaker_factory: Callable[[], CircuitBreaker] = CircuitBreaker,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 tls: ClientTls | None = None, shared_prefix_view: bool = True):
        if not addresses and not registry_url:
            raise ValueError("at least one --engine HOST:PORT or a --registry-url is needed")
        if registry_url:
            discovery.check_registry_url(registry_url)
        self.addresses = list(addresses)
        self.registry_url = registry_url
        # Channels belong to the event loop that creates them: made in start(), on the server's loop.
        self.clients: list[EngineClient] = []
        self.health_interval = health_interval
        self.list_interval = list_interval
        self.metadata = metadata
        self.tls = tls  # --engine-tls-*: None dials the workers in plain text
        # What the registered workers publish of their prefix caches (only cache_aware reads it).
        self.prefix_view = (SharedPrefixView(registry_url)
                            if registry_url and shared_prefix_view and routing == "cache_aware" else None)
        self.policy = make_policy(routing, balance_abs_threshold=balance_abs_threshold,
                                  balance_rel_threshold=balance_rel_threshold, offload_discount=offload_discount,
                                  rng=rng, view=self.prefix_view)
        self.breaker_factory = breaker_factory
        self.clock = clock
        self.rng = rng or random.Random()
        self._registry: discovery.Registry | None = None
        self._watchers: dict[EngineClient, asyncio.Task[None]] = {}
        self._retiring: dict[EngineClient, asyncio.Task[None]] = {}
        self._discovery: asyncio.Task[None] | None = None
        self._view_task: asyncio.Task[None] | None = None
        # Instance names that several live workers register under (logged once, while it lasts).
        self._shared_instances: set[str] = set()
        # Per shared cache service (ModelInfo.prefix_cache_service): the incarnations workers reported,
        # oldest first (a dict for its order).
        self._cache_incarnations: dict[str, dict[str, None]] = {}

    # -- life --------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.clients = [self._connect(a, static=True) for a in self.addresses]
        # One round before serving, so that a gateway started after its workers answers at once.
        await self.refresh()
        if self.prefix_view is not None:
            self._view_task = asyncio.create_task(self.prefix_view.run(), name="shared-prefix-view")
        if self.registry_url:
            self._registry = discovery.Registry(self.registry_url)
            with contextlib.suppress(discovery.RegistryUnavailable):
                self.apply_registry(await self._registry.list_workers())
            await self.refresh()
            self._discovery = asyncio.create_task(
                discovery.watch(self._registry, self.apply_registry, interval=self.list_interval),
                name="engine-discovery")
        for client in self.clients:
            self._start_watch(client)

    async def close(self) -> None:
        # Taken before the tasks are cancelled: a cancelled _retire removes its client from _retiring.
        retiring = list(self._retiring)
        tasks = [*self._watchers.values(), *self._retiring.values()]
        for task in (self._discovery, self._view_task):
            if task is not None:
                tasks.append(task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channels = [c.channel for c in [*self.clients, *retiring] if c.channel is not None]
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
        if self._registry is not None:
            await self._registry.close()
        if self.prefix_view is not None:
            await self.prefix_view.close()
        self._watchers.clear()
        self._retiring.clear()

    async def refresh(self) -> None:
        """One health and load round on every member."""
        await asyncio.gather(*(self._poll(c) for c in self.clients))

    # -- membership --------------------------------------------------------------------------------

    def apply_registry(self, records: Mapping[str, registry_pb2.WorkerRecord]) -> None:
        """The registry's listing, by worker_id: new workers join; a member re-dials its worker at a new
        address; a member replaced by a later incarnation leaves at once, one whose key is missing
        leaves once it has been missing for its record's TTL."""
        now = self.clock()
        static_addresses = {c.address for c in self.clients if c.static}
        # An --engine member already dials that address: a record of it would count the worker twice.
        # The record still says where the worker publishes its prefix cache.
        self._note_static_records([r for r in records.values() if r.address in static_addresses])
        listed = [r for r in records.values() if r.address not in static_addresses]
        # Of several incarnations of one worker listed at once (a killed one's key outlives it), the latest.
        current = {r.worker_id: r for r in listed if not any(_replaces(other, r) for other in listed)}
        self._warn_of_shared_instances(current.values())
        members = {c.member_id: c for c in self.clients if not c.static}
        for member_id, record in current.items():
            client = members.get(member_id)
            if client is None:
                self._join(record)
            elif client.address != record.address:
                self._redial(client, record)
            else:
                if client.absent_since is not None:
                    logger.info("engine %s is registered again after %.1f s away: kept, with its breaker and "
                                "cache affinity", client.address, now - client.absent_since)
                client.record = record
                client.prefix_view_id = _prefix_view_id(record)
                client.absent_since = None
        for client in list(self.clients):
            if client.static or client.member_id in current:
                continue
            successor = next((r for r in current.values() if client.superseded_by(r)), None)
            if successor is not None:
                self._leave(client, f"replaced by a later incarnation ({successor.worker_id} at {successor.address})")
                continue
            if client.absent_since is None:
                client.absent_since = now
                logger.info("engine %s: its registry key is gone; it leaves the pool unless registered again "
                            "within %.1f s", client.address, client.absence_limit)
            elif now - client.absent_since >= client.absence_limit:
                self._leave(client, f"its registry key has been gone for {now - client.absent_since:.1f} s")

    def _note_static_records(self, records: Collection[registry_pb2.WorkerRecord]) -> None:
        """Where each --engine worker publishes its prefix cache: its latest record's say."""
        for client in self.clients:
            if not client.static:
                continue
            own = [r for r in records if r.address == client.address]
            if not own:
                continue  # not listed now: what it said last stands until it registers again
            latest = max(own, key=_started)
            published = _prefix_view_id(latest)
            if published != client.prefix_view_id:
                self._forget_published(client)
                client.prefix_view_id = published

    def _forget_published(self, client: EngineClient) -> None:
        if self.prefix_view is not None and client.prefix_view_id:
            self.prefix_view.forget(client.prefix_view_id)

    def _warn_of_shared_instances(self, records: Collection[registry_pb2.WorkerRecord]) -> None:
        by_instance: dict[str, list[str]] = {}
        for record in records:
            if record.instance:
                by_instance.setdefault(record.instance, []).append(record.address)
        for instance, addresses in by_instance.items():
            if len(addresses) > 1 and instance not in self._shared_instances:
                logger.error("workers at %s all register as instance %r (TACO_LLM_INSTANCE or host name and "
                             "port): each is kept, but a restart of one cannot be told from the others; give each "
                             "its own", ", ".join(sorted(addresses)), instance)
        self._shared_instances = {i for i, a in by_instance.items() if len(a) > 1}

    def _join(self, record: registry_pb2.WorkerRecord) -> EngineClient:
        client = self._connect(record.address, static=False, record=record)
        self.clients.append(client)
        logger.info("engine %s registered (%s, instance %s): joining the pool", record.address, record.worker_id,
                    record.instance or "unnamed")
        if self._discovery is not None:  # during start(), start() watches it
            self._start_watch(client)
        return client

    def _redial(self, client: EngineClient, record: registry_pb2.WorkerRecord) -> None:
        """The same worker process at a new address: dialed there from now on, with its breaker and
        cache affinity (its KV cache went with it)."""
        old_address = client.address
        self._retire_client(client)
        moved = self._connect(record.address, static=False, record=record)
        moved.breaker = client.breaker
        moved.info = client.info
        self.clients.append(moved)
        logger.info("engine %s now registers at %s: dialing it there", old_address, record.address)
        if self._discovery is not None:
            self._start_watch(moved)

    def recent_report(self, client: EngineClient) -> engine_pb2.Load | None:
        """The worker's last Load report if it is recent enough to speak for the worker now: a few health
        intervals, so that a busy worker's late answers still count, and one that stopped answering (cut
        off, frozen whole) does not for long."""
        if client.reported is None or client.reported_at is None:
            return None
        fresh_for = max(REPORT_FRESH_SECONDS, 4 * self.health_interval + HEALTH_DEADLINE_SECONDS)
        return client.reported if time.monotonic() - client.reported_at <= fresh_for else None

    def _connect(self, address: str, *, static: bool, record: registry_pb2.WorkerRecord | None = None
                 ) -> EngineClient:
        return EngineClient.connect(address, self.metadata, static=static, breaker=self.breaker_factory(),
                                    tls=self.tls, record=record)

    def _start_watch(self, client: EngineClient) -> None:
        if client not in self._watchers:
            self._watchers[client] = asyncio.create_task(self._watch(client), name=f"engine-health {client.address}")

    def _leave(self, client: EngineClient, why: str) -> None:
        logger.info("engine %s left the pool: %s (%d streams left to finish)", client.address, why, client.in_flight)
        self.policy.forget(client.member_id)
        self._forget_published(client)
        self._retire_client(client)

    def _retire_client(self, client: EngineClient) -> None:
        """Out of the pool and its health watch; its channel closes once its streams have ended."""
        self.clients.remove(client)
        client.ready = False
        watcher = self._watchers.pop(client, None)
        if watcher is not None:
            watcher.cancel()
        if not any(c.address == client.address for c in self.clients):
            self._drop_metrics(client.address)
        self._retiring[client] = asyncio.create_task(self._retire(client), name=f"engine-retire {client.address}")

    async def _retire(self, client: EngineClient) -> None:
        try:
            while client.in_flight > 0:
                await asyncio.sleep(_RETIRE_POLL_SECONDS)
            await client.channel.close()
        finally:
            self._retiring.pop(client, None)

    # -- health ------------------------------------------------------------------------------------

    async def _watch(self, client: EngineClient) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._poll_every_interval(client))
            group.create_task(self._follow_pushed_health(client))

    async def _poll_every_interval(self, client: EngineClient) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self._poll(client)
            except asyncio.CancelledError:
                raise
            except Exception:  # the watcher must outlive any one failure
                logger.exception("health check of engine %s failed", client.address)
            await asyncio.sleep(max(0.0, self.health_interval - (loop.time() - started)))

    async def _follow_pushed_health(self, client: EngineClient) -> None:
        """The worker's health as it pushes it (gRPC health Watch): a drain or an engine stall takes it out
        of rotation the moment it says so, not at the next poll, when requests would already have been
        sent to it and refused. This only ever takes a worker out: coming back is the polls' decision (they
        read its ModelInfo), and they alone find a worker that is cut off or frozen."""
        request = health_pb2.HealthCheckRequest(service=ENGINE_SERVICE)
        while True:
            try:
                async for reply in client.health.Watch(request):
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        continue
                    client.pushed_unready += 1
                    if client.ready:
                        client.ready = False
                        client.last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                        logger.warning("engine %s is not ready: it says %s", client.address, client.last_error)
                        self._publish(client)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # a worker without Watch: the polls alone watch it
            except Exception:  # the follower must outlive any one failure
                logger.exception("health watch of engine %s failed", client.address)
            # The stream ends when the worker goes away or the channel reconnects: follow it again once
            # it could answer (the channel's own backoff paces the dials).
            await asyncio.sleep(self.health_interval)

    async def _poll(self, client: EngineClient) -> None:
        was_ready = client.ready
        error_before = client.last_error
        info_before = client.info
        await client.poll(HEALTH_DEADLINE_SECONDS)
        if client not in self.clients:  # it left while the check was out
            return
        if client.ready and not was_ready:
            assert client.info is not None
            restarted = info_before is not None and info_before.created != client.info.created
            if restarted and client.absent_since is not None:
                # A registered worker whose key is gone, answering again as another process: its address
                # now belongs to someone else (a reused IP), who registers under its own record.
                self._leave(client, "its address answers as another process while its registry key is gone")
                return
            if restarted:
                # Restarted: whatever the index says it held is gone. (Unready and back with the same
                # engine, after missed deadlines say, its cache is as warm as it was.)
                self.policy.forget(client.member_id)
                logger.info("engine %s restarted: its cache affinity is forgotten", client.address)
            logger.info("engine %s is ready (%s)", client.address, ", ".join(client.info.served_model_names))
        elif not client.ready and (was_ready or client.last_error not in ("", error_before)):
            # Clients are told only that no worker is ready; the operator reads why here (a worker that
            # refuses the gateway's key, say), once per change.
            logger.warning("engine %s is not ready: %s", client.address, client.why_not_ready())
        self._note_cache_incarnation(client)
        self._publish(client)

    def _note_cache_incarnation(self, client: EngineClient) -> None:
        """Forgets the shared index of a cache service that reports a new incarnation: it restarted empty.
        The first one heard is only remembered (this gateway knew nothing of it before), and an old one,
        from a worker that has not read the new one yet, is no news."""
        group = client.cache_group
        incarnation = client.reported.prefix_cache_incarnation if client.reported is not None else ""
        if not group or not incarnation:
            return
        seen = self._cache_incarnations.get(group)
        if seen is None:
            self._cache_incarnations[group] = {incarnation: None}
            return
        if incarnation in seen:
            return
        seen[incarnation] = None
        while len(seen) > _INCARNATIONS_KEPT:
            del seen[next(iter(seen))]
        self.policy.forget_cache_group(group)
        logger.info("cache service %s restarted (incarnation %s, reported by engine %s): its shared cache "
                    "affinity is forgotten", group, incarnation, client.address)

    def _publish(self, client: EngineClient) -> None:
        address = client.address
        WORKER_READY.labels(address).set(1 if client.ready else 0)
        report = client.reported or engine_pb2.Load()
        WORKER_LOAD.labels(address, "running").set(report.num_running_requests)
        WORKER_LOAD.labels(address, "waiting").set(report.num_waiting_requests)
        WORKER_LOAD.labels(address, "kv_cache_usage").set(report.kv_cache_usage)
        WORKER_LOAD.labels(address, "gateway_streams").set(client.in_flight)
        CIRCUIT_STATE.labels(address).set(client.breaker.state(self.clock()))

    @staticmethod
    def _drop_metrics(address: str) -> None:
        # Another member may still have this address (it left and came back): it republishes next tick.
        # Zeroed first: in prometheus_client's multiprocess mode (--api-server-count > 1) remove() keeps
        # the series, which would then show a departed worker as ready, with its last load, for good.
        WORKER_READY.labels(address).set(0)
        CIRCUIT_STATE.labels(address).set(0)
        for kind in _LOAD_KINDS:
            WORKER_LOAD.labels(address, kind).set(0)
        with contextlib.suppress(KeyError):
            WORKER_READY.remove(address)
        with contextlib.suppress(KeyError):
            CIRCUIT_STATE.remove(address)
        for kind in _LOAD_KINDS:
            with contextlib.suppress(KeyError):
                WORKER_LOAD.remove(address, kind)

    # -- what is served ----------------------------------------------------------------------------

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

    # -- routing -----------------------------------------------------------------------------------

    def route(self, key: RouteKey, *, exclude: Collection[EngineClient] = ()) -> Route:
        """The worker for a generate request, by the --routing policy, among the ready workers of the
        model whose breaker lets it through, but for `exclude` (those a retry already tried)."""
        model, serving = self._serving(key.model)
        now = self.clock()
        eligible = [c for c in serving if c not in exclude and c.breaker.allows(now)]
        if not eligible:
            raise self._none_eligible(model, serving, exclude, now)
        choice = self.policy.choose(eligible, model=model, key=key)
        client = choice.target
        client.breaker.routed(now)
        ROUTING_DECISIONS.labels(self.policy.name, choice.reason).inc()
        CIRCUIT_STATE.labels(client.address).set(client.breaker.state(now))
        return Route(client, self.policy.name, choice.reason, choice.prefix_match, choice.prefix_hashes)

    def prefilled(self, route: Route) -> None:
        """The routed request's first message came: its worker has prefilled the prompt."""
        if route.prefix_hashes and route.client.prefix_view_id:
            self.policy.prefilled(route.client.member_id, route.prefix_hashes)

    def record_outcome(self, client: EngineClient, *, worker_fault: bool) -> None:
        """How a routed request went, for the worker's breaker: `worker_fault` for a fault of the worker
        (failover.is_worker_fault, or a stream that ended without `finished`), never for a
        refusal of the client's input. Call it once per route(), when the outcome is known."""
        now = self.clock()
        before = client.breaker.state(now)
        after = client.breaker.record(now, worker_fault=worker_fault)
        if after is BreakerState.OPEN and before is not BreakerState.OPEN:
            logger.warning("engine %s: circuit open for %.0f s after repeated worker faults", client.address,
                           client.breaker.remaining(now))
        elif after is BreakerState.CLOSED and before is not BreakerState.CLOSED:
            logger.info("engine %s: circuit closed, the trial request succeeded", client.address)
        if client in self.clients:
            CIRCUIT_STATE.labels(client.address).set(after)

    def pick(self, model: str | None) -> EngineClient:
        """The least-loaded ready worker of the model whose breaker is not open (for tokenize,
        detokenize: calls that do not warrant the routing policy)."""
        model, serving = self._serving(model)
        now = self.clock()
        usable = [c for c in serving if c.breaker.state(now) is not BreakerState.OPEN]
        if not usable:
            raise self._none_eligible(model, serving, (), now)
        least = min(c.load for c in usable)
        return self.rng.choice([c for c in usable if c.load <= least])

    def _serving(self, model: str | None) -> tuple[str, list[EngineClient]]:
        """The model routed on (the default resolved) and its ready workers; raises 503 or 404."""
        ready = self.ready_clients()
        if not ready:
            raise self.unavailable()
        if not model:
            assert ready[0].info is not None
            model = ready[0].info.served_model_names[0]
        serving = [c for c in ready if c.serves(model)]
        if not serving:
            if any(c.serves(model) for c in self.clients):
                # Its workers are known but none is ready now (restarting, say): worth a retry.
                raise self.unavailable(model)
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model, serving

    def unavailable(self, model: str | None = None) -> APIError:
        """503: no worker (of the model) is ready; says the state of each, by its place in the pool. The
        client is told no worker's address nor the gRPC library's message (internal details, logged here
        and by the health watch), and retries."""
        members = [c for c in self.clients if not model or c.serves(model)] or self.clients
        logger.debug("503: no worker ready: %s", "; ".join(f"{c.address}: {c.why_not_ready()}" for c in members))
        states = [f"worker {i + 1} of {len(members)}: {'not ready' if c.last_error else 'starting'}"
                  for i, c in enumerate(members)]
        what = f"of the model `{model}` " if model else ""
        return service_unavailable(f"No engine worker {what}is ready ({'; '.join(states) or 'no worker registered'})"
                                   "; retry later.")

    def _none_eligible(self, model: str, serving: Sequence[EngineClient], exclude: Collection[EngineClient],
                       now: float) -> APIError:
        parts = []
        waits = []
        for i, client in enumerate(serving):
            name = f"worker {i + 1} of {len(serving)}"
            if client in exclude:
                parts.append(f"{name}: already tried by this request")
            elif client.breaker.state(now) is BreakerState.OPEN:
                waits.append(client.breaker.retry_after(now))
                parts.append(f"{name}: circuit open after repeated worker faults, "
                             f"{client.breaker.retry_after(now)} s to a trial request")
            else:
                parts.append(f"{name}: circuit half-open, a trial request is under way")
        return service_unavailable(f"No engine worker of the model `{model}` can take the request now "
                                   f"({'; '.join(parts)}); retry later.", retry_after=min(waits, default=1))
