"""The shared Lookahead Cache index: a log of finished sequences per namespace, kept in Redis.

Each namespace (model + tokenizer) is one Redis stream. A stream gives what workers need: an ordered
log that survives restarts of everything (with Redis persistence on), that a worker replays from any
point it last saw, and whose oldest entries Redis trims to a bound by itself. Workers build their
drafting index from the records; this service never interprets tokens.
"""

from __future__ import annotations

import logging
import re
import sys
from array import array
from collections.abc import AsyncIterator
from typing import Any

import grpc
import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from taco_llm.protos import lookahead_pb2, lookahead_pb2_grpc
from taco_llm.protos.kv_cache_limits import LOOKAHEAD_BATCH_BYTES
from taco_llm.protos.rich_status import Reason, abort, invalid_argument

logger = logging.getLogger(__name__)

KEY_PREFIX = "taco_llm:lookahead:"
MAX_RECORDS = 200_000  # per namespace; Redis trims the oldest beyond this (approximately, for speed)
MAX_PUBLISH_TOKENS = 4_000_000
MAX_NAMESPACE_LENGTH = 512
# A record's scope is a digest the worker makes (32 hex characters); the bound keeps a client from storing
# arbitrary text in every record.
MAX_SCOPE_LENGTH = 64
READ_BATCH = 256
LIVE_BLOCK_MS = 5_000
LOG_ID = re.compile(r"\d+(-\d+)?")
# Redis keeps each half of a stream id as an unsigned 64-bit integer and refuses a larger one.
MAX_LOG_ID_PART = 2**64 - 1


def is_log_id(text: str) -> bool:
    """Whether `text` is an id Redis takes for a stream position: MILLISECONDS or MILLISECONDS-SEQUENCE."""
    return LOG_ID.fullmatch(text) is not None and all(int(part) <= MAX_LOG_ID_PART for part in text.split("-"))


def _pack(tokens: Any) -> bytes:
    packed = array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes) -> array[int]:
    tokens = array("I")
    tokens.frombytes(data)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


def _record(entry_id: bytes, fields: dict[bytes, bytes]) -> lookahead_pb2.Record:
    return lookahead_pb2.Record(
        id=entry_id.decode(), prompt=_unpack(fields.get(b"p", b"")), output=_unpack(fields.get(b"o", b"")),
        created_unix=float(fields.get(b"t", b"0")), origin=fields.get(b"g", b"").decode(),
        scope=fields.get(b"s", b"").decode(errors="replace"),
    )


