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
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis.asyncio
from redis.connection import parse_url
from redis.exceptions import RedisError

from taco_llm.protos import registry_pb2
from taco_llm.protos.registry_keys import (
    DEFAULT_TTL_SECONDS,
    HEARTBEATS_PER_TTL,
    INSTANCE_ENV,
    REGISTRY_KEY_PREFIX,
)

logger = logging.getLogger(__name__)

# Hosts that mean "every interface": no gateway can dial them.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
# A stopping worker waits this long at most for Redis to delete its key (the TTL removes it anyway).
DELETE_TIMEOUT_SECONDS = 1.0
# Redis's port where a registry URL names none (redis-py's default too).
REDIS_DEFAULT_PORT = 6379
# Where the default route leads, asked only when the registry's host cannot be resolved now (its
# container not started yet, a DNS hiccup): a UDP socket connect()ed here tells which local address the
# kernel would send from; no packet is sent. An address of TEST-NET-3 (RFC 5737): never anyone's.
DEFAULT_ROUTE_PROBE = "203.0.113.1"


class AdvertiseError(ValueError):
    """No address other hosts can dial this worker at; the message names the flag that fixes it."""


@dataclass(frozen=True)
class RegistryOptions:
    url: str
    ttl: float
    advertise_address: str
    # Set when the address was derived from a wildcard --grpc-host, not given: it is derived again at each
    # heartbeat, since a host's address can change under a running worker (a container reconnected to its
    # network gets the address that is free then).
    wildcard_port: int | None = None
    # --publish-prefix-cache: None where not given (on, unless prefix caching is off).
    publish_prefix_cache: bool | None = None

    def current_address(self) -> str | None:
        """The address to advertise now, where it is derived; None where it is fixed or cannot be told now."""
        if self.wildcard_port is None:
            return None
        endpoint = _registry_endpoint(self.url)
        if endpoint is None:
            return None
        try:
            host = route_source(*endpoint)
        except (OSError, UnicodeError):
            return None  # cut off, say: the address it had stays until the route is back
        if _is_loopback_ip(host) and not registry_is_local(self.url):
            return None
        return _target(host, self.wildcard_port)


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
                       "a wildcard host such as 0.0.0.0 replaced by this host's address on the interface that "
                       "routes to the registry; a loopback address is used only for a registry on this host "
                       "or when given here)")
    group.add_argument("--publish-prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="publish which prompt prefixes this worker's KV cache holds (from vLLM's KV cache "
                       "events) in the registry's Redis, so that every gateway routes on what the caches hold "
                       "(default: on with --registry-url and prefix caching)")


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _is_loopback_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text.strip("[]").partition("%")[0]).is_loopback
    except ValueError:
        return False


def _loopback_name(host: str) -> bool | None:
    """Whether every address `host` names is a loopback one; None when it cannot be resolved now."""
    if _is_loopback_ip(host):
        return True
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return bool(infos) and all(_is_loopback_ip(str(info[4][0])) for info in infos)


def _registry_endpoint(url: str) -> tuple[str, int] | None:
    """The registry's host and port; None for a Unix socket (on this host by definition)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return None
    return parts.hostname or "localhost", parts.port or REDIS_DEFAULT_PORT


def registry_is_local(url: str) -> bool:
    """Whether the registry is on this host only (a Unix socket, or a host that resolves to loopback):
    then every gateway that reads it is on this host too, and a loopback address is the right one."""
    endpoint = _registry_endpoint(url)
    return endpoint is None or _loopback_name(endpoint[0]) is True


def route_source(host: str, port: int) -> str:
    """The local address this host sends from to reach host:port: the address of the interface that
    routes there. A UDP socket's connect() only consults the routing table: no packet is sent."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    failure: OSError = OSError(f"{host} resolves to no address")
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                return str(probe.getsockname()[0])
        except OSError as error:
            failure = error
    raise failure


def _wildcard_host(grpc_host: str, registry_url: str, *, local: bool) -> str:
    endpoint = _registry_endpoint(registry_url)
    if endpoint is None:
        return "127.0.0.1"
    host, port = endpoint
    try:
        source = route_source(host, port)
    except (OSError, UnicodeError) as error:
        try:
            source = route_source(DEFAULT_ROUTE_PROBE, port)
        except OSError:
            raise AdvertiseError(
                f"--grpc-host {grpc_host} listens on every interface, and neither a route to the registry's host "
                f"{host} ({error}) nor a default route says which address other hosts reach this worker at: "
                "give --advertise-address HOST:PORT") from None
        logger.warning("the registry's host %s cannot be resolved now (%s): advertising %s, this host's "
                       "address on its default route (--advertise-address sets another)", host, error, source)
    if _is_loopback_ip(source) and not local:
        raise AdvertiseError(
            f"--grpc-host {grpc_host}: the interface that routes to the registry's host {host} has the loopback "
            f"address {source}, which gateways on other hosts cannot dial: give --advertise-address HOST:PORT")
    return source


