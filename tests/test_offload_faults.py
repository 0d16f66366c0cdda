"""The worker's cache-service client when the service stalls, is cut off or dies (no engine: real cache-service
processes, the real client and load code on CPU tensors).

The engine's step must never hang on the service: every wait has a deadline, after which the blocks are
recomputed; saves are dropped rather than queued; and the client finds a dead connection by keepalive and
reconnects when the service is back. tests/test_kv_offload.py holds the same through a real engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import selectors
import signal
import socket
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import torch

from taco_llm.engine_worker.core.kv_offload.client import Backoff, BlockPayload, KVBlockClient
from taco_llm.engine_worker.core.kv_offload.transfer import (
    LOAD_STALL_SECONDS,
    KVLayout,
    LayerwiseLoad,
    Sender,
    byte_view,
)
from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc
from taco_llm.protos.engine_limits import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS

from .support import Process, free_port, start, wait_until

# How long past its deadline a wait may end here: these CPUs are shared with other tests and builds.
SLACK = 3.0
KEEPALIVE_SECONDS = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def small_layout(num_blocks: int = 8) -> KVLayout:
    """Three layers of a paged KV cache shaped as vLLM's CPU backend shapes it: [blocks, heads, tokens, 2 * dim]."""
    return KVLayout([torch.randn(num_blocks, 2, 16, 16) for _ in range(3)], block_dim=0)


def block_bytes(layout: KVLayout, block: int) -> bytes:
    return b"".join(layer[block].contiguous().view(torch.uint8).numpy().tobytes() for layer in layout.layers)


def put_blocks(client: KVBlockClient, layout: KVLayout, keys: Sequence[bytes], sources: Sequence[int]) -> None:
    buffer = torch.empty(layout.block_bytes * len(keys), dtype=torch.uint8)
    layout.gather(sources, buffer.view(len(keys), layout.num_layers, layout.segment_bytes))
    view, size = byte_view(buffer), layout.block_bytes
    reply = client.put([BlockPayload(k, b"", view[i * size:(i + 1) * size], layout.num_layers)
                        for i, k in enumerate(keys)], 10)
    assert reply is not None and reply.num_stored + reply.num_already_held == len(keys)


def timed(action: object, bound: float) -> float:
    """Runs `action` on another thread; fails unless it ends within `bound` seconds. Returns its seconds."""
    started = time.monotonic()
    thread = threading.Thread(target=action, daemon=True)  # type: ignore[arg-type]
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"still waiting after {bound:.1f}s"
    return time.monotonic() - started


def step_through(load: LayerwiseLoad, bound: float) -> tuple[bool, float]:
    """Starts `load` and waits on it as the engine's step does (every layer, then the whole load), on
    another thread; fails unless that ends within `bound` seconds. Returns whether it loaded, and its seconds."""
    loaded: list[bool] = []

    def engine_step() -> None:
        for index in range(load.layout.num_layers):
            load.wait_layer(index)
        loaded.append(load.join())

    load.start()
    elapsed = timed(engine_step, bound)
    return loaded[0], elapsed


# ------------------------------------------------------------------ a load that stalls mid-stream (scripted)


class _StallingStream:
    """A GetBlocks call that sends its first messages, then nothing until cancelled; `release` lets the rest
    through even after a cancel, as bytes already in flight would arrive."""

    def __init__(self, first: Sequence[kv_cache_pb2.GetBlocksChunk], rest: Sequence[kv_cache_pb2.GetBlocksChunk]):
        self._first = list(first)
        self._rest = list(rest)
        self.cancelled = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> _StallingStream:
        return self

    def __next__(self) -> kv_cache_pb2.GetBlocksChunk:
        if self._first:
            return self._first.pop(0)
        self.release.wait()
        if self._rest:
            return self._rest.pop(0)
        raise StopIteration

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class _StallingClient:
    """What LayerwiseLoad uses of KVBlockClient: no window (gRPC bytes), and the stalling GetBlocks."""

    def __init__(self, stream: _StallingStream):
        self.backoff = Backoff("stalling")
        self.stream = stream

    @contextlib.contextmanager
    def load_window(self, size: int) -> Iterator[None]:
        yield None

    def get_stream(self, keys: Sequence[bytes], timeout: float,
                   window: kv_cache_pb2.WindowRef | None = None) -> _StallingStream:
        return self.stream


