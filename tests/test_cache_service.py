"""The cache service's block store (unit tests, no engine) and its gRPC service (a real process)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.block_store import BLOCK_OVERHEAD_BYTES, BlockStore, PutOutcome
from engine_worker.kv_offload.hashing import chain_keys, engine_salt, request_salt
from protos import kv_cache_pb2, kv_cache_pb2_grpc

from .support import ROOT, Process, free_port, start, wait_until

MiB = 1024 * 1024


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _put(store: BlockStore, name: str, parent: str | None, size: int = 1000) -> PutOutcome:
    data = bytes(size)
    return store.put(_key(name), _key(parent) if parent else b"", data, 1, zlib.crc32(data))


# ------------------------------------------------------------------ chain hashing


def test_chain_keys_are_sha256_chains_over_int64_tokens() -> None:
    seed = b"s" * 32
    keys = chain_keys(seed, list(range(10)), 4)
    assert len(keys) == 2  # only full blocks
    first = hashlib.sha256(seed + b"".join(t.to_bytes(8, "little") for t in range(4))).digest()
    assert keys[0] == first
    assert keys[1] == hashlib.sha256(first + b"".join(t.to_bytes(8, "little") for t in range(4, 8))).digest()


def test_chain_keys_depend_on_every_salt_part_and_on_prefix() -> None:
    base = engine_salt({"model": "m", "dtype": "float32", "block_size": 16})
    other_dtype = engine_salt({"model": "m", "dtype": "bfloat16", "block_size": 16})
    assert base != other_dtype
    seeds = {request_salt(base, None, None), request_salt(base, "lora", None), request_salt(base, None, "lora"),
             request_salt(base, None, ""), request_salt(other_dtype, None, None)}
    assert len(seeds) == 5
    tokens = list(range(64))
    a = chain_keys(request_salt(base, None, None), tokens, 16)
    b = chain_keys(request_salt(base, None, None), [99, *tokens[1:]], 16)
    assert all(x != y for x, y in zip(a, b, strict=True)), "a changed first token changes every later key"


def test_chain_keys_are_stable_across_processes_and_hash_seeds() -> None:
    code = ("from engine_worker.kv_offload.hashing import chain_keys, engine_salt, request_salt;"
            "print(chain_keys(request_salt(engine_salt({'m': 1}), 'l', 'c'), list(range(40)), 16)[-1].hex())")
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert len(outputs) == 1
    assert outputs == {chain_keys(request_salt(engine_salt({"m": 1}), "l", "c"), list(range(40)), 16)[-1].hex()}


# ------------------------------------------------------------------ the store


def test_lru_evicts_a_chains_tail_before_its_head() -> None:
    cost = 1000 + BLOCK_OVERHEAD_BYTES
    store = BlockStore(budget_bytes=3 * cost)
    for name, parent in (("a0", None), ("a1", "a0"), ("a2", "a1")):
        assert _put(store, name, parent) is PutOutcome.STORED
    assert store.lru_order() == [_key("a2"), _key("a1"), _key("a0")]
    assert _put(store, "b0", None) is PutOutcome.STORED
    assert _key("a2") not in store and _key("a0") in store and _key("a1") in store
    assert store.lookup([_key("a0"), _key("a1"), _key("a2")]) == 2
    assert store.counters.blocks_evicted == 1


def test_lookup_refreshes_a_chain_so_another_is_evicted() -> None:
    cost = 1000 + BLOCK_OVERHEAD_BYTES
    store = BlockStore(budget_bytes=4 * cost)
    _put(store, "a0", None)
    _put(store, "a1", "a0")
    _put(store, "b0", None)
    _put(store, "b1", "b0")
    assert store.lookup([_key("a0"), _key("a1")]) == 2  # a is now the most recent chain
    _put(store, "c0", None)
    _put(store, "c1", "c0")
    assert _key("a0") in store and _key("a1") in store
    assert _key("b0") not in store and _key("b1") not in store


def test_budget_holds_under_a_flood_of_blocks() -> None:
    store = BlockStore(budget_bytes=50_000)
    for i in range(500):
        _put(store, f"x{i}", f"x{i - 1}" if i % 5 else None, size=700 + i % 300)
        assert store.bytes_used <= store.budget_bytes
    assert store.counters.blocks_evicted > 400
    assert _put(store, "huge", None, size=60_000) is PutOutcome.NO_ROOM


def test_a_block_being_read_is_never_evicted() -> None:
    cost = 1000 + BLOCK_OVERHEAD_BYTES
    store = BlockStore(budget_bytes=2 * cost)
    _put(store, "a", None)
    _put(store, "b", None)
    reading = store.acquire([_key("a"), _key("b")])
    assert _put(store, "c", None) is PutOutcome.NO_ROOM, "both held blocks are being read"
    store.release(reading, served=True)
    assert _put(store, "c", None) is PutOutcome.STORED
    assert store.counters.blocks_served == 2


def test_min_access_threshold_two_keeps_nothing_seen_once() -> None:
    store = BlockStore(budget_bytes=10 * MiB, min_access_threshold=2)
    keys = [_key("t0"), _key("t1")]
    assert store.lookup(keys) == 0
    assert _put(store, "t0", None) is PutOutcome.BELOW_THRESHOLD
    assert _put(store, "t1", "t0") is PutOutcome.BELOW_THRESHOLD
    assert len(store) == 0 and store.bytes_used == 0
    assert store.lookup(keys) == 0  # the second use
    assert _put(store, "t0", None) is PutOutcome.STORED
    assert _put(store, "t1", "t0") is PutOutcome.STORED
    assert store.lookup(keys) == 2


def test_hit_counts_keep_hot_blocks_over_recent_cold_ones() -> None:
    cost = 1000 + BLOCK_OVERHEAD_BYTES
    store = BlockStore(budget_bytes=3 * cost, count_hits=True)
    _put(store, "hot", None)
    for _ in range(3):
        store.release(store.acquire([_key("hot")]), served=True)
    _put(store, "cold1", None)
    _put(store, "cold2", None)
    store.lookup([_key("cold1")])
    store.lookup([_key("cold2")])
    # Plain LRU would evict "hot" (least recent); hit counts evict the least-hit of the least recent.
    _put(store, "new", None)
    assert _key("hot") in store and _key("cold1") not in store
    assert store.top_hits(1) == [(_key("hot"), 3)]


# ------------------------------------------------------------------ the gRPC service, a real process


@pytest.fixture(scope="module")
def cache_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Process]]:
    port = free_port()
    logs = Path(tmp_path_factory.mktemp("cache-service"))
    process = start("cache-service", ["cache-service", "--grpc-port", str(port), "--memory", "16M",
                                      "--apc-offload-enable-hit-cnt"], logs)
    address = f"127.0.0.1:{port}"
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))

    def serving() -> bool:
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1
        except grpc.RpcError:
            return False

    wait_until(process, serving, timeout=60)
    yield address, process
    assert process.stop() == 0, process.tail()


@pytest.fixture
def stub(cache_service: tuple[str, Process]) -> Iterator[kv_cache_pb2_grpc.KVBlockStoreStub]:
    channel = grpc.insecure_channel(cache_service[0])
    yield kv_cache_pb2_grpc.KVBlockStoreStub(channel)
    channel.close()


def _chunks(key: bytes, data: bytes, parent: bytes = b"", segments: int = 1, checksum: int | None = None,
            size: int | None = None) -> Iterator[kv_cache_pb2.PutBlocksChunk]:
    header = kv_cache_pb2.BlockHeader(key=key, parent_key=parent, size=len(data) if size is None else size,
                                      num_segments=segments,
                                      checksum=zlib.crc32(data) if checksum is None else checksum)
    yield kv_cache_pb2.PutBlocksChunk(header=header, data=data[:MiB])
    for start_at in range(MiB, len(data), MiB):
        yield kv_cache_pb2.PutBlocksChunk(data=data[start_at:start_at + MiB])


def _error(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as excinfo:
        call()  # type: ignore[operator]
    return excinfo.value


def test_put_then_get_streams_in_chunks_segment_major(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    blocks = {_key(f"big{i}"): os.urandom(3 * MiB + 4) for i in range(2)}  # 3 MiB+: several chunks each
    keys = list(blocks)
    reply = stub.PutBlocks(c for i, k in enumerate(keys)
                           for c in _chunks(k, blocks[k], keys[i - 1] if i else b"", segments=4))
    assert reply.num_stored == 2
    assert stub.Lookup(kv_cache_pb2.LookupRequest(keys=[*keys, _key("absent")])).num_blocks == 2
    messages = list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=keys, segment_major=True)))
    assert [h.key for h in messages[0].headers] == keys
    assert all(len(m.data) <= MiB for m in messages)
    order = [(m.block_index, m.offset) for m in messages[1:]]
    segment = len(blocks[keys[0]]) // 4
    assert [o // segment for _, o in order] == sorted(o // segment for _, o in order), "segment 0 of all first"
    rebuilt = {k: bytearray(len(v)) for k, v in blocks.items()}
    for m in messages[1:]:
        rebuilt[keys[m.block_index]][m.offset:m.offset + len(m.data)] = m.data
    assert {k: bytes(v) for k, v in rebuilt.items()} == blocks
    stats = stub.Stats(kv_cache_pb2.StatsRequest())
    assert stats.blocks_served >= 2 and stats.hit_counts_enabled and stats.top_hits[0].hits >= 1


@pytest.mark.parametrize(
    ("chunks", "code", "words"),
    [
        (lambda: _chunks(b"short", b"x"), grpc.StatusCode.INVALID_ARGUMENT, "header.key is 32 bytes"),
        (lambda: _chunks(_key("p"), b"x", parent=b"bad"), grpc.StatusCode.INVALID_ARGUMENT, "header.parent_key"),
        (lambda: _chunks(_key("s"), b"abc", size=5), grpc.StatusCode.INVALID_ARGUMENT, "stream ended after 3"),
        (lambda: _chunks(_key("s"), b"abcdef", size=4), grpc.StatusCode.INVALID_ARGUMENT, "more bytes than"),
        (lambda: _chunks(_key("g"), b"abcde", segments=2), grpc.StatusCode.INVALID_ARGUMENT, "num_segments"),
        (lambda: _chunks(_key("z"), b"", size=0), grpc.StatusCode.INVALID_ARGUMENT, "size must be positive"),
        (lambda: _chunks(_key("c"), b"abcd", checksum=1), grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
        (lambda: iter([kv_cache_pb2.PutBlocksChunk(data=b"x")]), grpc.StatusCode.INVALID_ARGUMENT,
         "before any block header"),
        (lambda: _chunks(_key("o"), b"x", size=64 * MiB), grpc.StatusCode.RESOURCE_EXHAUSTED, "whole budget"),
    ],
)
def test_bad_puts_get_precise_errors_and_the_service_stays_up(
        stub: kv_cache_pb2_grpc.KVBlockStoreStub, chunks: object, code: grpc.StatusCode, words: str) -> None:
    error = _error(lambda: stub.PutBlocks(chunks()))  # type: ignore[operator]
    assert error.code() == code and words in (error.details() or ""), error.details()
    good = os.urandom(1000)
    assert stub.PutBlocks(_chunks(_key(f"after-{words}"), good)).num_stored == 1


def test_an_oversized_message_is_refused_by_grpc(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    data = os.urandom(5 * MiB)
    header = kv_cache_pb2.BlockHeader(key=_key("one-message"), size=len(data), num_segments=1,
                                      checksum=zlib.crc32(data))
    error = _error(lambda: stub.PutBlocks(iter([kv_cache_pb2.PutBlocksChunk(header=header, data=data)])))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_keys_and_unknown_keys(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    error = _error(lambda: stub.Lookup(kv_cache_pb2.LookupRequest(keys=[_key("a"), b"123"])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "keys[1]" in (error.details() or "")
    error = _error(lambda: list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=[_key("never stored")]))))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "keys[0]" in (error.details() or "")
    assert stub.Lookup(kv_cache_pb2.LookupRequest(keys=[])).num_blocks == 0


def test_memory_bound_holds_under_a_flood(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    for i in range(40):  # 40 MiB into a 16 MiB budget
        stub.PutBlocks(_chunks(_key(f"flood{i}"), os.urandom(MiB)))
        stats = stub.Stats(kv_cache_pb2.StatsRequest())
        assert stats.bytes_used <= stats.bytes_budget == 16 * MiB
    assert stats.blocks_evicted >= 24


def test_sigterm_stops_it_cleanly(tmp_path: Path) -> None:
    process = start("cache-service-stop", ["cache-service", "--grpc-port", str(free_port()),
                                           "--cpu-prefill-memory-utilization", "0.01"], tmp_path)
    wait_until(process, lambda: "serving" in process.log.read_text(), timeout=60)
    assert process.stop(timeout=20) == 0
