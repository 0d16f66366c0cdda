"""The cache service's lookahead index over real gRPC and a real Redis, and the worker's sync client
against it (no engine)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from taco_llm.engine_worker.core.lookahead.sync import IndexSync
from taco_llm.protos import lookahead_pb2, lookahead_pb2_grpc, rich_status

from .support import ROOT, RedisServer, free_port


def start_cache_service(port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-m", "taco_llm.cache_service", "--grpc-port", str(port),
                                "--memory", "64M", *extra], cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
    return process


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis-index"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def service(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    process = start_cache_service(port, tmp_path_factory.mktemp("cache") / "cache.log", "--redis-url",
                                  redis_server.url)
    yield f"127.0.0.1:{port}"
    process.terminate()
    assert process.wait(30) == 0


@pytest.fixture
def index(service: str) -> Iterator[lookahead_pb2_grpc.LookaheadIndexStub]:
    with grpc.insecure_channel(service) as channel:
        yield lookahead_pb2_grpc.LookaheadIndexStub(channel)


def record(prompt: list[int], output: list[int], origin: str = "test") -> lookahead_pb2.Record:
    return lookahead_pb2.Record(prompt=prompt, output=output, origin=origin, created_unix=time.time())


def read_until_caught_up(index: lookahead_pb2_grpc.LookaheadIndexStub, namespace: str,
                         after_id: str = "") -> list[lookahead_pb2.Record]:
    records: list[lookahead_pb2.Record] = []
    stream = index.Subscribe(lookahead_pb2.SubscribeRequest(namespace=namespace, after_id=after_id), timeout=30)
    for response in stream:
        records.extend(response.records)
        if response.caught_up:
            stream.cancel()
            break
    return records


def test_publish_then_replay_in_order_and_resume_after_an_id(index: lookahead_pb2_grpc.LookaheadIndexStub) -> None:
    namespace = "model-a:0123"
    for i in range(300):  # more than one read batch
        index.Publish(lookahead_pb2.PublishRequest(namespace=namespace, records=[record([i], [i, i + 1])]))
    records = read_until_caught_up(index, namespace)
    assert [list(r.prompt) for r in records] == [[i] for i in range(300)]
    assert list(records[7].output) == [7, 8] and records[7].origin == "test" and records[7].created_unix > 0
    later = read_until_caught_up(index, namespace, after_id=records[-3].id)
    assert [list(r.prompt) for r in later] == [[298], [299]]
    stats = index.GetStats(lookahead_pb2.GetStatsRequest(namespace=namespace))
    assert (stats.records, stats.tokens, stats.redis_connected) == (300, 900, True)


def test_namespaces_never_mix(index: lookahead_pb2_grpc.LookaheadIndexStub) -> None:
    index.Publish(lookahead_pb2.PublishRequest(namespace="model-b:1", records=[record([1], [2])]))
    assert read_until_caught_up(index, "model-c:1") == []
    assert len(read_until_caught_up(index, "model-b:1")) == 1


def test_a_records_scope_travels_with_it(index: lookahead_pb2_grpc.LookaheadIndexStub) -> None:
    scoped = record([1], [2])
    scoped.scope = "0f" * 16
    index.Publish(lookahead_pb2.PublishRequest(namespace="model-scoped:1", records=[scoped, record([3], [4])]))
    assert [r.scope for r in read_until_caught_up(index, "model-scoped:1")] == ["0f" * 16, ""]
    too_long = record([5], [6])
    too_long.scope = "x" * 65
    with pytest.raises(grpc.RpcError) as error:
        index.Publish(lookahead_pb2.PublishRequest(namespace="model-scoped:1", records=[too_long]))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rich_status.details_of(error.value).field == "records[0].scope"
    assert len(read_until_caught_up(index, "model-scoped:1")) == 2, "nothing of the refused call was stored"


def test_bad_requests_get_precise_errors(index: lookahead_pb2_grpc.LookaheadIndexStub) -> None:
    for bad in ("", "x" * 600):
        with pytest.raises(grpc.RpcError) as error:
            index.Publish(lookahead_pb2.PublishRequest(namespace=bad, records=[record([1], [2])]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in error.value.details()
    # The last two have the form of a log id but a half past Redis's 64 bits (the gRPC fuzz found them).
    for bad_id in ("not-an-id", str(2**64), f"1-{2**64}"):
        with pytest.raises(grpc.RpcError) as error:
            read_until_caught_up(index, "model-a:0123", after_id=bad_id)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "after_id" in error.value.details()
    assert read_until_caught_up(index, "model-a:0123", after_id=f"{2**64 - 1}-{2**64 - 1}") == []
    huge = record([], list(range(5_000_000)))
    with pytest.raises(grpc.RpcError) as error:
        index.Publish(lookahead_pb2.PublishRequest(namespace="model-a:0123", records=[huge]))
    assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    # And the service is still up.
    index.Publish(lookahead_pb2.PublishRequest(namespace="model-a:0123", records=[record([1], [2])]))


def test_without_redis_the_index_says_so(tmp_path: Path) -> None:
    port = free_port()
    process = start_cache_service(port, tmp_path / "cache.log")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as error:
            lookahead_pb2_grpc.LookaheadIndexStub(channel).Publish(
                lookahead_pb2.PublishRequest(namespace="m:1", records=[record([1], [2])]))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--redis-url" in error.value.details()
    finally:
        process.terminate()
        process.wait(30)


def wait_for(condition: object, timeout: float = 20.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_workers_see_each_others_sequences_but_not_their_own(service: str) -> None:
    first, second = (IndexSync(service, "model-d:1", origin) for origin in ("worker-1", "worker-2"))
    try:
        for sync in (first, second):
            sync.start()
            assert sync.caught_up.wait(20)
        first.publish([1, 2], [3, 4])
        second.publish([5], [6])
        wait_for(lambda: len(second.inbox) == 1 and len(first.inbox) == 1)
        assert (second.inbox[0].prompt, second.inbox[0].output, second.inbox[0].scope) == ([1, 2], [3, 4], "")
        assert (first.inbox[0].prompt, first.inbox[0].output) == ([5], [6])
        assert first.connected and second.connected
    finally:
        first.stop()
        second.stop()


@contextlib.contextmanager
def writer_and_reader(service: str, namespace: str, origin: str) -> Iterator[tuple[IndexSync, IndexSync]]:
    """A worker's sync, started and caught up, and a reader's, not yet started; both stopped after."""
    sync = IndexSync(service, namespace, origin)
    reader = IndexSync(service, namespace, "reader")
    sync.start()
    try:
        assert sync.caught_up.wait(20)
        yield sync, reader
    finally:
        sync.stop()
        reader.stop()


def test_a_worker_keeps_what_it_could_not_publish_while_redis_was_down(service: str,
                                                                       redis_server: RedisServer) -> None:
    with writer_and_reader(service, "model-e:1", "worker-3") as (sync, reader):
        redis_server.stop()
        sync.publish([9], [10, 11])
        wait_for(lambda: not sync.connected)
        assert sync.pending() + sync.published == 1 and sync.published == 0
        redis_server.start()
        wait_for(lambda: sync.published == 1, timeout=30)
        reader.start()
        wait_for(lambda: len(reader.inbox) == 1)
        assert reader.inbox[0].output == [10, 11]


def test_stopping_a_sync_publishes_what_waits_and_ends_its_threads(service: str) -> None:
    with writer_and_reader(service, "model-f:1", "worker-4") as (sync, reader):
        for n in range(50):
            sync.publish([n], [n + 1, n + 2])
        sync.stop()  # at once: the last outputs of a worker that shuts down must still reach the index
        assert sync.published == 50, f"only {sync.published} of 50 sequences published before stopping"
        assert not any(thread.is_alive() for thread in sync._threads), "a sync thread outlived stop()"
        reader.start()
        wait_for(lambda: len(reader.inbox) == 50)


def test_long_sequences_travel_in_messages_the_service_accepts(service: str) -> None:
    # 60 sequences of 30,000 tokens, 3 bytes each: some 5.4 MB, past the cache service's 4 MiB message
    # limit, which one Publish or one Subscribe response of them all would pass.
    with writer_and_reader(service, "model-g:1", "worker-5") as (sync, reader):
        for n in range(60):
            sync.publish([], [40_000 + n] * 30_000)
        wait_for(lambda: sync.published == 60, timeout=30)
        reader.start()
        wait_for(lambda: len(reader.inbox) == 60, timeout=30)
        assert [s.output[0] for s in reader.inbox] == [40_000 + n for n in range(60)]
        assert sync.dropped == 0
