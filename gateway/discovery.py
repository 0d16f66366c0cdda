"""Workers found in the Redis registry (protos/registry.proto): the gateway lists the records every
LIST_INTERVAL_SECONDS and hands the pool the records registered now, by worker (one per worker
process: its worker_id); the pool adds and removes members.

Records are only read here. While Redis cannot be reached the pool keeps its members (a registry outage
must not empty a healthy fleet): the outage is logged once, and listing goes on until Redis answers. A
Redis that answers but has lost the keys (restarted without persistence, flushed, failed over to a
lagging replica) is no different to the pool than keys that expired: it keeps a missing member for its
record's TTL (engine_pool.py), by which time a live worker has written its key again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from taco_llm.protos import registry_pb2
from taco_llm.protos.registry_keys import LIST_INTERVAL_SECONDS, REGISTRY_KEY_PREFIX

logger = logging.getLogger(__name__)

_SCHEMES = ("redis", "rediss", "unix")
# A listing that takes longer than this counts as an outage: the loop must not hang on a dead Redis.
REDIS_TIMEOUT_SECONDS = 1.0


class RegistryUnavailable(Exception):
    pass


def check_registry_url(url: str, *, flag: str = "--registry-url") -> None:
    """Raises ValueError saying what is wrong with a Redis URL flag (--registry-url, ...), before anything
    connects."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port that is not a number or out of range
    except ValueError as error:
        raise ValueError(f"{flag} {url!r} is not a URL ({error})") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"{flag} {url!r}: the scheme must be one of "
                         f"{', '.join(s + '://' for s in _SCHEMES)}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"{flag} {url!r} names no socket path")
    elif not parts.hostname:
        raise ValueError(f"{flag} {url!r} names no host")
    if port == 0:
        raise ValueError(f"{flag} {url!r}: port 0 is not a port to connect to")


class Registry:
    """Reads the worker records under REGISTRY_KEY_PREFIX."""

    def __init__(self, url: str, *, prefix: str = REGISTRY_KEY_PREFIX) -> None:
        check_registry_url(url)
        self.url = url
        self.prefix = prefix
        # decode_responses stays off: the values are serialized protobufs.
        self._redis: aioredis.Redis = aioredis.from_url(url, socket_timeout=REDIS_TIMEOUT_SECONDS,
                                        socket_connect_timeout=REDIS_TIMEOUT_SECONDS)
        self._bad_keys: set[bytes] = set()

    async def list_workers(self) -> dict[str, registry_pb2.WorkerRecord]:
        """The records registered now, by worker_id (the key's own suffix for a record without one);
        raises RegistryUnavailable when Redis does not answer."""
        try:
            keys = [key async for key in self._redis.scan_iter(match=f"{self.prefix}*", count=1000)]
            values = await self._redis.mget(keys) if keys else []
        except (RedisError, OSError) as error:
            raise RegistryUnavailable(f"{type(error).__name__}: {error}") from None
        records: dict[str, registry_pb2.WorkerRecord] = {}
        for key, value in zip(keys, values, strict=True):
            if not isinstance(value, bytes):  # None: expired between SCAN and MGET
                continue
            record = registry_pb2.WorkerRecord()
            try:
                record.ParseFromString(value)
            except DecodeError:
                record.Clear()
            if not record.address:
                if key not in self._bad_keys:
                    self._bad_keys.add(key)
                    logger.warning("registry key %r holds no WorkerRecord with an address; ignored", key)
                continue
            if not record.worker_id:
                record.worker_id = key[len(self.prefix.encode()):].decode(errors="replace")
            records[record.worker_id] = record
        return records

    async def close(self) -> None:
        await self._redis.aclose()


async def watch(registry: Registry, apply: Callable[[Mapping[str, registry_pb2.WorkerRecord]], None], *,
                interval: float = LIST_INTERVAL_SECONDS) -> None:
    """Lists the registry every `interval` seconds and applies each listing; runs until cancelled."""
    outage = False
    while True:
        try:
            records = await registry.list_workers()
        except RegistryUnavailable as error:
            if not outage:
                logger.warning("worker registry %s unreachable (%s): keeping the current workers, retrying",
                               registry.url, error)
            outage = True
        else:
            if outage:
                logger.info("worker registry %s reachable again", registry.url)
            outage = False
            try:
                apply(records)
            except Exception:  # the watcher must outlive any one bad listing
                logger.exception("applying the worker registry's listing failed")
        await asyncio.sleep(interval)
