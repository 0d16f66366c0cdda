"""The prefix-KV transfer on a CUDA device (engine_worker/core/kv_offload/device_copy.py): page-locked
windows, copies on the connector's side stream that overlap the forward pass, per-layer events that the
compute stream (not the host) waits on, saves that never make the host wait, and cancelled loads that
write nothing after their deadline. The real KVLayout, LayerwiseLoad and Sender code moves the bytes;
the cache service is replaced by small in-process fakes of GetBlocks and PutBlocks.

Runs where CUDA is available and is skipped elsewhere (the CPU path is covered by test_cache_service.py
and test_kv_offload.py). It needs torch, grpcio and protobuf, not vLLM, and no conftest:
    python3 -m pytest --noconftest -p no:cacheprovider tests/test_kv_transfer_cuda.py -v -rA
"""

from __future__ import annotations

import contextlib
import gc
import queue
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import cast

import pytest
import torch

from taco_llm.engine_worker.core.kv_offload.client import Backoff, BlockPayload, KVBlockClient
from taco_llm.engine_worker.core.kv_offload.device_copy import (
    CudaKVCopier,
    register_host_memory,
    unregister_host_memory,
)
from taco_llm.engine_worker.core.kv_offload.transfer import KVLayout, LayerwiseLoad, SaveBatch, Sender, byte_view
from taco_llm.engine_worker.core.kv_offload.window import ShmWindow
from taco_llm.protos import kv_cache_pb2

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (torch.cuda.is_available() is False); the CPU transfer path is tested by "
           "test_cache_service.py and test_kv_offload.py")

MiB = 1024 * 1024
LAYERS = 4
BLOCK_SIZE, HEADS, HEAD_DIM = 16, 8, 128  # vLLM's flash-attention layout: [2, blocks, block_size, heads, dim]


