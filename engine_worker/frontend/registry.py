"""The worker's entry in the Redis registry (protos/registry.proto): how gateways find it.

Once the engine serves, the worker writes its WorkerRecord under its own key with a time-to-live and
rewrites it HEARTBEATS_PER_TTL times per TTL from a task of its own; on SIGTERM it deletes the key.
Redis being down, slow or restarted never stops or slows the worker: every write has a deadline, a
failed one is retried on the next beat, and an outage is logged once when it starts and once when it
ends. The engine's loop never waits on Redis: the heartbeat is a separate task, on redis.asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import time
import uuid
from dataclasses import dataclass

import redis.asyncio
from redis.connection import parse_url
from redis.exceptions import RedisError

from taco_llm.protos import registry_pb2
from taco_llm.protos.registry_keys import DEFAULT_TTL_SECONDS, HEARTBEATS_PER_TTL, REGISTRY_KEY_PREFIX

logger = logging.getLogger(__name__)

# Hosts that mean "every interface": no gateway can dial them.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
# A stopping worker waits this long at most for Redis to delete its key (the TTL removes it anyway).
DELETE_TIMEOUT_SECONDS = 1.0


@dataclass(frozen=True)
class RegistryOptions:
    url: str
    ttl: float
    advertise_address: str


def add_registry_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the fleet: registering with gateways")
    group.add_argument("--registry-url", default=None, metavar="URL",
                       help="Redis (redis://HOST:PORT/DB) where this worker registers once it serves, so that "
                       "gateways started with the same --registry-url route to it")
    group.add_argument("--registry-ttl", type=float, default=None, metavar="SECONDS",
                       help="how long the worker's registry entry outlives its last heartbeat; it is rewritten "
                       f"{HEARTBEATS_PER_TTL} times per TTL (default {DEFAULT_TTL_SECONDS:g})")
    group.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                       help="the address gateways dial this worker at (default: --grpc-host:--grpc-port, with "
                       "a wildcard host such as 0.0.0.0 replaced by this host's IP address)")


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _dialable(host: str, port: int) -> str:
    if host in WILDCARD_HOSTS:
        # This host's own address, as other containers of a compose project (or hosts) reach it.
        host = socket.gethostbyname(socket.gethostname())
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal, as gRPC targets write it
    return f"{host}:{port}"


def registry_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RegistryOptions | None:
    """Checks the flags (errors exit via argparse, naming the flag); None without --registry-url."""
    url: str | None = args.registry_url
    if url is None:
        for flag, value in (("--registry-ttl", args.registry_ttl), ("--advertise-address", args.advertise_address)):
            if value is not None:
                parser.error(f"{flag} needs --registry-url")
        return None
    try:
        parse_url(url)
    except ValueError as error:
        parser.error(f"--registry-url {url!r}: {error}")
    ttl = DEFAULT_TTL_SECONDS if args.registry_ttl is None else args.registry_ttl
    if not ttl > 0:
        parser.error(f"--registry-ttl must be positive, got {ttl}")
    if args.advertise_address is not None:
        if _host_port(args.advertise_address) is None:
            parser.error(f"--advertise-address {args.advertise_address!r}: expected HOST:PORT")
        address = args.advertise_address
    else:
        try:
            address = _dialable(args.grpc_host, args.grpc_port)
        except OSError as error:
            parser.error(f"--grpc-host {args.grpc_host} listens everywhere and this host's own address cannot "
                         f"be found ({error}): give --advertise-address HOST:PORT")
    return RegistryOptions(url=url, ttl=ttl, advertise_address=address)


def _now_ms() -> int:
    return int(time.time() * 1000)


class Registrar:
    """Keeps one worker's record in the registry, from `start` until `stop`."""

    def __init__(self, url: str, address: str, served_model_names: list[str], *, ttl: float = DEFAULT_TTL_SECONDS):
        self.record = registry_pb2.WorkerRecord(worker_id=uuid.uuid4().hex, address=address,
                                                served_model_names=served_model_names)
        self.key = REGISTRY_KEY_PREFIX + self.record.worker_id
        self.ttl_ms = max(1, round(ttl * 1000))
        self.interval = ttl / HEARTBEATS_PER_TTL
        # A write that takes longer than a beat's interval has failed: the next beat tries again.
        self.client = redis.asyncio.Redis.from_url(url, socket_timeout=self.interval,
                                                   socket_connect_timeout=self.interval)
        self.url = url
        self.heartbeats: asyncio.Task[None] | None = None
        self.reachable = True  # so an outage is logged once, not on every beat

    async def start(self) -> None:
        """Writes the record (or logs why not) and starts the heartbeat."""
        self.record.started_unix_ms = _now_ms()
        await self.beat()
        self.heartbeats = asyncio.create_task(self._beat_forever(), name="registry-heartbeat")
        logger.info("registered as %s (%s) in %s", self.record.worker_id, self.record.address, self.url)

    async def beat(self) -> bool:
        """Writes the record once; False when Redis did not take it."""
        self.record.heartbeat_unix_ms = _now_ms()
        try:
            await asyncio.wait_for(self.client.set(self.key, self.record.SerializeToString(), px=self.ttl_ms),
                                   self.interval)
        except (RedisError, OSError, TimeoutError) as error:
            if self.reachable:
                self.reachable = False
                logger.warning("cannot write this worker's registry entry to %s (%s); retrying every %.1fs",
                               self.url, error or type(error).__name__, self.interval)
            return False
        if not self.reachable:
            self.reachable = True
            logger.info("the registry at %s is reachable again; this worker is registered", self.url)
        return True

    async def _beat_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time()
        while True:
            # On a fixed cadence: a slow write does not push the next one later.
            next_beat += self.interval
            await asyncio.sleep(max(0.0, next_beat - loop.time()))
            await self.beat()

    async def stop(self) -> None:
        """Ends the heartbeat and deletes the key, so gateways stop routing here at once; a Redis that does
        not answer within DELETE_TIMEOUT_SECONDS leaves the key to expire."""
        if self.heartbeats is not None:
            self.heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.heartbeats
            self.heartbeats = None
        try:
            await asyncio.wait_for(self.client.delete(self.key), DELETE_TIMEOUT_SECONDS)
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("could not delete this worker's registry entry (%s); it expires within %.1fs",
                           error or type(error).__name__, self.ttl_ms / 1000)
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()
