"""The KVBlockStore gRPC service (protos/kv_cache.proto) over the in-memory BlockStore.

Every refusal is a precise status carrying the rich details of protos/errors.proto (an ErrorInfo
reason and a BadRequest naming the field; the message names it too), and ends only that call:
INVALID_ARGUMENT (FIELD_INVALID: malformed keys, sizes, chunks or window ranges), RESOURCE_EXHAUSTED
(BLOCK_TOO_LARGE: a block larger than the whole budget), DATA_LOSS (CHECKSUM_MISMATCH), NOT_FOUND
(BLOCK_NOT_FOUND: a key not held), FAILED_PRECONDITION (WINDOW_NOT_FOUND: a window that is not
attached; WINDOW_UNREACHABLE: one not reachable from here; WINDOW_IO_FAILED).

Block bytes travel in the messages or through shared-memory windows (windows.py); either way the
store holds its own copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import NoReturn, TypeVar

import grpc

from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc
from taco_llm.protos.kv_cache_limits import CHUNK_BYTES
from taco_llm.protos.rich_status import Reason, abort, invalid_argument

from .block_store import KEY_BYTES, Block, BlockStore, PutOutcome
from .config import CacheServiceConfig
from .windows import Window, WindowError, WindowTable

logger = logging.getLogger(__name__)

MAX_KEYS_PER_CALL = 65536
TOP_HITS_REPORTED = 16

T = TypeVar("T")


async def _settled(future: asyncio.Future[T]) -> T:
    """The result of work running on a thread. A cancelled call still waits for that work to end:
    the window it reads or writes must stay pinned (its fd open) until then."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        raise


async def _window_error(context: grpc.aio.ServicerContext, error: WindowError, prefix: str = "") -> NoReturn:
    await abort(context, error.code, prefix + error.message, error.reason, error.field)


async def _check_keys(keys: Sequence[bytes], context: grpc.aio.ServicerContext) -> None:
    if len(keys) > MAX_KEYS_PER_CALL:
        await invalid_argument(context, f"keys: at most {MAX_KEYS_PER_CALL} per call, got {len(keys)}", "keys")
    for index, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            await invalid_argument(context, f"keys[{index}]: a key is {KEY_BYTES} bytes (SHA-256), got {len(key)}",
                                   f"keys[{index}]")


