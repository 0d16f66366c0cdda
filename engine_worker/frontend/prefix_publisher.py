"""Publishes which prompt chunks this worker's prefix cache holds, so that every gateway routes on it.

A gateway names a prompt's prefix by chunk digests (engine.proto PrefixChunks) and sends them with the
request. Once the engine has prefilled the request, its KV cache events (vLLM's --kv-events-config,
here on a ZMQ socket of this worker's own) have told which blocks it cached; the request's digests are
attached to those blocks (held_prefixes.py), and published as held. When vLLM evicts a block, the
digests it held up are published as gone. What is published is protos/prefix_view.py's layout, in the
registry's Redis: a set per worker and a stream of changes that gateways follow.

Nothing here slows a request: notes are taken on the event loop without I/O, and Redis is written by a
task of its own, every FLUSH_SECONDS, with a deadline. Redis down or slow loses no state: the next
write that succeeds rewrites the whole set (a RESET), and until then gateways keep the last they read.
The engine's own loop never waits on this: vLLM publishes its events from a thread of its own, and
drops them rather than block when nobody reads.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import redis.asyncio
import zmq
import zmq.asyncio
from redis.exceptions import RedisError
from vllm.config import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs

from taco_llm.protos import engine_pb2
from taco_llm.protos.prefix_view import (
    ADDED,
    EVENT_DIGESTS,
    EVENT_KIND,
    EVENT_WORKER,
    PREFIX_EVENTS_KEPT,
    PREFIX_EVENTS_STREAM,
    PREFIX_SET_KEY_PREFIX,
    REMOVED,
    RESET,
    pack_digests,
)

from ..vllm_internals import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from .held_prefixes import HeldBlocks, HeldChunks, chunk_blocks

logger = logging.getLogger(__name__)

# How often changes are written: the time a gateway may route without knowing of a prefill just done.
FLUSH_SECONDS = 0.05
# How long a request's chunks wait for the events of its blocks (they come on another socket than its
# output, within milliseconds unless the machine is starved); past it, what was found is published and
# the rest is not.
PENDING_SECONDS = 30.0
# Requests waiting for their blocks' events at most; the oldest are resolved with what is known first.
MAX_PENDING = 4096


class PublishError(ValueError):
    """The flags ask to publish the prefix cache and it cannot be; the message names the flags."""


def events_endpoint(engine: AsyncEngineArgs, *, asked: bool) -> str | None:
    """Where this worker reads its engine's KV cache events, turning them on (on a ZMQ socket in a folder
    of its own) unless --kv-events-config already does; None where the prefix cache cannot be
    published (prefix caching off: then only where not `asked`, else PublishError)."""
    if engine.enable_prefix_caching is False:
        if asked:
            raise PublishError("--publish-prefix-cache needs prefix caching (drop --no-enable-prefix-caching)")
        logger.info("prefix caching is off: this worker publishes no prefix cache")
        return None
    given = engine.kv_events_config
    if given is not None:
        if not given.enable_kv_cache_events or given.publisher != "zmq":
            if asked:
                raise PublishError("--publish-prefix-cache reads vLLM's KV cache events: --kv-events-config must "
                                   "enable them with the zmq publisher, or be left out")
            logger.info("--kv-events-config publishes no ZMQ events: this worker publishes no prefix cache")
            return None
        return given.endpoint
    try:
        folder = tempfile.mkdtemp(prefix="taco_llm_kv_events_")
    except OSError as error:
        if asked:
            raise PublishError(f"--publish-prefix-cache: no folder for the KV cache events' socket ({error})") from None
        logger.warning("no folder for the KV cache events' socket (%s): this worker publishes no prefix cache", error)
        return None
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    endpoint = f"ipc://{folder}/events"
    engine.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    return endpoint


def subscriber_endpoint(publisher_endpoint: str) -> str:
    """Where to connect to a publisher that binds `publisher_endpoint` (tcp://*:5557 is dialled on
    127.0.0.1)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if publisher_endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + publisher_endpoint[len(wildcard):]
    return publisher_endpoint


