"""The KVBlockStore gRPC service (protos/kv_cache.proto) over the in-memory BlockStore.

Every refusal is a precise status with a message naming the field, and ends only that call:
INVALID_ARGUMENT (malformed keys, sizes or chunks), RESOURCE_EXHAUSTED (a block larger than the
whole budget), DATA_LOSS (checksum mismatch), NOT_FOUND (a key not held).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

import grpc

from protos import kv_cache_pb2, kv_cache_pb2_grpc

from .block_store import KEY_BYTES, Block, BlockStore, PutOutcome
from .config import CacheServiceConfig

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024  # the most bytes one message carries, either way
MAX_KEYS_PER_CALL = 65536
TOP_HITS_REPORTED = 16


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


async def _check_keys(keys: Sequence[bytes], context: grpc.aio.ServicerContext) -> None:
    if len(keys) > MAX_KEYS_PER_CALL:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"keys: at most {MAX_KEYS_PER_CALL} per call, got {len(keys)}")
    for index, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"keys[{index}]: a key is {KEY_BYTES} bytes (SHA-256), got {len(key)}")


class KVBlockStoreServicer(kv_cache_pb2_grpc.KVBlockStoreServicer):
    def __init__(self, config: CacheServiceConfig):
        self.store = BlockStore(config.kv_budget_bytes, config.min_access_threshold, config.count_hits)

    async def Lookup(self, request: kv_cache_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kv_cache_pb2.LookupResponse:
        await _check_keys(request.keys, context)
        return kv_cache_pb2.LookupResponse(num_blocks=self.store.lookup(list(request.keys)))

    async def _check_header(self, header: kv_cache_pb2.BlockHeader, index: int,
                            context: grpc.aio.ServicerContext) -> None:
        where = f"block {index}"
        if len(header.key) != KEY_BYTES:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"{where}: header.key is {KEY_BYTES} bytes (SHA-256), got {len(header.key)}")
        if header.parent_key and len(header.parent_key) != KEY_BYTES:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"{where}: header.parent_key is empty or {KEY_BYTES} bytes, got {len(header.parent_key)}")
        if header.size == 0:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{where}: header.size must be positive")
        if header.num_segments == 0 or header.size % header.num_segments:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"{where}: header.size {header.size} is not a multiple of header.num_segments "
                         f"{header.num_segments} (the block's bytes are that many equal segments)")
        if header.size > self.store.budget_bytes:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{where}: header.size {header.size} is over the store's whole budget of "
                         f"{self.store.budget_bytes} bytes")

    async def PutBlocks(self, request_iterator: AsyncIterator[kv_cache_pb2.PutBlocksChunk],
                        context: grpc.aio.ServicerContext) -> kv_cache_pb2.PutBlocksResponse:
        reply = kv_cache_pb2.PutBlocksResponse()
        header: kv_cache_pb2.BlockHeader | None = None
        data = bytearray()
        index = -1
        async for chunk in request_iterator:
            if chunk.HasField("header"):
                if header is not None:
                    await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                 f"block {index}: the next header came after {len(data)} of its "
                                 f"{header.size} bytes")
                index += 1
                await self._check_header(chunk.header, index, context)
                header, data = chunk.header, bytearray()
            elif header is None:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                             "data: bytes came before any block header")
            if len(chunk.data) > CHUNK_BYTES:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"block {index}: a chunk carries at most {CHUNK_BYTES} bytes, got {len(chunk.data)}")
            data += chunk.data
            if len(data) > header.size:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"block {index}: got more bytes than header.size {header.size}")
            if len(data) == header.size:
                if zlib.crc32(data) != header.checksum:
                    await _abort(context, grpc.StatusCode.DATA_LOSS,
                                 f"block {index}: checksum mismatch (header.checksum {header.checksum}, "
                                 f"bytes {zlib.crc32(data)})")
                outcome = self.store.put(header.key, header.parent_key, bytes(data), header.num_segments,
                                         header.checksum)
                if outcome is PutOutcome.STORED:
                    reply.num_stored += 1
                elif outcome is PutOutcome.ALREADY_HELD:
                    reply.num_already_held += 1
                elif outcome is PutOutcome.BELOW_THRESHOLD:
                    reply.num_below_threshold += 1
                else:
                    reply.num_no_room += 1
                header, data = None, bytearray()
        if header is not None:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"block {index}: the stream ended after {len(data)} of its {header.size} bytes")
        return reply

    async def GetBlocks(self, request: kv_cache_pb2.GetBlocksRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[kv_cache_pb2.GetBlocksChunk]:
        await _check_keys(request.keys, context)
        try:
            blocks = self.store.acquire(list(request.keys))
        except KeyError as missing:
            index = missing.args[0]
            await _abort(context, grpc.StatusCode.NOT_FOUND,
                         f"keys[{index}]: block {request.keys[index].hex()[:16]}... is not held "
                         "(evicted, or never stored)")
        served = False
        try:
            if request.segment_major and len({b.num_segments for b in blocks}) > 1:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                             "segment_major: the blocks have different numbers of segments")
            yield kv_cache_pb2.GetBlocksChunk(headers=[
                kv_cache_pb2.BlockHeader(key=b.key, parent_key=b.parent_key, size=len(b.data),
                                         num_segments=b.num_segments, checksum=b.checksum) for b in blocks
            ])
            for index, start, end in _chunk_plan(blocks, request.segment_major):
                yield kv_cache_pb2.GetBlocksChunk(block_index=index, offset=start,
                                                  data=blocks[index].data[start:end])
            served = True
        finally:
            self.store.release(blocks, served)

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
        )
        if store.count_hits:
            reply.top_hits.extend(kv_cache_pb2.BlockHits(key=k, hits=h) for k, h in store.top_hits(TOP_HITS_REPORTED))
        return reply


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
