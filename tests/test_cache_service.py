"""The cache service's block store (unit tests, no engine), its gRPC service (a real process), and
the worker's transport to it: shared-memory windows and gRPC bytes, on CPU tensors (no engine)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.cache_service.block_store import BLOCK_OVERHEAD_BYTES, BlockStore, PutOutcome
from taco_llm.cache_service.config import CacheServiceConfig
from taco_llm.cache_service.kv_servicer import KVBlockStoreServicer
from taco_llm.engine_worker.core.kv_offload.client import Backoff, BlockPayload, KVBlockClient, window_gone
from taco_llm.engine_worker.core.kv_offload.hashing import chain_keys, engine_salt, request_salt
from taco_llm.engine_worker.core.kv_offload.transfer import KVLayout, LayerwiseLoad, byte_view
from taco_llm.engine_worker.core.kv_offload.window import SaveRing, ShmWindow
from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc, rich_status
from taco_llm.protos.kv_cache_limits import CHUNK_BYTES, GRPC_MESSAGE_LIMIT, SHM_DIR, WINDOW_NAME_PREFIX, window_name
from taco_llm.protos.rich_status import ErrorDetails, Reason

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
    code = ("from taco_llm.engine_worker.core.kv_offload.hashing import chain_keys, engine_salt, request_salt;"
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


def test_each_run_of_the_service_has_an_incarnation_of_its_own(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    """A random id per start, in every Stats reply: workers and gateways tell a restart (blocks gone) from an
    outage by it."""
    running = stub.Stats(kv_cache_pb2.StatsRequest()).incarnation
    assert len(running) == 32 and running == stub.Stats(kv_cache_pb2.StatsRequest()).incarnation
    config = CacheServiceConfig(grpc_host="127.0.0.1", grpc_port=0, kv_budget_bytes=MiB, redis_url=None,
                                min_access_threshold=1, count_hits=False)
    others = {KVBlockStoreServicer(config).incarnation for _ in range(2)}
    assert len(others) == 2 and running not in others


def _chunks(key: bytes, data: bytes, parent: bytes = b"", segments: int = 1, checksum: int | None = None,
            size: int | None = None) -> Iterator[kv_cache_pb2.PutBlocksChunk]:
    header = kv_cache_pb2.BlockHeader(key=key, parent_key=parent, size=len(data) if size is None else size,
                                      num_segments=segments,
                                      checksum=zlib.crc32(data) if checksum is None else checksum)
    yield kv_cache_pb2.PutBlocksChunk(start=kv_cache_pb2.BlockStart(header=header, data=data[:CHUNK_BYTES]))
    for start_at in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield kv_cache_pb2.PutBlocksChunk(more=data[start_at:start_at + CHUNK_BYTES])


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
    assert [h.key for h in messages[0].headers.blocks] == keys
    assert [m.WhichOneof("kind") for m in messages] == ["headers"] + ["block_bytes"] * (len(messages) - 1)
    chunks = [m.block_bytes for m in messages[1:]]
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)
    order = [(c.block_index, c.offset) for c in chunks]
    segment = len(blocks[keys[0]]) // 4
    assert [o // segment for _, o in order] == sorted(o // segment for _, o in order), "segment 0 of all first"
    rebuilt = {k: bytearray(len(v)) for k, v in blocks.items()}
    for c in chunks:
        rebuilt[keys[c.block_index]][c.offset:c.offset + len(c.data)] = c.data
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
        (lambda: iter([kv_cache_pb2.PutBlocksChunk(more=b"x")]), grpc.StatusCode.INVALID_ARGUMENT,
         "before any block header"),
        (lambda: iter([kv_cache_pb2.PutBlocksChunk()]), grpc.StatusCode.INVALID_ARGUMENT, "kind:"),
        (lambda: iter([*_chunks(_key("n1"), b"abcd", size=8), *_chunks(_key("n2"), b"abcd")]),
         grpc.StatusCode.INVALID_ARGUMENT, "start: the next block began after 4"),
        (lambda: _chunks(_key("o"), b"x", size=64 * MiB), grpc.StatusCode.RESOURCE_EXHAUSTED, "whole budget"),
    ],
)
def test_bad_puts_get_precise_errors_and_the_service_stays_up(
        stub: kv_cache_pb2_grpc.KVBlockStoreStub, chunks: object, code: grpc.StatusCode, words: str) -> None:
    error = _error(lambda: stub.PutBlocks(chunks()))  # type: ignore[operator]
    assert error.code() == code and words in (error.details() or ""), error.details()
    details = rich_status.details_of(error)
    assert details.field and Reason.Value(details.reason or "ERROR_REASON_UNSPECIFIED"), details  # typed
    good = os.urandom(1000)
    assert stub.PutBlocks(_chunks(_key(f"after-{words}"), good)).num_stored == 1


def test_an_oversized_message_is_refused_by_grpc(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    data = os.urandom(GRPC_MESSAGE_LIMIT + MiB)
    header = kv_cache_pb2.BlockHeader(key=_key("one-message"), size=len(data), num_segments=1,
                                      checksum=zlib.crc32(data))
    error = _error(lambda: stub.PutBlocks(iter([kv_cache_pb2.PutBlocksChunk(
        start=kv_cache_pb2.BlockStart(header=header, data=data))])))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_keys_and_unknown_keys(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    error = _error(lambda: stub.Lookup(kv_cache_pb2.LookupRequest(keys=[_key("a"), b"123"])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "keys[1]" in (error.details() or "")
    assert rich_status.details_of(error) == ErrorDetails("FIELD_INVALID", "keys[1]")
    error = _error(lambda: list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=[_key("never stored")]))))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "keys[0]" in (error.details() or "")
    assert rich_status.details_of(error) == ErrorDetails("BLOCK_NOT_FOUND", "keys[0]")
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


# ------------------------------------------------------------------ shared-memory windows


def _attach(stub: kv_cache_pb2_grpc.KVBlockStoreStub, window: ShmWindow) -> int:
    reply = stub.AttachWindow(kv_cache_pb2.AttachWindowRequest(name=window.name, size=window.size,
                                                               nonce=window.nonce))
    window.window_id = reply.window_id
    window.unlink()
    return int(reply.window_id)


def _window_chunks(keys: list[bytes], blocks: list[bytes], window: ShmWindow, segments: int,
                   offset: int = 0) -> Iterator[kv_cache_pb2.PutBlocksChunk]:
    """Copies the blocks into the window back to back and names them there."""
    for i, (key, data) in enumerate(zip(keys, blocks, strict=True)):
        window.tensor[offset:offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        header = kv_cache_pb2.BlockHeader(key=key, parent_key=keys[i - 1] if i else b"", size=len(data),
                                          num_segments=segments, checksum=zlib.crc32(data))
        ref = kv_cache_pb2.WindowRef(window_id=window.window_id, offset=offset, length=len(data))
        yield kv_cache_pb2.PutBlocksChunk(windowed=kv_cache_pb2.WindowedBlock(header=header, window=ref))
        offset += len(data)


def _segment_major_to_blocks(staged: bytes, sizes: list[int], segments: int) -> list[bytes]:
    blocks = [bytearray() for _ in sizes]
    position = 0
    for _ in range(segments):
        for i, size in enumerate(sizes):
            blocks[i] += staged[position:position + size // segments]
            position += size // segments
    return [bytes(b) for b in blocks]


def test_put_and_get_through_a_window_match_the_grpc_path_byte_for_byte(
        stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    window = ShmWindow(16 * MiB)
    assert _attach(stub, window) > 0
    assert not os.path.exists(window.path), "the file is unlinked once attached"
    segments = 6
    through_shm = [_key(f"shm{i}") for i in range(3)]
    through_grpc = [_key(f"grpc{i}") for i in range(3)]
    blocks = [os.urandom(segments * 100_000) for _ in range(3)]
    before = stub.Stats(kv_cache_pb2.StatsRequest())
    assert stub.PutBlocks(_window_chunks(through_shm, blocks, window, segments)).num_stored == 3
    assert stub.PutBlocks(c for i, k in enumerate(through_grpc)
                          for c in _chunks(k, blocks[i], through_grpc[i - 1] if i else b"", segments)).num_stored == 3
    size = sum(len(b) for b in blocks)
    for keys in (through_shm, through_grpc):
        ref = kv_cache_pb2.WindowRef(window_id=window.window_id, offset=4096, length=size)
        window.tensor.zero_()
        messages = list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=keys, segment_major=True, window=ref)))
        assert [h.key for h in messages[0].headers.blocks] == keys
        assert [m.segments_in_window for m in messages[1:]] == list(range(1, segments + 1))
        assert [m.WhichOneof("kind") for m in messages[1:]] == ["segments_in_window"] * segments  # no bytes
        staged = window.tensor[4096:4096 + size].numpy().tobytes()
        assert _segment_major_to_blocks(staged, [len(b) for b in blocks], segments) == blocks
        assert [h.checksum for h in messages[0].headers.blocks] == [zlib.crc32(b) for b in blocks]
        rebuilt = [bytearray(len(b)) for b in blocks]  # the gRPC path, for the same keys
        for m in list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=keys, segment_major=True)))[1:]:
            c = m.block_bytes
            rebuilt[c.block_index][c.offset:c.offset + len(c.data)] = c.data
        assert [bytes(b) for b in rebuilt] == blocks
    after = stub.Stats(kv_cache_pb2.StatsRequest())
    assert after.bytes_stored_shm - before.bytes_stored_shm == size
    assert after.bytes_served_shm - before.bytes_served_shm == 2 * size
    assert after.windows_attached >= 1
    assert stub.DetachWindow(kv_cache_pb2.DetachWindowRequest(window_id=window.window_id)).detached
    assert not stub.DetachWindow(kv_cache_pb2.DetachWindowRequest(window_id=window.window_id)).detached
    window.close()


def _window_file(name: str, size: int, nonce: bytes) -> Path:
    path = Path(SHM_DIR) / name
    path.write_bytes(nonce + bytes(size - len(nonce)))
    path.chmod(0o600)
    return path


def _attach_error(stub: kv_cache_pb2_grpc.KVBlockStoreStub, name: str, size: int, nonce: bytes) -> grpc.RpcError:
    return _error(lambda: stub.AttachWindow(kv_cache_pb2.AttachWindowRequest(name=name, size=size, nonce=nonce)))


def test_bad_windows_are_refused_precisely_and_the_service_stays_up(
        stub: kv_cache_pb2_grpc.KVBlockStoreStub, tmp_path: Path) -> None:
    nonce = os.urandom(16)
    name = window_name(os.getpid(), os.urandom(8).hex())
    INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    outside = tmp_path / name
    outside.write_bytes(nonce + bytes(4080))
    cases: list[tuple[str, int, bytes, grpc.StatusCode, str]] = [
        ("../../etc/passwd", 4096, nonce, INVALID, "name:"),
        (f"../{name}", 4096, nonce, INVALID, "name:"),
        (f"{WINDOW_NAME_PREFIX}1-{'z' * 16}", 4096, nonce, INVALID, "name:"),
        ("psm_12345678", 4096, nonce, INVALID, "name:"),
        (name, 4096, nonce, PRECONDITION, "not reachable"),  # no such file here: another host
        (name, 4096, nonce[:8], INVALID, "nonce:"),
        (name, 0, nonce, INVALID, "size:"),
        (name, 8 * 1024**3, nonce, INVALID, "size:"),
    ]
    for case_name, size, case_nonce, code, words in cases:
        error = _attach_error(stub, case_name, size, case_nonce)
        assert error.code() == code and words in (error.details() or ""), (case_name, error.details())
    created = [_window_file(name, 4096, nonce)]
    try:
        error = _attach_error(stub, name, 8192, nonce)
        assert error.code() == INVALID and "size: the window" in (error.details() or ""), error.details()
        error = _attach_error(stub, name, 4096, os.urandom(16))
        assert error.code() == PRECONDITION and "nonce:" in (error.details() or ""), error.details()
        link = Path(SHM_DIR) / window_name(os.getpid(), os.urandom(8).hex())
        link.symlink_to(outside)
        created.append(link)
        error = _attach_error(stub, link.name, 4096, nonce)
        assert error.code() == INVALID and "symbolic link" in (error.details() or ""), error.details()
        folder = Path(SHM_DIR) / window_name(os.getpid(), os.urandom(8).hex())
        folder.mkdir()
        try:
            error = _attach_error(stub, folder.name, 4096, nonce)
            assert error.code() == INVALID and "not a regular file" in (error.details() or ""), error.details()
        finally:
            folder.rmdir()
        assert stub.AttachWindow(kv_cache_pb2.AttachWindowRequest(name=name, size=4096, nonce=nonce)).window_id
    finally:
        for path in created:
            path.unlink()
    assert stub.Lookup(kv_cache_pb2.LookupRequest(keys=[_key("still up")])).num_blocks == 0


def test_bad_window_refs_on_puts_and_gets_get_precise_errors(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    window = ShmWindow(1 * MiB)
    _attach(stub, window)
    key, data = _key("ref-target"), os.urandom(4000)
    assert stub.PutBlocks(_chunks(key, data, segments=4)).num_stored == 1
    wid = window.window_id

    def get(ref: kv_cache_pb2.WindowRef) -> grpc.RpcError:
        return _error(lambda: list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=[key], segment_major=True,
                                                                                window=ref))))

    def put(chunk: kv_cache_pb2.PutBlocksChunk, *more: kv_cache_pb2.PutBlocksChunk) -> grpc.RpcError:
        return _error(lambda: stub.PutBlocks(iter([chunk, *more])))

    def windowed(header: kv_cache_pb2.BlockHeader, window: kv_cache_pb2.WindowRef) -> kv_cache_pb2.PutBlocksChunk:
        return kv_cache_pb2.PutBlocksChunk(windowed=kv_cache_pb2.WindowedBlock(header=header, window=window))

    header = kv_cache_pb2.BlockHeader(key=_key("via-window"), size=4000, num_segments=4, checksum=zlib.crc32(data))
    window.tensor[:4000] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    ref = kv_cache_pb2.WindowRef
    cases: list[tuple[grpc.RpcError, grpc.StatusCode, str]] = [
        (get(ref(window_id=wid + 1, offset=0, length=4000)), grpc.StatusCode.FAILED_PRECONDITION,
         f"window.window_id {wid + 1} is not attached"),
        (get(ref(window_id=wid, offset=MiB + 1, length=1)), grpc.StatusCode.INVALID_ARGUMENT, "window.offset"),
        (get(ref(window_id=wid, offset=MiB - 100, length=4000)), grpc.StatusCode.INVALID_ARGUMENT,
         "window.length 4000 at offset"),
        (get(ref(window_id=wid, offset=0, length=100)), grpc.StatusCode.INVALID_ARGUMENT,
         "window.length 100 cannot hold"),
        (put(windowed(header, ref(window_id=wid + 1, offset=0, length=4000))),
         grpc.StatusCode.FAILED_PRECONDITION, "windowed.window.window_id"),
        (put(windowed(header, ref(window_id=wid, offset=0, length=3999))),
         grpc.StatusCode.INVALID_ARGUMENT, "windowed.window.length 3999 is not windowed.header.size"),
        (put(windowed(header, ref(window_id=wid, offset=MiB - 10, length=4000))),
         grpc.StatusCode.INVALID_ARGUMENT, "windowed.window.length 4000 at offset"),
        # A windowed block carries no bytes in the stream: any that follow it are refused (after it is stored).
        (put(windowed(kv_cache_pb2.BlockHeader(key=_key("then-more"), size=4000, num_segments=4,
                                               checksum=zlib.crc32(data)), ref(window_id=wid, offset=0, length=4000)),
             kv_cache_pb2.PutBlocksChunk(more=b"x")), grpc.StatusCode.INVALID_ARGUMENT, "more:"),
        (put(kv_cache_pb2.PutBlocksChunk(start=kv_cache_pb2.BlockStart(header=header, data=data[:10])),
             windowed(header, ref(window_id=wid, offset=0, length=4000))),
         grpc.StatusCode.INVALID_ARGUMENT, "windowed: the next block began after 10"),
        (put(windowed(kv_cache_pb2.BlockHeader(key=_key("bad-crc"), size=4000, num_segments=4, checksum=1),
                      ref(window_id=wid, offset=0, length=4000))), grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
    ]
    for error, code, words in cases:
        assert error.code() == code and words in (error.details() or ""), (code, words, error.details())
    fields = [rich_status.details_of(error).field for error, _, _ in cases[4:]]
    assert fields == ["windowed.window.window_id", "windowed.window.length", "windowed.window.length", "more",
                      "windowed", "windowed.header.checksum"]
    assert stub.PutBlocks(iter([windowed(header, ref(window_id=wid, offset=0, length=4000))])).num_stored == 1
    window.close()


def test_a_client_that_shrinks_its_window_cannot_hurt_the_service(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> None:
    window = ShmWindow(1 * MiB)
    reply = stub.AttachWindow(kv_cache_pb2.AttachWindowRequest(name=window.name, size=window.size,
                                                               nonce=window.nonce))
    os.truncate(window.path, 0)  # before unlinking: a mapping would now SIGBUS on its first touch
    window.unlink()
    data = os.urandom(4000)
    header = kv_cache_pb2.BlockHeader(key=_key("shrunk"), size=4000, num_segments=1, checksum=zlib.crc32(data))
    ref = kv_cache_pb2.WindowRef(window_id=reply.window_id, offset=0, length=4000)
    error = _error(lambda: stub.PutBlocks(iter([kv_cache_pb2.PutBlocksChunk(
        windowed=kv_cache_pb2.WindowedBlock(header=header, window=ref))])))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "shrank" in (error.details() or "")
    assert rich_status.details_of(error) == ErrorDetails("WINDOW_IO_FAILED", "windowed.window")
    assert stub.PutBlocks(_chunks(_key("shrunk"), data)).num_stored == 1
    messages = list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=[_key("shrunk")], window=ref)))
    assert messages[-1].segments_in_window == 1  # the write grew the file again: harmless to the service
    assert stub.Stats(kv_cache_pb2.StatsRequest()).num_blocks > 0
    window.close()


def test_save_ring_hands_out_fifo_ranges_and_wraps() -> None:
    window = ShmWindow(1000)
    ring = SaveRing(window)
    a, b = ring.allocate(400), ring.allocate(400)
    assert (a, b, ring.allocate(400)) == (0, 400, None), "full"
    ring.free(a)
    assert ring.allocate(300) == 0, "wraps to the freed head"
    assert ring.allocate(100) == 300 and ring.allocate(1) is None
    ring.free(b)
    assert ring.allocate(500) == 400 and ring.in_use() == 900
    assert ring.allocate(0) is None and ring.allocate(1001) is None
    window.close()


class _ScriptedStream:
    """A GetBlocks call that answers with the given messages."""

    def __init__(self, messages: Sequence[kv_cache_pb2.GetBlocksChunk]):
        self._messages = iter(messages)

    def __iter__(self) -> _ScriptedStream:
        return self

    def __next__(self) -> kv_cache_pb2.GetBlocksChunk:
        return next(self._messages)

    def cancel(self) -> bool:
        return True


class _ScriptedClient:
    """What LayerwiseLoad uses of KVBlockClient, with no window (gRPC bytes) and a scripted GetBlocks."""

    def __init__(self, messages: Sequence[kv_cache_pb2.GetBlocksChunk]):
        self.backoff = Backoff("scripted")
        self.messages = messages

    @contextmanager
    def load_window(self, size: int) -> Iterator[None]:
        yield None

    def get_stream(self, keys: Sequence[bytes], timeout: float,
                   window: kv_cache_pb2.WindowRef | None = None) -> _ScriptedStream:
        return _ScriptedStream(self.messages)


def test_a_load_takes_only_the_message_kinds_due(caplog: pytest.LogCaptureFixture) -> None:
    layers = [torch.randn(2, 4, 8) for _ in range(2)]  # block_dim 1: a segment is 2 x 8 floats
    layout = KVLayout(layers, block_dim=1)
    block = torch.cat([layer[:, 1].flatten() for layer in layers]).view(torch.uint8).numpy().tobytes()
    header = kv_cache_pb2.BlockHeader(key=_key("scripted"), size=layout.block_bytes, num_segments=2,
                                      checksum=zlib.crc32(block))
    headers = kv_cache_pb2.GetBlocksChunk(headers=kv_cache_pb2.BlockHeaders(blocks=[header]))
    data = kv_cache_pb2.GetBlocksChunk(block_bytes=kv_cache_pb2.BlockBytes(block_index=0, offset=0, data=block))

    def load(*messages: kv_cache_pb2.GetBlocksChunk) -> bool:
        layers[0][:, 2] = layers[1][:, 2] = 0
        loading = LayerwiseLoad(layout, _ScriptedClient(messages), [header.key], [2])
        loading.start()
        return loading.join()

    assert load(headers, data) and all(torch.equal(layer[:, 1], layer[:, 2]) for layer in layers)
    cases = [
        ((kv_cache_pb2.GetBlocksChunk(segments_in_window=2),), "GetBlocks began with segments_in_window"),
        ((headers, kv_cache_pb2.GetBlocksChunk(segments_in_window=2)),
         "GetBlocks sent segments_in_window where block_bytes was due"),
        ((headers, headers), "GetBlocks sent headers where block_bytes was due"),
        ((headers, kv_cache_pb2.GetBlocksChunk()), "GetBlocks sent an empty message where block_bytes was due"),
    ]
    for messages, words in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="taco_llm.kv_offload"):
            assert not load(*messages)
        assert any(words in r.getMessage() for r in caplog.records), (words, caplog.records)


def test_the_client_reattaches_after_a_service_restart_and_falls_back_to_grpc_bytes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    argv = ["cache-service", "--grpc-port", str(port), "--memory", "64M"]
    layers = [torch.randn(2, 12, 2, 16, 8) for _ in range(3)]
    layout = KVLayout(layers, block_dim=1)
    keys = [_key(f"restart{i}") for i in range(4)]
    sources, targets = [1, 3, 5, 7], [8, 9, 10, 11]

    def save(client: KVBlockClient, window: ShmWindow | None) -> kv_cache_pb2.PutBlocksResponse | None:
        buffer = window.tensor[:layout.block_bytes * 4] if window else torch.empty(layout.block_bytes * 4,
                                                                                    dtype=torch.uint8)
        layout.gather(sources, buffer.view(4, layout.num_layers, layout.segment_bytes))
        view = byte_view(buffer)
        size = layout.block_bytes
        return client.put([BlockPayload(k, b"", view[i * size:(i + 1) * size], layout.num_layers,
                                        i * size if window else None) for i, k in enumerate(keys)], 10, window)

    def load(client: KVBlockClient) -> None:
        for layer in layers:
            layer[:, targets] = 0
        loading = LayerwiseLoad(layout, client, keys, targets)
        loading.start()
        assert loading.join()
        assert all(torch.equal(layer[:, sources], layer[:, targets]) for layer in layers)

    first = _start_service("restart-1", argv, address, tmp_path)
    client = KVBlockClient(address, 1.0)
    try:
        ring = client.attach(MiB)
        assert ring is not None and ring.window_id
        assert save(client, ring).num_stored == 4  # type: ignore[union-attr]
        load(client)
        stub = kv_cache_pb2_grpc.KVBlockStoreStub(grpc.insecure_channel(address))
        assert stub.Stats(kv_cache_pb2.StatsRequest()).bytes_served_shm == 4 * layout.block_bytes
        first_incarnation = stub.Stats(kv_cache_pb2.StatsRequest()).incarnation
        assert first.stop() == 0
        second = _start_service("restart-2", argv, address, tmp_path)
        wait_until(second, lambda: _reachable(stub))
        assert stub.Stats(kv_cache_pb2.StatsRequest()).incarnation not in ("", first_incarnation)
        ref = kv_cache_pb2.WindowRef(window_id=ring.window_id, offset=0, length=MiB)
        error = _error(lambda: list(stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=keys[:1], window=ref))))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (error.details() or "").startswith("window.window_id")
        # The client decides by the typed reason, not by those words.
        assert rich_status.details_of(error) == ErrorDetails("WINDOW_NOT_FOUND", "window.window_id")
        assert window_gone(error)
        # A put through the stale window goes again as bytes; a load attaches a fresh window.
        assert save(client, ring).num_stored == 4  # type: ignore[union-attr]
        assert ring.stale
        load(client)
        stats = stub.Stats(kv_cache_pb2.StatsRequest())
        assert stats.bytes_served_shm == 4 * layout.block_bytes and stats.windows_attached == 1
        # A service that cannot see our windows (another host): gRPC bytes from then on, one log line.
        remote = KVBlockClient(address, 1.0)
        remote.shm_dir = str(tmp_path)
        with caplog.at_level(logging.WARNING, logger="taco_llm.kv_offload"):
            load(remote)
            load(remote)
        assert not remote.shared_memory
        lines = [r.getMessage() for r in caplog.records if "is not usable" in r.getMessage()]
        assert len(lines) == 1 and "not reachable" in lines[0], lines
        assert stub.Stats(kv_cache_pb2.StatsRequest()).bytes_served_shm == stats.bytes_served_shm
        remote.close()
        assert second.stop() == 0
        # The same folder seen by both (--shm-dir, --apc-offload-shm-dir): shared memory again.
        third = _start_service("restart-3", [*argv, "--shm-dir", str(tmp_path)], address, tmp_path)
        elsewhere = KVBlockClient(address, 1.0, shm_dir=str(tmp_path))
        try:
            ring = elsewhere.attach(MiB)
            assert ring is not None and ring.path.startswith(str(tmp_path))
            assert save(elsewhere, ring).num_stored == 4  # type: ignore[union-attr]
            load(elsewhere)
            assert elsewhere.shared_memory
            assert stub.Stats(kv_cache_pb2.StatsRequest()).bytes_served_shm == 4 * layout.block_bytes
        finally:
            elsewhere.close()
        assert third.stop() == 0
    finally:
        client.close()
        first.stop()
    assert not list(tmp_path.glob(f"{WINDOW_NAME_PREFIX}*"))
    assert not list(Path(SHM_DIR).glob(f"{WINDOW_NAME_PREFIX}{os.getpid()}-*"))


def _reachable(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> bool:
    try:
        stub.Stats(kv_cache_pb2.StatsRequest(), timeout=1)
        return True
    except grpc.RpcError:
        return False


def _start_service(name: str, argv: list[str], address: str, logs: Path) -> Process:
    process = start(name, argv, logs)
    stub = kv_cache_pb2_grpc.KVBlockStoreStub(grpc.insecure_channel(address))
    wait_until(process, lambda: _reachable(stub), timeout=60)
    return process


def test_the_same_text_without_the_reason_is_not_a_decision() -> None:
    """The worker's cache client decides by the reason, never by the message's words."""
    words_only = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                      details="window.window_id 7 is not attached")
    assert not window_gone(words_only)  # type: ignore[arg-type]
    rich = rich_status.status(grpc.StatusCode.FAILED_PRECONDITION, "gone", Reason.WINDOW_NOT_FOUND,
                              "window.window_id")
    typed = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(*rich.trailing_metadata), details=rich.details)
    assert window_gone(typed)  # type: ignore[arg-type]


def test_the_window_folder_must_be_an_absolute_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from taco_llm.cache_service.config import parse

    assert parse(["--memory", "1M"]).shm_dir == SHM_DIR
    assert parse(["--memory", "1M", "--shm-dir", str(tmp_path)]).shm_dir == str(tmp_path)
    for value in ("shm", str(tmp_path / "absent")):
        with pytest.raises(SystemExit) as exit_info:
            parse(["--memory", "1M", "--shm-dir", value])
        assert exit_info.value.code == 2 and "--shm-dir" in capsys.readouterr().err