def advertise_address(grpc_host: str, grpc_port: int, registry_url: str) -> str:
    """The HOST:PORT this worker registers under when no --advertise-address is given. A wildcard
    --grpc-host becomes the address of the interface that routes to the registry (never the host name's
    address: Debian's /etc/hosts maps that to 127.0.1.1). A loopback address is refused unless the
    registry is on this host (then so is every gateway that reads it); raises AdvertiseError."""
    local = registry_is_local(registry_url)
    if grpc_host in WILDCARD_HOSTS:
        host = _wildcard_host(grpc_host, registry_url, local=local)
    else:
        if not local and _loopback_name(grpc_host):
            raise AdvertiseError(
                f"--grpc-host {grpc_host} is a loopback address, which gateways on other hosts cannot dial, and "
                f"the registry (--registry-url) is not on this host: listen on an address they reach (--grpc-host "
                "0.0.0.0, or this host's address), or give --advertise-address HOST:PORT if a loopback one is meant")
        host = grpc_host
    return _target(host, grpc_port)


def _target(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal, as gRPC targets write it
    return f"{host}:{port}"


def default_instance(address: str) -> str:
    """What this worker runs as, the same across its restarts: $TACO_LLM_INSTANCE (a pod sets it to its
    name, say), else this host's name and the advertised port (the workers of one `serve` share a host)."""
    given = os.environ.get(INSTANCE_ENV, "").strip()
    if given:
        return given
    return f"{socket.gethostname()}:{address.rpartition(':')[2]}"


def registry_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RegistryOptions | None:
    """Checks the flags (errors exit via argparse, naming the flag); None without --registry-url."""
    url: str | None = args.registry_url
    if url is None:
        for flag, value in (("--registry-ttl", args.registry_ttl), ("--advertise-address", args.advertise_address),
                            ("--publish-prefix-cache", args.publish_prefix_cache or None)):
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
        return RegistryOptions(url=url, ttl=ttl, advertise_address=args.advertise_address,  # even loopback: asked
                               publish_prefix_cache=args.publish_prefix_cache)
    try:
        address = advertise_address(args.grpc_host, args.grpc_port, url)
    except AdvertiseError as error:
        parser.error(str(error))
    derived = args.grpc_host in WILDCARD_HOSTS
    return RegistryOptions(url=url, ttl=ttl, advertise_address=address,
                           wildcard_port=args.grpc_port if derived else None,
                           publish_prefix_cache=args.publish_prefix_cache)


def _now_ms() -> int:
    return int(time.time() * 1000)


class Registrar:
    """Keeps one worker's record in the registry, from `start` until `stop`."""

    def __init__(self, url: str, address: str, served_model_names: list[str], *, ttl: float = DEFAULT_TTL_SECONDS,
                 instance: str | None = None, readdress: Callable[[], str | None] | None = None,
                 worker_id: str | None = None, publishes_prefix_cache: bool = False):
        self.ttl_ms = max(1, round(ttl * 1000))
        # worker_id is this process's incarnation; instance outlives it (see registry.proto).
        self.record = registry_pb2.WorkerRecord(worker_id=worker_id or uuid.uuid4().hex, address=address,
                                                served_model_names=served_model_names,
                                                publishes_prefix_cache=publishes_prefix_cache,
                                                instance=instance or default_instance(address), ttl_ms=self.ttl_ms)
        self.key = REGISTRY_KEY_PREFIX + self.record.worker_id
        self.interval = ttl / HEARTBEATS_PER_TTL
        # A write that takes longer than a beat's interval has failed: the next beat tries again.
        self.client = redis.asyncio.Redis.from_url(url, socket_timeout=self.interval,
                                                   socket_connect_timeout=self.interval)
        self.url = url
        # The address to advertise now (RegistryOptions.current_address), asked before each write.
        self.readdress = readdress
        self._lookup: asyncio.Future[str | None] | None = None
        self.heartbeats: asyncio.Task[None] | None = None
        self.reachable = True  # so an outage is logged once, not on every beat

    async def start(self) -> None:
        """Writes the record (or logs why not) and starts the heartbeat."""
        self.record.started_unix_ms = _now_ms()
        await self.beat()
        self.heartbeats = asyncio.create_task(self._beat_forever(), name="registry-heartbeat")
        logger.info("registered as %s (instance %s, %s) in %s", self.record.worker_id, self.record.instance,
                    self.record.address, self.url)

    async def beat(self) -> bool:
        """Writes the record once; False when Redis did not take it."""
        self._follow_address()
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

    def _follow_address(self) -> None:
        """Applies the address the last lookup found, and starts the next one. Lookups run off the event
        loop (they resolve the registry's host name), one at a time: a resolver that hangs (as during a
        partition) holds one thread, not one more per beat, and no beat waits on it."""
        if self.readdress is None:
            return
        lookup = self._lookup
        if lookup is not None:
            if not lookup.done():
                return
            address = lookup.result() if not lookup.cancelled() and lookup.exception() is None else None
            if address and address != self.record.address:
                logger.info("this worker's address changed from %s to %s: registering the new one",
                            self.record.address, address)
                self.record.address = address
        self._lookup = asyncio.ensure_future(asyncio.to_thread(self.readdress))

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
        if self._lookup is not None:
            self._lookup.cancel()
        try:
            await asyncio.wait_for(self.client.delete(self.key), DELETE_TIMEOUT_SECONDS)
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("could not delete this worker's registry entry (%s); it expires within %.1fs",
                           error or type(error).__name__, self.ttl_ms / 1000)
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()
