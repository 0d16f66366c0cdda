"""The incarnation of the cache service this worker offloads prefix KV to, for GetLoad.

The cache service draws a random id when it starts (StatsResponse.incarnation); a new one means it
restarted and holds none of the blocks it held before. Gateways read it in Load.prefix_cache_incarnation
and forget, on a change, which prefixes they believed that service held. The worker's front process reads
it on its own event loop every READ_INTERVAL_SECONDS: nothing on the engine's path waits on this call.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from taco_llm.grpc_security import CacheServiceClient, aio_channel, bearer_metadata
from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc

logger = logging.getLogger(__name__)

# A restart is noticed this long after the service answers again, at the latest (plus the gateway's own
# GetLoad interval). Each read is one Stats call: cheap, but not free with --apc-offload-enable-hit-cnt,
# where Stats ranks the service's blocks by hits.
READ_INTERVAL_SECONDS = 5.0
READ_DEADLINE_SECONDS = 2.0
CHANNEL_OPTIONS = (
    # Reconnect soon after a restarted service comes back (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class CacheServiceIncarnation:
    """Reads the cache service's incarnation in the background; `latest` is the last one it answered
    with ("" until it has answered). While the service does not answer, `latest` keeps the last value:
    an unreachable service is not known to have restarted."""

    def __init__(self, address: str, client: CacheServiceClient | None = None, *,
                 interval: float = READ_INTERVAL_SECONDS):
        self.address = address
        self.client = client or CacheServiceClient()
        self.interval = interval
        self.latest = ""
        self._answering = True

    async def run(self) -> None:
        """Reads until cancelled."""
        channel = aio_channel(self.address, self.client.tls, CHANNEL_OPTIONS)
        stub = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        try:
            while True:
                await self.read(stub)
                await asyncio.sleep(self.interval)
        finally:
            await channel.close()

    async def read(self, stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
        try:
            reply = await stub.Stats(kv_cache_pb2.StatsRequest(), timeout=READ_DEADLINE_SECONDS,
                                     metadata=bearer_metadata(self.client.api_key))
        except grpc.aio.AioRpcError as error:
            if self._answering:
                logger.info("the cache service at %s does not answer Stats (%s); keeping its incarnation %r",
                            self.address, error.code().name, self.latest)
            self._answering = False
            return
        self._answering = True
        if reply.incarnation != self.latest:
            logger.info("the cache service at %s is incarnation %r (was %r)", self.address, reply.incarnation,
                        self.latest)
            self.latest = reply.incarnation
