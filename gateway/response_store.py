"""Where stored responses (/v1/responses with `store`) live: in Redis, where every gateway replica reads
them alike, or, with no Redis given, in this process's memory.

Both stores keep the same three bounds, since vLLM's never-evicted dict is what this replaces:
- each response expires `ttl` seconds after it was last written (--responses-ttl);
- all of them together take at most `max_bytes` (--responses-max-bytes): a write that would pass it
  evicts the responses nearest to expiring first; one response larger than the cap is not stored;
- each lives under its tenant's scope, and a lookup from another scope finds nothing. A response id
  is never enough to read another tenant's response, however it was learned.

A record is the response object as the client sees it, and the chat messages its conversation
amounts to (what `previous_response_id` continues from), kept apart from its status so that a status
can be changed only from the ones expected (a cancel never turned back into `completed`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .errors import service_unavailable

logger = logging.getLogger(__name__)

KEY_PREFIX = "taco_llm:responses:"
# Every record's key, scored by when it expires: what eviction reads, oldest first.
_INDEX_KEY = f"{KEY_PREFIX}index"
_SIZES_KEY = f"{KEY_PREFIX}sizes"
_TOTAL_KEY = f"{KEY_PREFIX}bytes"
# The last score given: scores only grow, so that two writes in one microsecond keep their order.
_LAST_SCORE_KEY = f"{KEY_PREFIX}last-score"
REDIS_TIMEOUT_SECONDS = 2.0


@dataclass
class StoredResponse:
    response: dict[str, Any]
    # The conversation so far as chat messages, this response's input and output included, without the
    # instructions (which `previous_response_id` does not carry over, as in OpenAI's API).
    messages: list[dict[str, Any]]

    @property
    def status(self) -> str:
        return str(self.response.get("status", ""))

    def body(self) -> str:
        return json.dumps({"response": self.response, "messages": self.messages}, separators=(",", ":"))

    @classmethod
    def parse(cls, body: str | bytes) -> StoredResponse:
        value = json.loads(body)
        return cls(value["response"], value["messages"])


class ResponseStore(Protocol):
    # What all records together may take (--responses-max-bytes); a larger one is never written.
    max_bytes: int

    async def put(self, scope: str, record: StoredResponse, *, only_from: frozenset[str] | None = None) -> bool:
        """Writes `record` under its id; with `only_from`, only over a stored record in one of those
        statuses. False where it was not written (the status had moved on, or the record is over the cap)."""
        ...

    async def get(self, scope: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, scope: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


def record_key(scope: str, response_id: str) -> str:
    """Tenant names are [A-Za-z0-9_.-]+ (tenants.py) and response ids are the gateway's own, so neither
    holds the separator; the length prefix keeps ("a:b", "c") and ("a", "b:c") apart regardless."""
    return f"{KEY_PREFIX}{len(scope)}:{scope}:{response_id}"


class MemoryResponseStore:
    """The store of a gateway with no Redis: one process's memory. Invariant: `_records` is in order of
    expiry (every write moves its record to the end, and all records share one ttl), so the first one is
    always the next to expire and the first to evict; `_bytes` is the sum of the stored bodies' sizes."""

    def __init__(self, *, ttl: float, max_bytes: int, clock: Any = time.monotonic) -> None:
        self.ttl = ttl
        self.max_bytes = max_bytes
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, str, str]] = OrderedDict()  # key -> (expiry, status, body)
        self._bytes = 0

    async def put(self, scope: str, record: StoredResponse, *, only_from: frozenset[str] | None = None) -> bool:
        self._expire()
        key = record_key(scope, record.response["id"])
        if only_from is not None and (key not in self._records or self._records[key][1] not in only_from):
            return False
        body = record.body()
        if len(body) > self.max_bytes:
            return False
        self._drop(key)
        while self._records and self._bytes + len(body) > self.max_bytes:
            self._drop(next(iter(self._records)))
        self._records[key] = (self._clock() + self.ttl, record.status, body)
        self._bytes += len(body)
        return True

    async def get(self, scope: str, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._records.get(record_key(scope, response_id))
        return None if entry is None else StoredResponse.parse(entry[2])

    async def delete(self, scope: str, response_id: str) -> bool:
        self._expire()
        return self._drop(record_key(scope, response_id))

    async def close(self) -> None:
        self._records.clear()
        self._bytes = 0

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def _expire(self) -> None:
        now = self._clock()
        while self._records:
            key, (expiry, _, _) = next(iter(self._records.items()))
            if expiry > now:
                return
            self._drop(key)

    def _drop(self, key: str) -> bool:
        entry = self._records.pop(key, None)
        if entry is None:
            return False
        self._bytes -= len(entry[2])
        return True


# One write, as one script so that two gateways writing at once keep the count of bytes true:
# expired records leave the index first, then the record's old version, then the records nearest to
# expiring until the new one fits. A record's score is when it expires, in microseconds, made strictly
# greater than the last score given (writes in one microsecond, or from a gateway whose clock is a little
# behind, still evict in the order they were written). KEYS: the record, the index, the sizes, the
# total, the last score. ARGV: the body, its status, the ttl (us), now (us), the cap, and the statuses
# it may replace ("" for any).
_PUT_SCRIPT = """
local function drop(member)
  local size = tonumber(redis.call('HGET', KEYS[3], member) or '0')
  redis.call('HDEL', KEYS[3], member)
  redis.call('ZREM', KEYS[2], member)
  redis.call('DEL', member)
  redis.call('DECRBY', KEYS[4], size)
end
if ARGV[6] ~= '' then
  local status = redis.call('HGET', KEYS[1], 'status')
  if not status or not string.find(ARGV[6], ',' .. status .. ',', 1, true) then return 0 end
end
local size = string.len(ARGV[1])
local cap = tonumber(ARGV[5])
if size > cap then return -1 end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])) do drop(member) end
drop(KEYS[1])
while tonumber(redis.call('GET', KEYS[4]) or '0') + size > cap do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
end
local score = math.max(tonumber(ARGV[4]) + tonumber(ARGV[3]), tonumber(redis.call('GET', KEYS[5]) or '0') + 1)
redis.call('SET', KEYS[5], string.format('%.0f', score))
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'body', ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) / 1000))
redis.call('ZADD', KEYS[2], string.format('%.0f', score), KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('INCRBY', KEYS[4], size)
return 1
"""
_DELETE_SCRIPT = """
local size = tonumber(redis.call('HGET', KEYS[3], KEYS[1]) or '0')
redis.call('HDEL', KEYS[3], KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('DECRBY', KEYS[4], size)
return redis.call('DEL', KEYS[1])
"""


class RedisResponseStore:
    """The store every gateway replica shares (--responses-store-url, else --registry-url's Redis). The
    records' keys are plain keys of one Redis (not a cluster), as the registry's are. A Redis that does
    not answer is a 503 the client may retry: a stored response is never silently not stored."""

    def __init__(self, url: str, *, ttl: float, max_bytes: int) -> None:
        self.ttl = ttl
        self.max_bytes = max_bytes
        self._redis: aioredis.Redis = aioredis.from_url(url, socket_timeout=REDIS_TIMEOUT_SECONDS,
                                                        socket_connect_timeout=REDIS_TIMEOUT_SECONDS)
        self._put = self._redis.register_script(_PUT_SCRIPT)
        self._delete = self._redis.register_script(_DELETE_SCRIPT)

    async def put(self, scope: str, record: StoredResponse, *, only_from: frozenset[str] | None = None) -> bool:
        statuses = "," + ",".join(sorted(only_from)) + "," if only_from else ""
        now_us = int(time.time() * 1_000_000)
        try:
            written = await self._put(
                keys=[record_key(scope, record.response["id"]), _INDEX_KEY, _SIZES_KEY, _TOTAL_KEY, _LAST_SCORE_KEY],
                args=[record.body(), record.status, int(self.ttl * 1_000_000), now_us, self.max_bytes, statuses])
        except (RedisError, OSError) as error:
            raise _unavailable(error) from None
        return int(written) == 1

    async def get(self, scope: str, response_id: str) -> StoredResponse | None:
        try:
            body = await self._redis.hget(record_key(scope, response_id), "body")
        except (RedisError, OSError) as error:
            raise _unavailable(error) from None
        return None if body is None else StoredResponse.parse(body)

    async def delete(self, scope: str, response_id: str) -> bool:
        try:
            deleted = await self._delete(keys=[record_key(scope, response_id), _INDEX_KEY, _SIZES_KEY, _TOTAL_KEY])
        except (RedisError, OSError) as error:
            raise _unavailable(error) from None
        return int(deleted) == 1

    async def close(self) -> None:
        await self._redis.aclose()


def _unavailable(error: Exception) -> Exception:
    logger.warning("the responses store did not answer: %s", error)
    return service_unavailable("the store of responses (Redis) did not answer; retry", code="store_unavailable")
