"""A synchronous client of the cache service's KVBlockStore, for vLLM's engine-core threads.

Faults never cost a request: every call reports failure as a value, and after a failure the client
stays quiet (no calls, so no waiting on a dead service) for a backoff that doubles up to a cap. The
state changes are logged, one line each: unreachable, then reachable again.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from protos import kv_cache_pb2, kv_cache_pb2_grpc

logger = logging.getLogger("taco_llm.kv_offload")

CHUNK_BYTES = 1024 * 1024  # the service's chunk limit (cache_service/kv_servicer.py)
GRPC_MESSAGE_LIMIT = 4 * CHUNK_BYTES
BACKOFF_FIRST_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 5.0


@dataclass
class BlockPayload:
    key: bytes
    parent_key: bytes
    data: bytes | bytearray
    num_segments: int


class Backoff:
    """Whether to try the service now; thread-safe, logs each transition once."""

    def __init__(self, address: str):
        self.address = address
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._delay = 0.0

    def ready(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._retry_at

    def failed(self, what: str, error: BaseException, logged: bool = False) -> None:
        """Starts or lengthens the pause; logs the first failure of a run unless the caller did."""
        with self._lock:
            first = self._delay == 0.0
            self._delay = BACKOFF_FIRST_SECONDS if first else min(self._delay * 2, BACKOFF_MAX_SECONDS)
            self._retry_at = time.monotonic() + self._delay
        if first and not logged:
            detail = error.code().name if isinstance(error, grpc.RpcError) else type(error).__name__
            logger.warning("prefix-KV offload: cache service %s failed on %s (%s): recomputing instead; "
                           "retrying with backoff", self.address, what, detail)

    def succeeded(self) -> None:
        with self._lock:
            if self._delay == 0.0:
                return
            self._delay, self._retry_at = 0.0, 0.0
        logger.info("prefix-KV offload: cache service %s is reachable again", self.address)


class KVBlockClient:
    def __init__(self, address: str, lookup_timeout: float):
        self.address = address
        self.lookup_timeout = lookup_timeout
        self.backoff = Backoff(address)
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
            ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
            # Reconnect soon after a restarted service comes back (gRPC's default waits up to 120 s).
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
        ])
        self._stub = kv_cache_pb2_grpc.KVBlockStoreStub(self._channel)
        # Connect now, so that the first Lookup's tight deadline is not spent on connecting; a service
        # that is not up yet is fine (the channel keeps trying in the background).
        try:
            grpc.channel_ready_future(self._channel).result(timeout=CONNECT_TIMEOUT_SECONDS)
        except grpc.FutureTimeoutError:
            logger.warning("prefix-KV offload: cache service %s not reachable yet; recomputing until it is",
                           address)

    def close(self) -> None:
        self._channel.close()

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys held; 0 on any failure (then the blocks are simply recomputed)."""
        if not keys or not self.backoff.ready():
            return 0
        try:
            reply = self._stub.Lookup(kv_cache_pb2.LookupRequest(keys=keys), timeout=self.lookup_timeout)
        except grpc.RpcError as error:
            self.backoff.failed("Lookup", error)
            return 0
        self.backoff.succeeded()
        return min(int(reply.num_blocks), len(keys))

    def put(self, blocks: Sequence[BlockPayload], timeout: float) -> kv_cache_pb2.PutBlocksResponse | None:
        if not blocks or not self.backoff.ready():
            return None
        try:
            reply = self._stub.PutBlocks(_put_chunks(blocks), timeout=timeout)
        except grpc.RpcError as error:
            self.backoff.failed("PutBlocks", error)
            return None
        self.backoff.succeeded()
        return reply

    def get_stream(self, keys: Sequence[bytes], timeout: float) -> Iterator[kv_cache_pb2.GetBlocksChunk]:
        """The raw GetBlocks stream (segment-major); the caller reports failures to `backoff`."""
        return iter(self._stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=keys, segment_major=True),
                                         timeout=timeout))


def _put_chunks(blocks: Sequence[BlockPayload]) -> Iterator[kv_cache_pb2.PutBlocksChunk]:
    for block in blocks:
        view = memoryview(block.data)
        header = kv_cache_pb2.BlockHeader(key=block.key, parent_key=block.parent_key, size=len(view),
                                          num_segments=block.num_segments, checksum=zlib.crc32(view))
        yield kv_cache_pb2.PutBlocksChunk(header=header, data=bytes(view[:CHUNK_BYTES]))
        for start in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
            yield kv_cache_pb2.PutBlocksChunk(data=bytes(view[start:start + CHUNK_BYTES]))