class KVBlockStoreServicer(kv_cache_pb2_grpc.KVBlockStoreServicer):
    def __init__(self, config: CacheServiceConfig, *, incarnation: str | None = None):
        # This run of the service (StatsResponse.incarnation): a fresh random id unless given one.
        self.incarnation = incarnation or uuid.uuid4().hex
        self.store = BlockStore(config.kv_budget_bytes, config.min_access_threshold, config.count_hits)
        self.windows = WindowTable(shm_dir=config.shm_dir)

    async def AttachWindow(self, request: kv_cache_pb2.AttachWindowRequest,
                           context: grpc.aio.ServicerContext) -> kv_cache_pb2.AttachWindowResponse:
        try:
            window_id = self.windows.attach(request.name, request.size, request.nonce)
        except WindowError as error:
            await _window_error(context, error)
        logger.info("attached shared-memory window %s (%d bytes) as %d", request.name, request.size, window_id)
        return kv_cache_pb2.AttachWindowResponse(window_id=window_id)

    async def close(self) -> None:
        """Drops every attached window (their file descriptors), once the server takes no more calls."""
        self.windows.close()

    async def DetachWindow(self, request: kv_cache_pb2.DetachWindowRequest,
                           context: grpc.aio.ServicerContext) -> kv_cache_pb2.DetachWindowResponse:
        return kv_cache_pb2.DetachWindowResponse(detached=self.windows.detach(request.window_id))

    async def _window(self, ref: kv_cache_pb2.WindowRef, context: grpc.aio.ServicerContext,
                      parent: str | None = None, prefix: str = "") -> Window:
        """The window `ref` names, pinned for the call; `parent`: the path of the message holding the
        ref, when that is not the request itself (so that the error names the field by its full path)."""
        try:
            return self.windows.acquire(ref.window_id, ref.offset, ref.length)
        except WindowError as error:
            await _window_error(context, error.under(parent) if parent else error, prefix)

    async def _read_window(self, block: kv_cache_pb2.WindowedBlock, index: int,
                           context: grpc.aio.ServicerContext) -> tuple[bytes, int]:
        """A put block's bytes, copied out of the client's window, and their checksum."""
        if block.window.length != block.header.size:
            await invalid_argument(context, f"block {index}: windowed.window.length {block.window.length} is not "
                                   f"windowed.header.size {block.header.size}", "windowed.window.length")
        window = await self._window(block.window, context, "windowed", f"block {index}: ")
        loop = asyncio.get_running_loop()
        try:
            return await _settled(loop.run_in_executor(None, _read_and_check, window, block.window.offset,
                                                       block.window.length))
        except WindowError as error:
            await _window_error(context, error.under("windowed"), f"block {index}: ")
        finally:
            self.windows.release(window)

    async def Lookup(self, request: kv_cache_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kv_cache_pb2.LookupResponse:
        await _check_keys(request.keys, context)
        return kv_cache_pb2.LookupResponse(num_blocks=self.store.lookup(list(request.keys)))

    async def _check_header(self, header: kv_cache_pb2.BlockHeader, path: str, index: int,
                            context: grpc.aio.ServicerContext) -> None:
        """Refuses a malformed header; `path`: where it lies in the chunk (start.header, windowed.header)."""
        where = f"block {index}"
        if len(header.key) != KEY_BYTES:
            await invalid_argument(
                context, f"{where}: {path}.key is {KEY_BYTES} bytes (SHA-256), got {len(header.key)}",
                f"{path}.key")
        if header.parent_key and len(header.parent_key) != KEY_BYTES:
            await invalid_argument(context, f"{where}: {path}.parent_key is empty or {KEY_BYTES} bytes, got "
                                   f"{len(header.parent_key)}", f"{path}.parent_key")
        if header.size == 0:
            await invalid_argument(context, f"{where}: {path}.size must be positive", f"{path}.size")
        if header.num_segments == 0 or header.size % header.num_segments:
            await invalid_argument(
                context, f"{where}: {path}.size {header.size} is not a multiple of {path}.num_segments "
                f"{header.num_segments} (the block's bytes are that many equal segments)",
                f"{path}.num_segments")
        if header.size > self.store.budget_bytes:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{where}: {path}.size {header.size} is over the store's whole budget of "
                        f"{self.store.budget_bytes} bytes", Reason.BLOCK_TOO_LARGE, f"{path}.size")

    async def PutBlocks(self, request_iterator: AsyncIterator[kv_cache_pb2.PutBlocksChunk],
                        context: grpc.aio.ServicerContext) -> kv_cache_pb2.PutBlocksResponse:
        reply = kv_cache_pb2.PutBlocksResponse()
        # The block whose bytes are arriving over gRPC (begun by a `start`, not yet complete), if any.
        header: kv_cache_pb2.BlockHeader | None = None
        data = bytearray()
        index = -1
        async for chunk in request_iterator:
            kind = chunk.WhichOneof("kind")
            if kind in ("start", "windowed") and header is not None:
                await invalid_argument(
                    context, f"block {index}: {kind}: the next block began after {len(data)} of this "
                    f"one's {header.size} bytes", kind)
            if kind == "windowed":
                index += 1
                block = chunk.windowed
                await self._check_header(block.header, "windowed.header", index, context)
                copied, checksum = await self._read_window(block, index, context)
                outcome = await self._store(block.header, "windowed.header", copied, checksum, index, reply, context)
                if outcome is PutOutcome.STORED:
                    self.windows.counters.bytes_stored_shm += len(copied)
                continue
            if kind == "start":
                index += 1
                await self._check_header(chunk.start.header, "start.header", index, context)
                header, data = chunk.start.header, bytearray()
                piece, field = chunk.start.data, "start.data"
            elif kind == "more":
                if header is None:
                    await invalid_argument(
                        context, f"block {index + 1}: more: bytes came before any block header (each "
                        "block begins with a start; a windowed one takes no more bytes)", "more")
                piece, field = chunk.more, "more"
            else:
                await invalid_argument(context, f"block {index + 1}: kind: a chunk is a start, more or windowed, got "
                                       f"{kind or 'none of them'}", "kind")
            if len(piece) > CHUNK_BYTES:
                await invalid_argument(
                    context, f"block {index}: {field}: a chunk carries at most {CHUNK_BYTES} bytes, got "
                    f"{len(piece)}", field)
            data += piece
            if len(data) > header.size:
                await invalid_argument(context, f"block {index}: {field}: got more bytes than start.header.size "
                                       f"{header.size}", field)
            if len(data) == header.size:
                whole = bytes(data)
                checksum = await asyncio.get_running_loop().run_in_executor(None, zlib.crc32, whole)
                await self._store(header, "start.header", whole, checksum, index, reply, context)
                header, data = None, bytearray()
        if header is not None:
            await invalid_argument(
                context, f"block {index}: more: the stream ended after {len(data)} of its {header.size} "
                "bytes", "more")
        return reply

    async def _store(self, header: kv_cache_pb2.BlockHeader, path: str, data: bytes, checksum: int, index: int,
                     reply: kv_cache_pb2.PutBlocksResponse, context: grpc.aio.ServicerContext) -> PutOutcome:
        """Checks a complete block's checksum (computed off the event loop), stores it and counts the
        outcome in the reply; `path`: where the header lies in the chunk."""
        if checksum != header.checksum:
            await abort(context, grpc.StatusCode.DATA_LOSS,
                        f"block {index}: checksum mismatch ({path}.checksum {header.checksum}, bytes {checksum})",
                        Reason.CHECKSUM_MISMATCH, f"{path}.checksum")
        outcome = self.store.put(header.key, header.parent_key, data, header.num_segments, header.checksum)
        if outcome is PutOutcome.STORED:
            reply.num_stored += 1
        elif outcome is PutOutcome.ALREADY_HELD:
            reply.num_already_held += 1
        elif outcome is PutOutcome.BELOW_THRESHOLD:
            reply.num_below_threshold += 1
        else:
            reply.num_no_room += 1
        return outcome

    async def GetBlocks(self, request: kv_cache_pb2.GetBlocksRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[kv_cache_pb2.GetBlocksChunk]:
        await _check_keys(request.keys, context)
        if not request.keys:
            # Nothing to read is a client's mistake, and BlockStore.acquire takes checked keys only.
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "keys: name at least one block to read",
                        Reason.FIELD_REQUIRED, "keys")
        if request.HasField("window"):
            async for message in self._get_into_window(request, context):
                yield message
            return
        blocks = await self._acquire(request, context)
        served = False
        try:
            if request.segment_major and len({b.num_segments for b in blocks}) > 1:
                await invalid_argument(context, "segment_major: the blocks have different numbers of segments",
                                       "segment_major")
            yield _headers(blocks)
            for index, start, end in _chunk_plan(blocks, request.segment_major):
                yield kv_cache_pb2.GetBlocksChunk(block_bytes=kv_cache_pb2.BlockBytes(
                    block_index=index, offset=start, data=blocks[index].data[start:end]))
            served = True
        finally:
            self.store.release(blocks, served)

    async def _acquire(self, request: kv_cache_pb2.GetBlocksRequest,
                       context: grpc.aio.ServicerContext) -> list[Block]:
        try:
            return self.store.acquire(list(request.keys))
        except KeyError as missing:
            index = missing.args[0]
            await abort(context, grpc.StatusCode.NOT_FOUND,
                        f"keys[{index}]: block {request.keys[index].hex()[:16]}... is not held "
                        "(evicted, or never stored)", Reason.BLOCK_NOT_FOUND, f"keys[{index}]")

    async def _get_into_window(self, request: kv_cache_pb2.GetBlocksRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[kv_cache_pb2.GetBlocksChunk]:
        """Writes the blocks into the client's window segment-major, one message per finished segment."""
        window = await self._window(request.window, context)
        try:
            blocks = await self._acquire(request, context)
            served = False
            try:
                if len({b.num_segments for b in blocks}) > 1:
                    await invalid_argument(
                        context, "keys: the blocks have different numbers of segments (a window holds "
                        "them segment-major)", "keys")
                total = sum(len(b.data) for b in blocks)
                if total > request.window.length:
                    await invalid_argument(context, f"window.length {request.window.length} cannot hold the "
                                           f"{len(blocks)} blocks' {total} bytes", "window.length")
                yield _headers(blocks)
                # aclosing: however this call ends, the copy has stopped before the window is released.
                async with contextlib.aclosing(_write_segment_major(window, blocks, request.window.offset)) as done:
                    async for segments in done:
                        yield kv_cache_pb2.GetBlocksChunk(segments_in_window=segments)
                served = True
                self.windows.counters.bytes_served_shm += total
            except WindowError as error:
                await _window_error(context, error)
            finally:
                self.store.release(blocks, served)
        finally:
            self.windows.release(window)

    async def Stats(self, request: kv_cache_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kv_cache_pb2.StatsResponse:
        store, counters = self.store, self.store.counters
        reply = kv_cache_pb2.StatsResponse(
            bytes_used=store.bytes_used, bytes_budget=store.budget_bytes, num_blocks=len(store),
            lookups=counters.lookups, lookup_hit_blocks=counters.lookup_hit_blocks,
            lookup_miss_blocks=counters.lookup_miss_blocks, blocks_served=counters.blocks_served,
            blocks_stored=counters.blocks_stored, blocks_below_threshold=counters.blocks_below_threshold,
            blocks_evicted=counters.blocks_evicted, bytes_stored=counters.bytes_stored,
            bytes_served=counters.bytes_served, min_access_threshold=store.min_access_threshold,
            hit_counts_enabled=store.count_hits, reads_in_progress=counters.reads_in_progress,
            bytes_stored_shm=self.windows.counters.bytes_stored_shm,
            bytes_served_shm=self.windows.counters.bytes_served_shm, windows_attached=len(self.windows),
            incarnation=self.incarnation,
        )
        if store.count_hits:
            reply.top_hits.extend(kv_cache_pb2.BlockHits(key=k, hits=h) for k, h in store.top_hits(TOP_HITS_REPORTED))
        return reply


def _read_and_check(window: Window, offset: int, length: int) -> tuple[bytes, int]:
    data = window.read(offset, length)
    return data, zlib.crc32(data)


async def _write_segment_major(window: Window, blocks: Sequence[Block], position: int) -> AsyncGenerator[int, None]:
    """Writes the blocks into the window segment-major on a worker thread, and yields the number of
    segments finished as each one is. The copies (pwrite releases the GIL) run off the event loop,
    so that Lookups, which the scheduler waits on, are answered while a load streams; one thread
    call for the whole load keeps the handoffs out of the throughput."""
    loop = asyncio.get_running_loop()
    progress: asyncio.Queue[int | BaseException] = asyncio.Queue()
    stop = threading.Event()
    segments = blocks[0].num_segments if blocks else 0

    def write_all() -> None:
        offset = position
        try:
            for segment in range(segments):
                if stop.is_set():
                    return
                for block in blocks:
                    length = len(block.data) // block.num_segments
                    window.write(offset, memoryview(block.data)[segment * length:(segment + 1) * length])
                    offset += length
                loop.call_soon_threadsafe(progress.put_nowait, segment + 1)
        except BaseException as error:  # handed to the event loop, which raises it in the call
            loop.call_soon_threadsafe(progress.put_nowait, error)

    copying = loop.run_in_executor(None, write_all)
    try:
        for _ in range(segments):
            item = await progress.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        await _settled(copying)


def _headers(blocks: Sequence[Block]) -> kv_cache_pb2.GetBlocksChunk:
    """The first message of a GetBlocks stream."""
    return kv_cache_pb2.GetBlocksChunk(headers=kv_cache_pb2.BlockHeaders(blocks=[
        kv_cache_pb2.BlockHeader(key=b.key, parent_key=b.parent_key, size=len(b.data),
                                 num_segments=b.num_segments, checksum=b.checksum) for b in blocks
    ]))


def _chunk_plan(blocks: Sequence[Block], segment_major: bool) -> list[tuple[int, int, int]]:
    """(block index, start, end) of every chunk, in streaming order."""
    plan = []
    if segment_major and blocks:
        for segment in range(blocks[0].num_segments):
            for index, block in enumerate(blocks):
                length = len(block.data) // block.num_segments
                first, last = segment * length, (segment + 1) * length
                plan += [(index, s, min(s + CHUNK_BYTES, last)) for s in range(first, last, CHUNK_BYTES)]
    else:
        for index, block in enumerate(blocks):
            plan += [(index, s, min(s + CHUNK_BYTES, len(block.data))) for s in range(0, len(block.data), CHUNK_BYTES)]
    return plan
