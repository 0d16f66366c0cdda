"""taco_llm/grpc_decoding.py on the cache service's real server (cache_service/server.py `serve`, run
in this process): request bytes that are no message of the method's type get INVALID_ARGUMENT, in unary,
server-streaming and client-streaming calls; a half-received PutBlocks keeps nothing of its unfinished
block; good messages still work; the health service is left alone; the API key is checked first."""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.cache_service.config import CacheServiceConfig
from taco_llm.cache_service.server import serve
from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc, rich_status
from taco_llm.protos.rich_status import Reason

from .support import free_port

KEY = "decoding-unit-key"
KV = "/taco_llm.cache.v1.KVBlockStore/"
NOT_A_MESSAGE = b"\xff\xff"  # a field tag with no end: no message of any type


@contextlib.asynccontextmanager
async def cache_service(api_key: str | None = None) -> AsyncIterator[grpc.aio.Channel]:
    """The cache service's server on a free port (no Redis: only KVBlockStore is exercised)."""
    port = free_port()
    config = CacheServiceConfig(grpc_host="127.0.0.1", grpc_port=port, kv_budget_bytes=16 << 20, redis_url=None,
                                min_access_threshold=1, count_hits=False, api_key=api_key)
    stop = asyncio.Event()
    server = asyncio.create_task(serve(config, stop))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=10)
        yield channel
    finally:
        await channel.close()
        stop.set()
        assert await server == 0


def raw_unary(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(KV + method, request_serializer=None, response_deserializer=None)


def assert_undecodable(error: grpc.aio.AioRpcError, what: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert what in (error.details() or ""), error.details()
    assert "DecodeError" not in (error.details() or ""), error.details()
    assert rich_status.has_reason(error, Reason.FIELD_INVALID), error


def block(key: bytes, data: bytes) -> kv_cache_pb2.BlockHeader:
    return kv_cache_pb2.BlockHeader(key=key, size=len(data), num_segments=1, checksum=zlib.crc32(data))


async def test_undecodable_unary_and_server_streaming_requests_get_invalid_argument() -> None:
    async with cache_service() as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await raw_unary(channel, "Lookup")(NOT_A_MESSAGE)
        assert_undecodable(refused.value, "the request is not a valid taco_llm.cache.v1.LookupRequest message")
        get = channel.unary_stream(KV + "GetBlocks", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [message async for message in get(NOT_A_MESSAGE)]
        assert_undecodable(refused.value, "GetBlocksRequest")
        # A good message, as bytes or through the stub, is served as before.
        store = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        good = kv_cache_pb2.LookupRequest(keys=[bytes(32)])
        assert kv_cache_pb2.LookupResponse.FromString(
            await raw_unary(channel, "Lookup")(good.SerializeToString())).num_blocks == 0
        assert (await store.Lookup(good)).num_blocks == 0


async def test_a_bad_put_blocks_chunk_ends_the_call_and_keeps_no_partial_block() -> None:
    whole_key, partial_key = b"\x01" * 32, b"\x02" * 32
    whole, partial = b"w" * 1000, b"p" * 1000
    chunks = [kv_cache_pb2.PutBlocksChunk(start=kv_cache_pb2.BlockStart(header=block(whole_key, whole), data=whole)),
              kv_cache_pb2.PutBlocksChunk(start=kv_cache_pb2.BlockStart(header=block(partial_key, partial),
                                                                        data=partial[:500]))]
    async with cache_service() as channel:
        put = channel.stream_unary(KV + "PutBlocks", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await put(iter([c.SerializeToString() for c in chunks] + [NOT_A_MESSAGE]))
        assert_undecodable(refused.value, "request message 2 is not a valid taco_llm.cache.v1.PutBlocksChunk")
        store = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        # The block completed before the bad chunk is kept (kv_cache.proto); the unfinished one is not.
        assert (await store.Lookup(kv_cache_pb2.LookupRequest(keys=[whole_key]))).num_blocks == 1
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            [m async for m in store.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=[partial_key]))]
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        # The same stream, well formed, stores the block.
        rest = kv_cache_pb2.PutBlocksChunk(more=partial[500:])
        reply = kv_cache_pb2.PutBlocksResponse.FromString(await put(iter([chunks[1].SerializeToString(),
                                                                           rest.SerializeToString()])))
        assert reply.num_stored == 1


async def test_the_health_service_is_left_alone() -> None:
    async with cache_service() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                    response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await check(NOT_A_MESSAGE)
        # grpc's own answer, not ours: no taco-llm details.
        assert refused.value.code() != grpc.StatusCode.OK
        assert rich_status.details_of(refused.value).reason is None, refused.value


async def test_the_api_key_is_checked_before_the_bytes_are_parsed() -> None:
    async with cache_service(api_key=KEY) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await raw_unary(channel, "Lookup")(NOT_A_MESSAGE)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await raw_unary(channel, "Lookup")(NOT_A_MESSAGE, metadata=[("authorization", f"Bearer {KEY}")])
        assert_undecodable(refused.value, "LookupRequest")
