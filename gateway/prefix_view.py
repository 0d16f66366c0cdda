"""The fleet's prefix caches as the workers publish them: one view that every gateway replica reads alike.

Workers started with --registry-url publish which prompt chunks their KV cache holds (the gateway's own
chunk digests, sent with each request; protos/prefix_view.py's layout in the registry's Redis): a set
per worker, and one stream of changes. A gateway reads every set once, then follows the stream from
the entry that was last when it started reading, so nothing written in between is lost (a change
applied twice is applied in the same order, to the same end). It starts again from the sets whenever
Redis fails it.

Routing reads the view without waiting on anything: `match` is a lookup in memory, and while the view
is not synced (Redis unreachable at start, say) routing uses each gateway's own approximate index
(prefix_index.py), as it does for workers that publish nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio
from redis.exceptions import RedisError

from taco_llm.protos.prefix_view import (
    ADDED,
    EVENT_DIGESTS,
    EVENT_KIND,
    EVENT_WORKER,
    PREFIX_EVENTS_STREAM,
    PREFIX_SET_KEY_PREFIX,
    REMOVED,
    RESET,
    unpack_digests,
)

from .prefix_index import leading_held

logger = logging.getLogger(__name__)

# How long one read of the stream waits for news before asking again (and noticing a dead connection).
READ_BLOCK_MS = 1_000
READ_COUNT = 1_000
RETRY_SECONDS = 1.0
_NOTHING: frozenset[bytes] = frozenset()


class SharedPrefixView:
    """What each publishing worker's KV cache holds, by worker_id, as chunk digests."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=2.0,
                                                   socket_timeout=READ_BLOCK_MS / 1000 + 2.0)
        self._held: dict[str, set[bytes]] = {}
        self._cursor = "0-0"
        self.synced = False
        self.changes_applied = 0

    def match(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many of the leading hashes the worker's cache holds, up to the first it does not."""
        return leading_held(hashes, self._held.get(worker_id, _NOTHING))

    def held(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, _NOTHING))

    def forget(self, worker_id: str) -> None:
        """The worker left the pool: its process is gone, and so is its cache."""
        self._held.pop(worker_id, None)

    async def run(self) -> None:
        """Syncs from Redis, then follows it, until cancelled; starts again after any failure."""
        failing = False
        while True:
            try:
                await self._sync()
                if failing:
                    logger.info("the shared prefix view at %s is readable again", self.url)
                    failing = False
                await self._follow()
            except (RedisError, OSError, TimeoutError) as error:
                self.synced = False
                if not failing:
                    failing = True
                    logger.warning("cannot read the shared prefix view at %s (%s): routing on this gateway's own "
                                   "index until it can", self.url, error or type(error).__name__)
                await asyncio.sleep(RETRY_SECONDS)

    async def close(self) -> None:
        await self.client.aclose()

    async def _sync(self) -> None:
        # redis-py types its replies loosely; without decode_responses they are bytes.
        last: Any = await self.client.xrevrange(PREFIX_EVENTS_STREAM, count=1)
        cursor = last[0][0].decode() if last else "0-0"
        held: dict[str, set[bytes]] = {}
        async for key in self.client.scan_iter(match=PREFIX_SET_KEY_PREFIX + "*", count=1_000):
            worker_id = bytes(key).decode()[len(PREFIX_SET_KEY_PREFIX):]
            members: Any = await self.client.smembers(key)
            held[worker_id] = {bytes(member) for member in members}
        self._held, self._cursor, self.synced = held, cursor, True

    async def _follow(self) -> None:
        while True:
            reply: Any = await self.client.xread({PREFIX_EVENTS_STREAM: self._cursor}, count=READ_COUNT,
                                                 block=READ_BLOCK_MS)
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    try:
                        self.apply(fields)
                    except ValueError as error:
                        logger.warning("skipped a shared prefix view change %s: %s", entry_id.decode(), error)
                    self._cursor = entry_id.decode()

    def apply(self, fields: dict[bytes, bytes]) -> None:
        """One change a worker published; raises ValueError for one that is not of the layout."""
        if EVENT_WORKER not in fields or EVENT_KIND not in fields:
            raise ValueError("a prefix view change without its worker or its kind")
        worker_id = fields[EVENT_WORKER].decode(errors="replace")
        kind = fields[EVENT_KIND]
        digests = unpack_digests(fields.get(EVENT_DIGESTS, b""))
        if kind == ADDED:
            self._held.setdefault(worker_id, set()).update(digests)
        elif kind == REMOVED:
            self._held.get(worker_id, set()).difference_update(digests)
        elif kind == RESET and digests:
            self._held[worker_id] = set(digests)
        elif kind == RESET:
            self._held.pop(worker_id, None)  # empty: starting, or leaving
        else:
            raise ValueError(f"a prefix view change of unknown kind {kind!r}")
        self.changes_applied += 1