class LookaheadIndexServicer(lookahead_pb2_grpc.LookaheadIndexServicer):
    def __init__(self, redis_url: str | None):
        self.redis_url = redis_url
        self.redis: redis.Redis | None = None
        if redis_url:
            # Blocking reads wait LIVE_BLOCK_MS; the socket timeout must outlast them.
            # A pooled connection that a Redis restart closed fails once; retrying on a fresh one hides
            # that from callers.
            self.redis = redis.from_url(redis_url, socket_connect_timeout=2.0,
                                        socket_timeout=LIVE_BLOCK_MS / 1000 + 5.0,
                                        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
                                        retry_on_error=[RedisConnectionError, RedisTimeoutError])

    async def _client(self, namespace: str, context: grpc.aio.ServicerContext) -> tuple[redis.Redis, str]:
        if not namespace or len(namespace) > MAX_NAMESPACE_LENGTH:
            await invalid_argument(context, f"namespace: must be 1 to {MAX_NAMESPACE_LENGTH} characters", "namespace")
        if self.redis is None:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        "the cache service was started without --redis-url: the lookahead index is not shared",
                        Reason.INDEX_UNAVAILABLE)
        assert self.redis is not None
        return self.redis, KEY_PREFIX + namespace

    async def _unavailable(self, context: grpc.aio.ServicerContext, error: RedisError) -> None:
        logger.warning("lookahead index: Redis at %s: %s", self.redis_url, error)
        await abort(context, grpc.StatusCode.UNAVAILABLE, f"Redis is unavailable: {error}", Reason.INDEX_UNAVAILABLE)

    async def Publish(self, request: lookahead_pb2.PublishRequest,
                      context: grpc.aio.ServicerContext) -> lookahead_pb2.PublishResponse:
        client, key = await self._client(request.namespace, context)
        tokens = sum(len(r.prompt) + len(r.output) for r in request.records)
        if tokens > MAX_PUBLISH_TOKENS:
            await invalid_argument(context, f"records: {tokens} tokens in one call; at most {MAX_PUBLISH_TOKENS}",
                                   "records")
        for position, record in enumerate(request.records):
            if len(record.scope) > MAX_SCOPE_LENGTH:
                await invalid_argument(context, f"records[{position}].scope: at most {MAX_SCOPE_LENGTH} characters",
                                       f"records[{position}].scope")
        last_id = ""
        try:
            async with client.pipeline(transaction=False) as pipe:
                for record in request.records:
                    if not record.output and not record.prompt:
                        continue
                    fields = {"p": _pack(record.prompt), "o": _pack(record.output), "t": repr(record.created_unix),
                              "g": record.origin}
                    if record.scope:
                        fields["s"] = record.scope
                    pipe.xadd(key, fields,  # type: ignore[arg-type]
                              maxlen=MAX_RECORDS, approximate=True)
                ids = await pipe.execute()
            if ids:
                last_id = ids[-1].decode()
        except RedisError as error:
            await self._unavailable(context, error)
        return lookahead_pb2.PublishResponse(last_id=last_id)

    async def Subscribe(self, request: lookahead_pb2.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[lookahead_pb2.SubscribeResponse]:
        client, key = await self._client(request.namespace, context)
        after = request.after_id or "0-0"
        if not is_log_id(after):
            await invalid_argument(context, f"after_id: {after!r} is not a log id (MILLISECONDS-SEQUENCE, "
                                            "each below 2**64)",
                                   "after_id")
        caught_up = False
        while True:
            try:
                reply: Any = await client.xread({key: after}, count=READ_BATCH,
                                           block=LIVE_BLOCK_MS if caught_up else None)
            except RedisError as error:
                await self._unavailable(context, error)
                return
            records = [_record(entry_id, fields) for _, entries in reply for entry_id, fields in entries]
            if records:
                after = records[-1].id
            parts = _within_message_limit(records)
            if not caught_up and len(records) < READ_BATCH:
                caught_up = True
                for part in parts[:-1]:
                    yield lookahead_pb2.SubscribeResponse(records=part)
                yield lookahead_pb2.SubscribeResponse(records=parts[-1], caught_up=True)
            elif records:
                for part in parts:
                    yield lookahead_pb2.SubscribeResponse(records=part)

    async def GetStats(self, request: lookahead_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> lookahead_pb2.IndexStats:
        client, key = await self._client(request.namespace, context)
        try:
            records = await client.xlen(key)
            tokens = 0
            async for _, fields in _entries(client, key):
                tokens += (len(fields.get(b"p", b"")) + len(fields.get(b"o", b""))) // 4
        except RedisError as error:
            logger.warning("lookahead index: Redis at %s: %s", self.redis_url, error)
            return lookahead_pb2.IndexStats(max_records=MAX_RECORDS, redis_connected=False)
        return lookahead_pb2.IndexStats(records=records, tokens=tokens, max_records=MAX_RECORDS,
                                        redis_connected=True)

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


def _within_message_limit(records: list[lookahead_pb2.Record]) -> list[list[lookahead_pb2.Record]]:
    """The records in order, cut into responses that stay well inside the server's message limit (a
    batch of long sequences would otherwise fail to send, and the subscriber would ask for it again
    for ever). Never empty: one empty part when there are no records."""
    parts: list[list[lookahead_pb2.Record]] = [[]]
    size = 0
    for record in records:
        record_bytes = record.ByteSize()  # not cached: each call encodes the record
        if parts[-1] and size + record_bytes > LOOKAHEAD_BATCH_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(record)
        size += record_bytes
    return parts


async def _entries(client: redis.Redis, key: str) -> AsyncIterator[tuple[bytes, dict[bytes, bytes]]]:
    after = "-"
    while True:
        batch: Any = await client.xrange(key, min=after, max="+", count=1000)
        if not batch:
            return
        for entry_id, fields in batch:
            yield entry_id, fields
        after = "(" + batch[-1][0].decode()