@dataclass(frozen=True)
class _Pending:
    chunks: engine_pb2.PrefixChunks
    token_ids: tuple[int, ...]
    expires: float


class PrefixPublisher:
    """One worker's published prefix cache, from `start` until `stop`."""

    def __init__(self, redis_url: str, worker_id: str, *, ttl: float, endpoint: str) -> None:
        self.worker_id = worker_id
        self.key = PREFIX_SET_KEY_PREFIX + worker_id
        self.ttl_ms = max(1, round(ttl * 1000))
        self.refresh_every = ttl / 3
        self.endpoint = subscriber_endpoint(endpoint)
        self.url = redis_url
        self.client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=self.refresh_every,
                                                   socket_connect_timeout=self.refresh_every)
        self.blocks = HeldBlocks()
        self.chunks = HeldChunks()
        self._pending: list[_Pending] = []
        self._added: set[bytes] = set()
        self._removed: set[bytes] = set()
        self._reset = True  # the first write states the whole (empty) set
        self._written_at = 0.0
        self._reachable = True
        self._tasks: list[asyncio.Task[None]] = []
        # The sequence number of the last batch of events read (None before the first).
        self.last_sequence: int | None = None

    # -- what the engine holds ---------------------------------------------------------------------

    def note(self, chunks: engine_pb2.PrefixChunks, token_ids: Sequence[int]) -> None:
        """A request the engine has prefilled: its chunks are held once its blocks' events have come."""
        if not chunks.digests:
            return
        pending = _Pending(chunks, tuple(token_ids), time.monotonic() + PENDING_SECONDS)
        if self._reported(pending):
            self._settle(pending)  # its blocks were cached already (a prefix hit), or their events came first
            return
        self._pending.append(pending)
        if len(self._pending) > MAX_PENDING:
            self._settle(self._pending.pop(0))

    def apply(self, events: Sequence[object]) -> None:
        """One batch of the engine's KV cache events."""
        for event in events:
            if isinstance(event, BlockStored):
                if event.group_idx in (None, 0):
                    self.blocks.stored(event.block_hashes, event.parent_block_hash, event.token_ids,
                                       event.block_size)
            elif isinstance(event, BlockRemoved):
                if event.group_idx in (None, 0):
                    for block in event.block_hashes:
                        self.blocks.removed(block)
                        for digest in self.chunks.detach(block):
                            self._added.discard(digest)
                            self._removed.add(digest)
            elif isinstance(event, AllBlocksCleared):
                self.forget_all()
        self._resolve()

    def forget_all(self) -> None:
        """Nothing is known to be held any more (the engine cleared its cache, or events were lost)."""
        self.blocks.clear()
        self.chunks.clear()
        self._added.clear()
        self._removed.clear()
        self._reset = True

    def _resolve(self) -> None:
        """Settles the requests whose blocks have all been reported (or that waited long enough)."""
        now = time.monotonic()
        waiting = []
        for pending in self._pending:
            if not self._reported(pending) and now < pending.expires:
                waiting.append(pending)
                continue
            self._settle(pending)
        self._pending = waiting

    def _reported(self, pending: _Pending) -> bool:
        """Whether every block the request's chunks need is known to be cached."""
        needed = list(chunk_blocks(pending.chunks, len(pending.token_ids), self.blocks.block_size))
        return bool(self.blocks.block_size) and (
            not needed or len(self.blocks.leading(pending.token_ids)) >= needed[-1][1])

    def _settle(self, pending: _Pending) -> None:
        leading = self.blocks.leading(pending.token_ids)
        for digest, blocks in chunk_blocks(pending.chunks, len(pending.token_ids), self.blocks.block_size):
            if blocks > len(leading):
                break
            if self.chunks.attach(digest, leading[blocks - 1]):
                self._removed.discard(digest)
                self._added.add(digest)

    # -- running -----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow_events(), name="prefix-cache-events"),
                       asyncio.create_task(self._write_forever(), name="prefix-cache-publish")]
        logger.info("publishing this worker's prefix cache to %s (KV cache events from %s)", self.url, self.endpoint)

    async def stop(self) -> None:
        """Stops, and tells gateways this worker holds nothing any more (it is leaving)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.blocks.clear()
        self.chunks.clear()
        self._pending.clear()
        self._reset = True
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._write(), self.refresh_every)
            await asyncio.wait_for(self.client.delete(self.key), self.refresh_every)
        await self.client.aclose()

    async def _follow_events(self) -> None:
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:  # (topic, sequence number, payload)
                    continue
                sequence = int.from_bytes(frames[1], "big")
                last_sequence, self.last_sequence = self.last_sequence, sequence
                if last_sequence is not None and sequence != last_sequence + 1:
                    # Batches were dropped (vLLM's publisher drops rather than block): a removal may be
                    # among them, so nothing known is trusted; the next requests publish afresh.
                    logger.warning("KV cache event batches %d to %d were lost: this worker's published prefix "
                                   "cache starts again empty", last_sequence + 1, sequence - 1)
                    self.forget_all()
                try:
                    batch = decoder.decode(frames[2])
                except msgspec.DecodeError:
                    logger.exception("a KV cache event batch could not be decoded; skipped")
                    continue
                self.apply(batch.events)
        finally:
            socket.close(0)
            context.term()

    async def _write_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            self._resolve()  # requests whose wait ran out with no event since
            due = time.monotonic() - self._written_at >= self.refresh_every
            if not (self._reset or self._added or self._removed or due):
                continue
            try:
                await asyncio.wait_for(self._write(), self.refresh_every)
            except (RedisError, OSError, TimeoutError) as error:
                self._reset = True  # what this write carried is lost: the next one states the whole set
                if self._reachable:
                    self._reachable = False
                    logger.warning("cannot publish this worker's prefix cache to %s (%s); retrying",
                                   self.url, error or type(error).__name__)
                continue
            if not self._reachable:
                self._reachable = True
                logger.info("publishing this worker's prefix cache to %s again", self.url)

    async def _write(self) -> None:
        """Writes the changes since the last write (or the whole set), and keeps the set from expiring."""
        reset, added, removed = self._reset, self._added, self._removed
        self._reset, self._added, self._removed = False, set(), set()
        try:
            pipe = self.client.pipeline(transaction=True)
            worker = self.worker_id.encode()
            if reset:
                held = self.chunks.digests()
                pipe.delete(self.key)
                if held:
                    pipe.sadd(self.key, *held)
                pipe.xadd(PREFIX_EVENTS_STREAM, {EVENT_WORKER: worker, EVENT_KIND: RESET,
                                                 EVENT_DIGESTS: pack_digests(held)},
                          maxlen=PREFIX_EVENTS_KEPT, approximate=True)
            else:
                if added:
                    pipe.sadd(self.key, *added)
                    pipe.xadd(PREFIX_EVENTS_STREAM, {EVENT_WORKER: worker, EVENT_KIND: ADDED,
                                                     EVENT_DIGESTS: pack_digests(added)},
                              maxlen=PREFIX_EVENTS_KEPT, approximate=True)
                if removed:
                    pipe.srem(self.key, *removed)
                    pipe.xadd(PREFIX_EVENTS_STREAM, {EVENT_WORKER: worker, EVENT_KIND: REMOVED,
                                                     EVENT_DIGESTS: pack_digests(removed)},
                              maxlen=PREFIX_EVENTS_KEPT, approximate=True)
            pipe.pexpire(self.key, self.ttl_ms)
            replies = await pipe.execute()
        except BaseException:
            self._reset = True
            raise
        self._written_at = time.monotonic()
        if not replies[-1] and len(self.chunks):
            # The set is gone though digests are held (Redis restarted empty, or flushed): state it whole.
            self._reset = True