def _layout(num_blocks: int) -> KVLayout:
    layers = [torch.randn(2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    layout = KVLayout(layers, block_dim=1)
    assert isinstance(layout.copier, CudaKVCopier), "a CUDA KV cache gets the CUDA copier"
    return layout


def _index(block_ids: Sequence[int]) -> torch.Tensor:
    """Made before any timed section: a tensor from a list is a synchronous copy."""
    return torch.tensor(list(block_ids), dtype=torch.long, device="cuda")


def _block_bytes(layout: KVLayout, block_ids: Sequence[int]) -> torch.Tensor:
    """The blocks' bytes as the offload defines them, [blocks, layers, segment bytes] uint8 on the host:
    each block's layers one after another, each layer's slice of the block in its own memory order."""
    return torch.stack([
        torch.stack([layer.select(layout.block_dim, block).contiguous().view(torch.uint8).reshape(-1).cpu()
                     for layer in layout.layers])
        for block in block_ids])


def _layer_bytes(layout: KVLayout, index: int, blocks: torch.Tensor) -> torch.Tensor:
    """Layer `index` of the blocks as [blocks, segment bytes] uint8 on the host."""
    picked = layout.layers[index].index_select(layout.block_dim, blocks).movedim(layout.block_dim, 0)
    return picked.contiguous().view(torch.uint8).reshape(len(blocks), -1).cpu()


class _Busy:
    """Keeps a stream busy for a given time with matmuls (calibrated once), like a forward pass."""

    def __init__(self) -> None:
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(self.a)
        for _ in range(3):
            torch.mm(self.a, self.b, out=out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.mm(self.a, self.b, out=out)
        end.record()
        end.synchronize()
        self.ms_per_matmul = start.elapsed_time(end) / 10

    def run(self, stream: torch.cuda.Stream, milliseconds: float) -> None:
        with torch.cuda.stream(stream):
            out = torch.empty_like(self.a)  # per stream: allocated and freed in that stream's order
            for _ in range(max(1, round(milliseconds / self.ms_per_matmul))):
                torch.mm(self.a, self.b, out=out)


@pytest.fixture(scope="module")
def busy() -> _Busy:
    return _Busy()


# ------------------------------------------------------------------ in-process fakes of the service


class _FakeCall:
    """A GetBlocks call as LayerwiseLoad sees it: an iterator of chunks that can be cancelled."""

    def __init__(self, messages: Iterator[kv_cache_pb2.GetBlocksChunk]):
        self._messages = messages
        self.cancelled = False

    def __iter__(self) -> _FakeCall:
        return self

    def __next__(self) -> kv_cache_pb2.GetBlocksChunk:
        return next(self._messages)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _FakeLoadClient:
    """What LayerwiseLoad uses of KVBlockClient. GetBlocks writes `blocks` ([blocks, layers, segment
    bytes] uint8) into the window segment-major, one layer per progress message, as the service does;
    with `hold_at`, it stops before that layer until `gate` is set."""

    def __init__(self, window: ShmWindow, blocks: torch.Tensor, hold_at: int | None = None):
        self.backoff = Backoff("fake")
        self.window = window
        self.blocks = blocks
        self.hold_at = hold_at
        self.held = threading.Event()
        self.gate = threading.Event()
        self.delivered_after_hold = 0

    @contextlib.contextmanager
    def load_window(self, size: int) -> Iterator[ShmWindow]:
        assert size <= self.window.size
        yield self.window

    def get_stream(self, keys: Sequence[bytes], timeout: float,
                   window: kv_cache_pb2.WindowRef | None = None) -> _FakeCall:
        assert window is not None and window.window_id == self.window.window_id, "the load names our window"
        return _FakeCall(self._messages(len(keys)))

    def _messages(self, count: int) -> Iterator[kv_cache_pb2.GetBlocksChunk]:
        assert count == len(self.blocks)
        _, layers, segment = self.blocks.shape
        yield kv_cache_pb2.GetBlocksChunk(headers=kv_cache_pb2.BlockHeaders(blocks=[
            kv_cache_pb2.BlockHeader(key=bytes([i]) * 32, size=layers * segment, num_segments=layers,
                                     checksum=zlib.crc32(self.blocks[i].numpy().tobytes()))
            for i in range(count)]))
        segment_major = self.blocks.transpose(0, 1).reshape(layers, count * segment)
        per_layer = count * segment
        for layer in range(layers):
            if layer == self.hold_at:
                self.held.set()
                self.gate.wait(30)
            if self.hold_at is not None and layer >= self.hold_at:
                self.delivered_after_hold += 1
            self.window.tensor[layer * per_layer:(layer + 1) * per_layer].copy_(segment_major[layer])
            yield kv_cache_pb2.GetBlocksChunk(segments_in_window=layer + 1)


class _FakeSaveClient:
    """What Sender uses of KVBlockClient. PutBlocks records each block's CRC-32 over the bytes it reads
    (as the real client computes them, in the sender thread) and stores them all."""

    shared_memory = True

    def __init__(self) -> None:
        self.backoff = Backoff("fake")
        self.windows: list[ShmWindow] = []
        self.puts: queue.Queue[list[tuple[bytes, int, int | None]]] = queue.Queue()

    def attach(self, size: int) -> ShmWindow:
        window = ShmWindow(size)
        window.window_id = 7
        self.windows.append(window)
        return window

    def detach(self, window: ShmWindow) -> None:
        window.close()

    def put(self, blocks: Sequence[BlockPayload], timeout: float,
            window: ShmWindow | None = None) -> kv_cache_pb2.PutBlocksResponse:
        self.puts.put([(b.key, zlib.crc32(b.data), b.window_offset) for b in blocks])
        return kv_cache_pb2.PutBlocksResponse(num_stored=len(blocks))


def _save_step(sender: Sender, layout: KVLayout, block_ids: list[int], keys: list[bytes]) -> torch.Tensor:
    """One step's save as the connector's wait_for_save makes it; returns the host buffer used."""
    size = layout.block_bytes
    room = sender.reserve(size * len(block_ids))
    assert room is not None, "the sender refused room for a save"
    buffer, ring, start = room
    copied = layout.save(block_ids, buffer.view(len(block_ids), layout.num_layers, layout.segment_bytes))
    view = byte_view(buffer)
    payloads = [BlockPayload(key, b"", view[i * size:(i + 1) * size], layout.num_layers,
                             None if ring is None else start + i * size) for i, key in enumerate(keys)]
    sender.submit(SaveBatch(payloads, len(buffer), ring, start, copied))
    return buffer


# ------------------------------------------------------------------ page-locked windows


def test_windows_are_page_locked_and_unregistered_before_they_are_unmapped() -> None:
    copier = CudaKVCopier(torch.device("cuda", torch.cuda.current_device()))
    window = ShmWindow(8 * MiB)
    assert not window.tensor.is_pinned(), "a fresh /dev/shm window is pageable"
    copier.page_lock(window)
    assert window.tensor.is_pinned() and window.tensor[5 * MiB:].is_pinned(), \
        "after page_lock, CUDA reports the whole window as page-locked host memory (cudaPointerGetAttributes)"
    copier.page_lock(window)  # once only: a second cudaHostRegister of the same memory would be refused
    view = window.tensor[:4096]  # keeps the mapping alive past close(), so that it can be asked about
    window.close()
    assert not view.is_pinned(), "close() unregistered the window from CUDA before unmapping it"

    dropped = ShmWindow(1 * MiB)
    dropped.unlink()  # as the client does once the service has attached it: nothing left in /dev/shm
    copier.page_lock(dropped)
    view = dropped.tensor[:4096]
    assert view.is_pinned()
    del dropped
    gc.collect()
    assert not view.is_pinned(), "a window collected without close() was unregistered from CUDA too"


def test_a_refused_registration_leaves_no_cuda_error_for_the_next_kernel() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    window = ShmWindow(1 * MiB)
    pointer = window.tensor.data_ptr()
    try:
        assert register_host_memory(pointer, window.size, device) is None, "cudaHostRegister of a window"
        refusal = register_host_memory(pointer, window.size, device)
        assert refusal is not None, "CUDA should refuse to register the same memory twice"
        try:
            total = (torch.ones(4, device=device) * 3).sum().item()
        except RuntimeError as error:
            pytest.fail(f"the refused registration ({refusal}) was left as this thread's CUDA error and "
                        f"surfaced in the next kernel launch: {error}")
        assert total == 12
    finally:
        assert unregister_host_memory(pointer, device) is None, "cudaHostUnregister of the window"
        window.close()


# ------------------------------------------------------------------ bytes, both ways


def test_blocks_round_trip_device_window_device_exactly_and_layer_by_layer(busy: _Busy) -> None:
    layout = _layout(64)
    copier = cast(CudaKVCopier, layout.copier)
    sources, targets = [3, 17, 5, 40, 8, 33, 21, 60], [10, 11, 12, 50, 51, 52, 2, 63]
    count, block_bytes = len(sources), layout.block_bytes
    source_index, target_index = _index(sources), _index(targets)
    expected = _block_bytes(layout, sources)  # by plain synchronous copies, for reference

    # Save: device -> page-locked ring window, with the side stream 100 ms behind.
    ring = ShmWindow(count * block_bytes)
    copier.page_lock(ring)
    assert ring.tensor.is_pinned(), "the save window is page-locked"
    out = ring.tensor[:count * block_bytes].view(count, layout.num_layers, layout.segment_bytes)
    layout.save(sources, out)  # warm-up: the allocators' caches then hold what the timed save needs
    torch.cuda.synchronize()
    out.zero_()
    busy.run(copier.stream, 100)
    started = time.perf_counter()
    copied = layout.save(sources, out)
    save_ms = 1e3 * (time.perf_counter() - started)
    assert isinstance(copied, torch.cuda.Event)
    pending = not copied.query()
    for layer in layout.layers:  # the next step reuses the blocks, on the compute stream
        layer.index_fill_(layout.block_dim, source_index, 0)
    copied.synchronize()
    print(f"save of {count} blocks: host returned in {save_ms:.2f} ms; device-to-host copy pending then: {pending}")
    assert pending, (f"the device-to-host copy was already done when save() returned after {save_ms:.2f} ms, "
                     f"with the side stream 100 ms behind: save() must have waited for the device")
    assert save_ms < 50, f"save() took {save_ms:.2f} ms on the host; it should only queue work"
    assert torch.equal(out, expected), ("the ring holds other bytes than the blocks had when the step ended "
                                        "(the gather must run in the compute stream's order, before the reuse)")

    # Load: window -> device, layer by layer, through LayerwiseLoad and a fake GetBlocks that stops
    # after two of the four layers.
    window = ShmWindow(count * block_bytes)
    window.window_id = 1
    client = _FakeLoadClient(window, expected, hold_at=2)
    for layer in layout.layers:
        layer.index_fill_(layout.block_dim, target_index, 1.5)
    before = [layer.clone() for layer in layout.layers]
    before_targets = [_layer_bytes(layout, i, target_index) for i in range(layout.num_layers)]
    load = LayerwiseLoad(layout, cast(KVBlockClient, client), [bytes([i]) * 32 for i in range(count)], targets)
    try:
        load.start()
        for index in range(2):
            load.wait_layer(index)
        assert client.held.wait(10), "the fake GetBlocks never reached layer 2"
        early = [_layer_bytes(layout, i, target_index) for i in range(layout.num_layers)]
        for index in range(2):
            assert torch.equal(early[index], expected[:, index]), \
                f"layer {index} of the targets, read on the compute stream after wait_layer, is not the loaded bytes"
        for index in range(2, layout.num_layers):
            assert torch.equal(early[index], before_targets[index]), \
                f"layer {index} of the target blocks changed before its bytes were delivered"
    finally:
        client.gate.set()
    for index in range(2, layout.num_layers):
        load.wait_layer(index)
    assert load.join(), "the load failed (CRC, size or stream error; see the log)"
    assert window.tensor.is_pinned(), "LayerwiseLoad page-locked its load window"
    loaded = _block_bytes(layout, targets)
    assert torch.equal(loaded, expected), "device -> window -> device did not round-trip exactly"
    untouched = torch.ones(64, dtype=torch.bool, device="cuda")
    untouched[target_index] = False
    for index, layer in enumerate(layout.layers):
        assert torch.equal(layer[:, untouched], before[index][:, untouched]), \
            f"layer {index}: a block that was not a load target changed"
    ring.close()
    window.close()


# ------------------------------------------------------------------ streams and events


def test_load_copies_overlap_compute_on_the_side_stream_and_the_host_never_waits(busy: _Busy) -> None:
    blocks = 2048  # 2048 blocks x 64 KiB x 4 layers = 512 MiB host-to-device
    layout = _layout(blocks + 8)
    copier = cast(CudaKVCopier, layout.copier)
    compute = torch.cuda.current_stream()
    assert copier.stream != compute, "the copier has its own stream"
    targets = list(range(4, 4 + blocks))
    target_index = _index(targets)
    per_layer = blocks * layout.segment_bytes
    source = copier.host_buffer(per_layer * layout.num_layers)  # segment-major, as a load stages it
    assert source.is_pinned(), "private staging is pinned"
    source.copy_(torch.randint(0, 256, (source.numel(),), dtype=torch.uint8, device="cuda"))

    def layer_source(index: int) -> torch.Tensor:
        return source[index * per_layer:(index + 1) * per_layer]

    warm = layout.load_copies(targets)  # fills the allocators' caches, so the timed pass allocates nothing new
    warm.begin()
    for index in range(layout.num_layers):
        warm.copy_layer(index, layer_source(index))
        warm.wait_layer(index)
    torch.cuda.synchronize()

    events = {name: torch.cuda.Event(enable_timing=True)
              for name in ("origin", "compute_start", "compute_end", "copy_start", "copy_end")}
    events["origin"].record(compute)
    torch.cuda.synchronize()
    copies = layout.load_copies(targets)
    copies.begin()  # start_load_kv, before the forward pass is queued
    events["compute_start"].record(compute)
    busy.run(compute, 300)  # the forward pass
    events["compute_end"].record(compute)
    events["copy_start"].record(copier.stream)  # from here on, what the load thread queues as layers arrive
    for index in range(layout.num_layers):
        copies.copy_layer(index, layer_source(index))
    events["copy_end"].record(copier.stream)
    started = time.perf_counter()
    for index in range(layout.num_layers):  # each attention layer's wait_for_layer_load
        copies.wait_layer(index)
    host_wait_ms = 1e3 * (time.perf_counter() - started)
    compute_still_running = not events["compute_end"].query()
    seen = [layer.index_select(layout.block_dim, target_index) for layer in layout.layers]  # compute stream
    torch.cuda.synchronize()

    at = {name: events["origin"].elapsed_time(event) for name, event in events.items() if name != "origin"}
    copy_ms = at["copy_end"] - at["copy_start"]
    timeline = (f"compute [{at['compute_start']:.2f}, {at['compute_end']:.2f}] ms, copies [{at['copy_start']:.2f}, "
                f"{at['copy_end']:.2f}] ms ({512 / max(copy_ms, 1e-3) * 1e3 / 1024:.1f} GiB/s), host time in "
                f"{layout.num_layers} wait_layer calls {host_wait_ms:.3f} ms")
    print(timeline)
    assert compute_still_running, ("the compute stream's 300 ms of matmuls had already finished when the host got "
                                   f"past the wait_layer calls: something made the host wait for the GPU; {timeline}")
    assert at["copy_start"] >= at["compute_start"] - 0.5 and at["copy_end"] <= at["compute_end"], \
        f"the copies did not run inside the compute interval (so not on a side stream, overlapping it): {timeline}"
    assert copy_ms > 0 and host_wait_ms < copy_ms / 4, \
        f"wait_layer blocked the host: it should only make the compute stream wait on an event; {timeline}"
    for index in range(layout.num_layers):
        got = seen[index].movedim(layout.block_dim, 0).contiguous().view(torch.uint8).reshape(blocks, -1)
        assert torch.equal(got.cpu(), layer_source(index).view(blocks, -1)), \
            f"layer {index} as the compute stream read it after wait_layer is not the loaded bytes"


def test_the_compute_stream_waits_for_a_layer_copy_still_queued(busy: _Busy) -> None:
    layout = _layout(64)
    copier = cast(CudaKVCopier, layout.copier)
    targets = [1, 2, 3, 4]
    target_index = _index(targets)
    per_layer = len(targets) * layout.segment_bytes
    source = copier.host_buffer(per_layer)
    source.copy_(torch.randint(0, 256, (per_layer,), dtype=torch.uint8))
    layout.layers[0].index_fill_(layout.block_dim, target_index, 0)
    torch.cuda.synchronize()
    copies = layout.load_copies(targets)
    copies.begin()
    busy.run(copier.stream, 200)  # the side stream is 200 ms behind: layer 0's copy is queued, not done
    copies.copy_layer(0, source)
    started = time.perf_counter()
    copies.wait_layer(0)
    host_ms = 1e3 * (time.perf_counter() - started)
    seen = layout.layers[0].index_select(layout.block_dim, target_index)
    read = torch.cuda.Event()
    read.record()
    read_waiting = not read.query()
    torch.cuda.synchronize()
    print(f"wait_layer(0) returned after {host_ms:.3f} ms; the compute stream's read was still waiting: {read_waiting}")
    assert host_ms < 50, f"wait_layer(0) took {host_ms:.3f} ms on the host, with the copy 200 ms away: it waited"
    assert read_waiting, "the compute stream's read of layer 0 did not wait for the side stream's queued copy"
    got = seen.movedim(layout.block_dim, 0).contiguous().view(torch.uint8).reshape(-1).cpu()
    assert torch.equal(got, source), "the compute stream read layer 0 before its copy landed"


def test_a_load_cancelled_past_its_deadline_writes_nothing_after(busy: _Busy) -> None:
    layout = _layout(64)
    copier = cast(CudaKVCopier, layout.copier)
    targets = [20, 21, 22, 23]
    target_index = _index(targets)
    count = len(targets)
    blocks = torch.randint(0, 256, (count, layout.num_layers, layout.segment_bytes), dtype=torch.uint8)
    window = ShmWindow(count * layout.block_bytes)
    window.window_id = 1
    client = _FakeLoadClient(window, blocks, hold_at=2)
    for layer in layout.layers:
        layer.index_fill_(layout.block_dim, target_index, 0)
    torch.cuda.synchronize()
    busy.run(copier.stream, 800)  # layers 0 and 1 get queued behind this, so they are not done at the deadline
    load = LayerwiseLoad(layout, cast(KVBlockClient, client), [bytes([i]) * 32 for i in range(count)], targets)
    load.timeout = 0.2
    try:
        load.start()
        assert client.held.wait(10), "the fake GetBlocks never reached layer 2"
        assert not load.join(), "a load past its deadline reports failure"
        # What vLLM does with blocks of a failed load: hands them on, or recomputes them (compute stream).
        for layer in layout.layers:
            layer.index_fill_(layout.block_dim, target_index, 7.0)
    finally:
        client.gate.set()  # the rest of the bytes arrive after the cancellation
    load.thread.join(10)
    assert not load.thread.is_alive()
    assert client.delivered_after_hold >= 1, "the fake delivered a layer after the cancellation"
    torch.cuda.synchronize()
    for index, layer in enumerate(layout.layers):
        values = layer.index_select(layout.block_dim, target_index)
        assert bool((values == 7.0).all()), (
            f"layer {index} of the cancelled load's blocks does not hold what the compute stream wrote after "
            f"join(): a copy landed after the cancellation ({'queued before it' if index < 2 else 'made after it'})")
    window.close()


def test_the_sender_reads_a_save_only_after_its_device_copy(busy: _Busy) -> None:
    layout = _layout(64)
    copier = cast(CudaKVCopier, layout.copier)
    client = _FakeSaveClient()
    sender = Sender(cast(KVBlockClient, client), ring_bytes=4 * MiB, copier=copier)
    try:
        assert client.windows == [], ("on a CUDA device the ring is attached at the first save, not when the "
                                      "sender starts (vLLM captures CUDA graphs then)")
        first, second = [1, 2, 3], [4, 5, 6, 7]
        keys = [bytes([i]) * 32 for i in range(len(first) + len(second))]
        expected = _block_bytes(layout, first + second)
        crcs = {key: zlib.crc32(expected[i].numpy().tobytes()) for i, key in enumerate(keys)}
        buffer = _save_step(sender, layout, first, keys[:len(first)])
        assert buffer.is_pinned(), "a save before the ring is attached goes through pinned private memory"
        deadline = time.monotonic() + 10
        while sender.ring is None and time.monotonic() < deadline:
            time.sleep(0.01)
        ring = sender.ring
        assert ring is not None, "the first save did not get the ring attached"
        assert ring.window.tensor.is_pinned(), "the save ring is page-locked"
        ring_view = ring.window.tensor[:4096]
        saved_index = _index(first + second)
        busy.run(copier.stream, 200)  # the device-to-host copy of the second save waits behind this
        _save_step(sender, layout, second, keys[len(first):])
        for layer in layout.layers:  # the next step reuses the blocks
            layer.index_fill_(layout.block_dim, saved_index, 0)
        put = [client.puts.get(timeout=10), client.puts.get(timeout=10)]
        assert all(offset is None for _, _, offset in put[0]), "the first save went as bytes"
        assert all(offset is not None for _, _, offset in put[1]), "the second save went through the ring"
        for key, crc, _ in put[0] + put[1]:
            assert crc == crcs[key], (f"block {key[0]}: the sender read other bytes than the block's (CRC "
                                      f"{crc:#x}, expected {crcs[key]:#x}): it did not wait for the device copy")
    finally:
        sender.stop()
    assert not ring_view.is_pinned(), "stop() detached the ring and unregistered it from CUDA"
