"""A synchronous client of the cache service's KVBlockStore, for vLLM's engine-core threads.

Faults never cost a request: every call reports failure as a value, and after a failure the client
stays quiet (no calls, so no waiting on a dead service) for a backoff that doubles up to a cap. The
state changes are logged, one line each: unreachable, then reachable again.

Block bytes go through shared-memory windows (window.py) when the service can attach them (the
same host or IPC namespace; transport "auto"), else in the gRPC messages. The first sign that the
service cannot reach our windows switches this client to gRPC bytes for good, with one log line. A
window the service no longer knows (it restarted) is replaced by a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from taco_llm.grpc_security import CacheServiceClient
from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc
from taco_llm.protos.engine_limits import KEEPALIVE_CLIENT_OPTIONS
from taco_llm.protos.kv_cache_limits import CHUNK_BYTES, GRPC_MESSAGE_LIMIT, MAX_WINDOW_BYTES, SHM_DIR
from taco_llm.protos.rich_status import Reason, has_reason

from ...handoff import OFFLOAD_TRANSPORTS
from .window import ShmWindow

logger = logging.getLogger("taco_llm.kv_offload")

BACKOFF_FIRST_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 5.0
WINDOW_CALL_TIMEOUT_SECONDS = 5.0
# The load window grows to the next power of two a load needs, from the first size up to the cap;
# a larger load goes as gRPC bytes. Windows are transport buffers: this memory is the worker's. The
# cap stays within the largest window the service attaches.
LOAD_WINDOW_FIRST_BYTES = 64 * 1024**2
LOAD_WINDOW_MAX_BYTES = min(2 * 1024**3, MAX_WINDOW_BYTES)


@dataclass
class BlockPayload:
    key: bytes
    parent_key: bytes
    data: bytes | bytearray | memoryview
    num_segments: int
    window_offset: int | None = None  # where `data` lies in the put's window, if it has one


class ChunkStream(Protocol):
    """A GetBlocks call as gRPC returns it: an iterator of chunks that can be cancelled."""

    def __iter__(self) -> Iterator[kv_cache_pb2.GetBlocksChunk]: ...

    def __next__(self) -> kv_cache_pb2.GetBlocksChunk: ...

    def cancel(self) -> bool: ...


def window_gone(error: grpc.RpcError) -> bool:
    """The service does not know the window a call named (it restarted, or dropped the window): by the
    status's typed reason (protos/errors.proto), never its message."""
    return (error.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            and has_reason(error, Reason.WINDOW_NOT_FOUND))


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
    def __init__(self, address: str, lookup_timeout: float, transport: str = "auto", *, shm_dir: str = SHM_DIR):
        if transport not in OFFLOAD_TRANSPORTS:
            raise ValueError(f"transport: one of {OFFLOAD_TRANSPORTS}, got {transport!r}")
        self.address = address
        self.lookup_timeout = lookup_timeout
        self.backoff = Backoff(address)
        self._shm = transport == "auto"
        self._load_window: ShmWindow | None = None
        self._load_window_lock = threading.Lock()  # held by the one load writing through it
        self._attached_once = False
        self.shm_dir = shm_dir  # the service must see this folder as its --shm-dir
        # TLS and the key as the worker's --cache-service-tls-* and --cache-service-api-key say.
        self._channel = CacheServiceClient.from_environment().channel(address, options=[
            ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
            ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
            # Reconnect soon after a restarted service comes back (gRPC's default waits up to 120 s).
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            # A service cut off or gone without a word (its host or container gone: nothing refuses or resets
            # the connection) is found by unanswered pings within 5 s; the channel then drops that connection
            # and dials again, so calls reach the service once it is back, at the same address or a new one
            # behind the same name. Without them the dead connection is kept until TCP gives up (many minutes),
            # every call in the meantime running out its deadline. The gateway's pings, same numbers.
            *KEEPALIVE_CLIENT_OPTIONS,
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
        with self._load_window_lock:
            window, self._load_window = self._load_window, None
        if window is not None:
            self.detach(window)
        self._channel.close()

    @property
    def shared_memory(self) -> bool:
        """Whether block bytes may go through windows (transport auto, and none has failed yet)."""
        return self._shm

    def _no_shared_memory(self, why: str) -> None:
        if self._shm:
            self._shm = False
            logger.warning("prefix-KV offload: shared memory with cache service %s is not usable (%s); "
                           "sending block bytes over gRPC from now on", self.address, why)

    def attach(self, size: int) -> ShmWindow | None:
        """A new window of `size` bytes that the service has attached, or None (then use gRPC bytes)."""
        if not self._shm or not self.backoff.ready():
            return None
        try:
            window = ShmWindow(size, self.shm_dir)
        except OSError as error:
            # No /dev/shm, or too small a one (docker's default is 64 MB): retrying would only log again.
            self._no_shared_memory(f"cannot make a {size}-byte window in {self.shm_dir}: {error.strerror}")
            return None
        try:
            reply = self._stub.AttachWindow(kv_cache_pb2.AttachWindowRequest(
                name=window.name, size=size, nonce=window.nonce), timeout=WINDOW_CALL_TIMEOUT_SECONDS)
        except grpc.RpcError as error:
            window.close()
            if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                self._no_shared_memory(f"{error.code().name}: {error.details()}")
            else:
                self.backoff.failed("AttachWindow", error)
            return None
        finally:
            window.unlink()  # attached or not, nothing stays in /dev/shm: the mappings hold the memory
        window.window_id = reply.window_id
        if not self._attached_once:
            self._attached_once = True
            logger.info("prefix-KV offload: block bytes go through shared memory with cache service %s",
                        self.address)
        return window

    def detach(self, window: ShmWindow) -> None:
        """Best effort: tells the service to forget the window, and unmaps it here."""
        if window.window_id and not window.stale and self.backoff.ready():
            with contextlib.suppress(grpc.RpcError):
                self._stub.DetachWindow(kv_cache_pb2.DetachWindowRequest(window_id=window.window_id), timeout=1.0)
        window.close()

    @contextlib.contextmanager
    def load_window(self, size: int) -> Iterator[ShmWindow | None]:
        """The window for one load of `size` bytes, held for the load; None: use gRPC bytes.

        Loads run one at a time; one whose thread outlived its deadline may still hold the window,
        and then this load goes as bytes rather than share it."""
        if not self._shm or size > LOAD_WINDOW_MAX_BYTES or not self._load_window_lock.acquire(blocking=False):
            yield None
            return
        try:
            window = self._load_window
            if window is not None and (window.stale or window.size < size):
                self._load_window = None
                self.detach(window)
                window = None
            if window is None:
                wanted = max(LOAD_WINDOW_FIRST_BYTES, 1 << (size - 1).bit_length())
                window = self._load_window = self.attach(min(wanted, LOAD_WINDOW_MAX_BYTES))
            yield window
        finally:
            self._load_window_lock.release()

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

    def put(self, blocks: Sequence[BlockPayload], timeout: float,
            window: ShmWindow | None = None) -> kv_cache_pb2.PutBlocksResponse | None:
        """Stores blocks: by reference to `window` when given (every payload's bytes lie in it), else
        as bytes. A window the service no longer knows is marked stale and the bytes are resent."""
        if not blocks or not self.backoff.ready():
            return None
        try:
            if window is not None and not window.stale:
                try:
                    reply = self._stub.PutBlocks(_put_chunks(blocks, window), timeout=timeout)
                except grpc.RpcError as error:
                    if not window_gone(error):
                        raise
                    window.stale = True
                    reply = self._stub.PutBlocks(_put_chunks(blocks, None), timeout=timeout)
            else:
                reply = self._stub.PutBlocks(_put_chunks(blocks, None), timeout=timeout)
        except grpc.RpcError as error:
            self.backoff.failed("PutBlocks", error)
            return None
        self.backoff.succeeded()
        return reply

    def get_stream(self, keys: Sequence[bytes], timeout: float,
                   window: kv_cache_pb2.WindowRef | None = None) -> ChunkStream:
        """The raw GetBlocks call (an iterator of chunks, segment-major, or of progress messages with a
        window); the caller reports failures to `backoff`, and may cancel() it."""
        request = kv_cache_pb2.GetBlocksRequest(keys=keys, segment_major=True, window=window)
        call: ChunkStream = self._stub.GetBlocks(request, timeout=timeout)
        return call


def _put_chunks(blocks: Sequence[BlockPayload], window: ShmWindow | None) -> Iterator[kv_cache_pb2.PutBlocksChunk]:
    """The PutBlocks stream: each block as one `windowed` chunk naming its range of `window`, or as a
    `start` with its first bytes and `more` chunks with the rest."""
    for block in blocks:
        view = memoryview(block.data)
        header = kv_cache_pb2.BlockHeader(key=block.key, parent_key=block.parent_key, size=len(view),
                                          num_segments=block.num_segments, checksum=zlib.crc32(view))
        if window is not None and block.window_offset is not None:
            ref = kv_cache_pb2.WindowRef(window_id=window.window_id, offset=block.window_offset, length=len(view))
            yield kv_cache_pb2.PutBlocksChunk(windowed=kv_cache_pb2.WindowedBlock(header=header, window=ref))
            continue
        yield kv_cache_pb2.PutBlocksChunk(start=kv_cache_pb2.BlockStart(header=header,
                                                                        data=bytes(view[:CHUNK_BYTES])))
        for start in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
            yield kv_cache_pb2.PutBlocksChunk(more=bytes(view[start:start + CHUNK_BYTES]))