def test_a_load_that_stalls_is_given_up_within_the_stall_deadline_and_writes_nothing_later() -> None:
    layout = small_layout()
    sources, targets = [1, 2], [5, 6]
    blocks = [block_bytes(layout, b) for b in sources]
    headers = kv_cache_pb2.GetBlocksChunk(headers=kv_cache_pb2.BlockHeaders(blocks=[
        kv_cache_pb2.BlockHeader(key=key(f"stall{i}"), size=layout.block_bytes, num_segments=layout.num_layers,
                                 checksum=zlib.crc32(data)) for i, data in enumerate(blocks)]))
    segment = layout.segment_bytes
    # Segment-major, as the connector asks for it: layer 0 of both blocks, then layer 1, ...
    chunks = [kv_cache_pb2.GetBlocksChunk(block_bytes=kv_cache_pb2.BlockBytes(
        block_index=i, offset=s * segment, data=blocks[i][s * segment:(s + 1) * segment]))
        for s in range(layout.num_layers) for i in range(len(blocks))]
    stream = _StallingStream([headers, *chunks[:2]], chunks[2:])  # layer 0 arrives, then nothing
    before = [layer[targets].clone() for layer in layout.layers]
    client = _StallingClient(stream)
    load = LayerwiseLoad(layout, client, [key("stall0"), key("stall1")], targets)  # type: ignore[arg-type]
    loaded, elapsed = step_through(load, LOAD_STALL_SECONDS + SLACK)
    assert not loaded, "a stalled load must be reported failed (its blocks are recomputed)"
    assert elapsed >= LOAD_STALL_SECONDS * 0.9, "gave up before the stall deadline"
    assert stream.cancelled.is_set(), "the stalled call was not cancelled"
    assert not client.backoff.ready(), "after a stall the next calls should not wait on the service again at once"
    # Layer 0 was in place before the stall; what comes after the engine gave up must never reach the KV cache.
    assert torch.equal(layout.layers[0][targets], layout.layers[0][sources])
    stream.release.set()
    load.thread.join(5)
    assert not load.thread.is_alive()
    for index in range(1, layout.num_layers):
        assert torch.equal(layout.layers[index][targets], before[index]), f"layer {index} written after the stall"


# ------------------------------------------------------------------ a frozen service (SIGSTOP), a real process


@pytest.fixture
def cache_service(tmp_path: Path) -> Iterator[tuple[str, Process]]:
    port = free_port()
    process = start("faults-cache-service", ["cache-service", "--grpc-port", str(port), "--memory", "64M"], tmp_path)
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        stub = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        wait_until(process, lambda: reachable(stub), timeout=60)
    try:
        yield address, process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.popen.pid, signal.SIGCONT)
        assert process.stop() == 0, process.tail()


def reachable(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> bool:
    try:
        stub.Stats(kv_cache_pb2.StatsRequest(), timeout=1)
        return True
    except grpc.RpcError:
        return False


def stats(address: str) -> kv_cache_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return kv_cache_pb2_grpc.KVBlockStoreStub(channel).Stats(kv_cache_pb2.StatsRequest(), timeout=10)


def test_a_frozen_service_costs_each_wait_its_deadline_and_then_works_again(cache_service: tuple[str, Process]) -> None:
    address, process = cache_service
    layout = small_layout(16)
    keys, sources, targets = [key(f"frozen{i}") for i in range(4)], [1, 2, 3, 4], [9, 10, 11, 12]
    scheduler = KVBlockClient(address, 0.5)  # the scheduler's client: Lookups
    worker = KVBlockClient(address, 0.5)  # the worker's: loads and saves
    sender = Sender(worker, copier=layout.copier, ring_bytes=4 * layout.block_bytes)
    try:
        put_blocks(worker, layout, keys, sources)
        assert scheduler.lookup(keys) == 4
        os.kill(process.popen.pid, signal.SIGSTOP)
        held: list[int] = []
        timed(lambda: held.append(scheduler.lookup(keys)), 0.5 + SLACK)
        assert held == [0], "a Lookup the service does not answer counts as a miss"

        for layer in layout.layers:
            layer[targets] = 0
        loaded, _ = step_through(LayerwiseLoad(layout, worker, keys, targets), LOAD_STALL_SECONDS + SLACK)
        assert not loaded

        # Saves while the service is frozen: each step's reserve never waits, and beyond the ring's room
        # they are dropped, not queued.
        reserved = 0
        for _ in range(20):
            started = time.monotonic()
            room = sender.reserve(layout.block_bytes)
            assert time.monotonic() - started < 0.5
            reserved += room is not None
        assert reserved <= 4, "saves were queued beyond the ring's room"

        os.kill(process.popen.pid, signal.SIGCONT)
        # Back: once the client's backoff has passed, lookups, loads and saves work again.
        deadline = time.monotonic() + 30
        while scheduler.lookup(keys) != 4:
            assert time.monotonic() < deadline, "Lookups did not work again after the service came back"
            time.sleep(0.5)
        served = stats(address).blocks_served
        deadline = time.monotonic() + 30
        while True:
            load = LayerwiseLoad(layout, worker, keys, targets)
            load.start()
            if load.join():
                break
            assert time.monotonic() < deadline, "loads did not work again after the service came back"
            time.sleep(0.5)
        assert all(torch.equal(layer[targets], layer[sources]) for layer in layout.layers)
        assert stats(address).blocks_served >= served + 4
        put_blocks(worker, layout, [key("after")], [5])
        assert scheduler.lookup([key("after")]) == 1
    finally:
        sender.stop()
        scheduler.close()
        worker.close()


# ------------------------------------------------------------------ a dead connection (a partition), by a proxy


class BlackHoleProxy:
    """A TCP proxy to `upstream`. `cut()` freezes every connection open now: bytes stop both ways and nothing
    is closed or refused, as when a host is cut off or its container is gone; new connections go through."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.frozen: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def cut(self) -> None:
        with self.lock:
            for key_ in list(self.selector.get_map().values()):
                if key_.fileobj is not self.listener:
                    self.selector.unregister(key_.fileobj)
                    self.frozen.add(key_.fileobj)  # type: ignore[arg-type]

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        for sock in [*self.frozen, *(k.fileobj for k in self.selector.get_map().values())]:
            sock.close()  # type: ignore[union-attr]

    def _run(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                events = self.selector.select(timeout=0.05)
                for key_, _ in events:
                    if key_.fileobj is self.listener:
                        client, _ = self.listener.accept()
                        server = socket.create_connection(self.upstream)
                        self.selector.register(client, selectors.EVENT_READ, server)
                        self.selector.register(server, selectors.EVENT_READ, client)
                        continue
                    source, target = key_.fileobj, key_.data
                    try:
                        data = source.recv(1 << 16)  # type: ignore[union-attr]
                        if data:
                            target.sendall(data)
                            continue
                    except OSError:
                        pass
                    for sock in (source, target):
                        with contextlib.suppress(KeyError, ValueError):
                            self.selector.unregister(sock)
                        sock.close()


def test_the_client_leaves_a_dead_connection_by_keepalive_and_reconnects(cache_service: tuple[str, Process]) -> None:
    address, _ = cache_service
    host, port = address.rsplit(":", 1)
    proxy = BlackHoleProxy((host, int(port)))
    client = KVBlockClient(proxy.address, 0.5)
    layout = small_layout()
    try:
        put_blocks(client, layout, [key("partition")], [1])
        assert client.lookup([key("partition")]) == 1
        proxy.cut()
        cut_at = time.monotonic()
        # The old connection never fails on its own (nothing is refused or reset). With keepalive the client's
        # pings go unanswered and it drops the connection, then dials again: through the proxy, to the service.
        while client.lookup([key("partition")]) != 1:
            assert time.monotonic() - cut_at < 30, "the client kept its dead connection (no keepalive?)"
            time.sleep(0.2)
        found = time.monotonic() - cut_at
        print(f"lookups hit again {found:.1f}s after the connection was cut")
        assert found >= 0.4, "the cut did not cost the client anything: was the old connection cut at all?"
    finally:
        client.close()
        proxy.close()
