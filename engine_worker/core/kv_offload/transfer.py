"""Moving block bytes between vLLM's paged KV cache and the cache service, off the engine's thread.

A block's bytes are its layers' slices one after another (segment = layer). Both directions stage
them in one flat uint8 buffer: a load in segment-major order ([layers, blocks, segment], as
GetBlocks delivers them, so each finished layer is copied into the KV cache at once), a save in
block-major order ([blocks, layers, segment], so each block is one contiguous range for PutBlocks).
The buffer is a shared-memory window when the service shares /dev/shm with us, else private memory
whose bytes then travel in gRPC messages. How bytes cross between the KV cache's device and that
buffer (page-locked memory, a side stream and events on a CUDA device) is device_copy.py's business.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from taco_llm.protos import kv_cache_pb2

from .client import BlockPayload, ChunkStream, KVBlockClient, window_gone
from .device_copy import CopyDone, KVCopier, LoadCopies, copier_for
from .window import SaveRing, ShmWindow

logger = logging.getLogger("taco_llm.kv_offload")

# The engine's step waits on a load only while the load makes progress: once it has waited
# LOAD_STALL_SECONDS and nothing happened meanwhile (no message from the cache service, no layer copied),
# or the load ran past its whole deadline, the step gives up on it and vLLM recomputes its blocks. A
# healthy service sends a message per layer within milliseconds (its blocks are in memory); a frozen or
# cut-off one sends nothing, and every request in the batch waits with the step. 2 s is far above any
# healthy gap, even on loaded CPUs, and is the gateway's keepalive interval (protos/engine_limits.py).
LOAD_STALL_SECONDS = 2.0
LOAD_TIMEOUT_SECONDS = 10.0   # base deadline of one step's whole load
LOAD_SECONDS_PER_GIB = 10.0   # plus this much per GiB loaded (far below what the service delivers)
SAVE_TIMEOUT_SECONDS = 30.0   # on the sender's thread, never the engine's: a stalled save only holds its room
# Saves whose bytes wait in private memory (gRPC transport) are capped; beyond it new saves are
# dropped (they are only a future cache miss), so a slow service cannot grow the worker's memory.
MAX_PENDING_SAVE_BYTES = 512 * 1024**2
# The shared-memory save ring: the same cap, in a window. A save larger than the whole ring goes
# through private memory as gRPC bytes.
SAVE_RING_BYTES = 256 * 1024**2


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a flat uint8 CPU tensor, shared (no copy)."""
    array: Any = tensor.numpy()
    return memoryview(array)


@dataclass
class KVLayout:
    """The paged KV cache of one worker: one tensor per layer, blocks along `block_dim`."""

    layers: list[torch.Tensor]
    block_dim: int
    # One per layout, so one per connector: on a CUDA device, the connector's side stream.
    copier: KVCopier = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.copier = copier_for(self.layers[0].device)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # Cached: the layers never change once registered, and these are read per layer on the engine's
    # thread (gather, scatter) and per chunk on the load thread.
    @functools.cached_property
    def segment_shape(self) -> torch.Size:
        return self.layers[0].select(self.block_dim, 0).shape

    @functools.cached_property
    def segment_bytes(self) -> int:
        return self.layers[0].select(self.block_dim, 0).numel() * self.layers[0].element_size()

    @functools.cached_property
    def block_bytes(self) -> int:
        return self.segment_bytes * self.num_layers

    def block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self.copier.indices(block_ids, self.layers[0].device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copies the blocks into `out` ([blocks, layers, segment bytes], uint8): one copy per layer,
        straight from the KV cache into place."""
        ids = self.block_index(block_ids)
        for index, layer in enumerate(self.layers):
            target = out[:, index, :].view(layer.dtype).view(len(ids), *self.segment_shape)
            target = target.movedim(0, self.block_dim)
            if layer.device == out.device:
                torch.index_select(layer, self.block_dim, ids, out=target)
            else:  # a device KV cache: one device-to-host copy of the gathered blocks
                target.copy_(layer.index_select(self.block_dim, ids))

    def save(self, block_ids: Sequence[int], out: torch.Tensor) -> CopyDone | None:
        """Copies the blocks into host `out` ([blocks, layers, segment bytes], uint8) without waiting for a
        device; returns what to wait on before reading `out` (None: it is ready)."""
        return self.copier.save(self, block_ids, out)

    def load_copies(self, block_ids: Sequence[int]) -> LoadCopies:
        """The layer-by-layer copies of one load into the blocks."""
        return self.copier.load_copies(self, block_ids)

    def scatter_layer(self, index: int, block_ids: torch.Tensor, source: torch.Tensor) -> None:
        """Writes layer `index` of the blocks from `source` ([blocks, segment bytes], uint8)."""
        layer = self.layers[index]
        values = source.view(layer.dtype).view(len(block_ids), *self.segment_shape).movedim(0, self.block_dim)
        layer.index_copy_(self.block_dim, block_ids, values.to(layer.device))


class LayerwiseLoad:
    """One step's GetBlocks, written into the KV cache layer by layer as the bytes arrive.

    The engine's thread waits on it (wait_layer, join) only while it makes progress and within its deadline
    (LOAD_STALL_SECONDS says why); past either it gives the load up: the load is cancelled, writes nothing
    more into the KV cache, and counts as failed, so that vLLM recomputes its blocks."""

    def __init__(self, layout: KVLayout, client: KVBlockClient, keys: list[bytes], block_ids: list[int],
                 *, stall_seconds: float = LOAD_STALL_SECONDS):
        self.layout = layout
        self.client = client
        self.keys = keys
        self.block_ids = block_ids
        self.num_layers = layout.num_layers
        self.events = [threading.Event() for _ in range(self.num_layers)]
        self.finished = threading.Event()  # the load's thread is done (whether it loaded or not)
        self.layers_done = 0
        self.ok = False
        self.cancelled = False
        self.call: ChunkStream | None = None
        self.window: ShmWindow | None = None
        self.copies = layout.load_copies(block_ids)
        # Held while checking `cancelled` and queuing one layer's copy: once the engine has given the load
        # up, no copy into the KV cache starts.
        self.lock = threading.Lock()
        self.size = layout.block_bytes * len(keys)
        self.timeout = LOAD_TIMEOUT_SECONDS + LOAD_SECONDS_PER_GIB * self.size / 1024**3
        self.stall_seconds = stall_seconds
        self.deadline = 0.0
        self.progress_at = 0.0  # when the load's thread last got anything done (a float: read without a lock)
        self.given_up = False  # by the engine's thread
        self.thread = threading.Thread(target=self._run, name="kv-offload-load", daemon=True)

    def start(self) -> None:
        """On the engine's thread, before the forward pass."""
        self.progress_at = time.monotonic()
        self.deadline = self.progress_at + self.timeout
        self.copies.begin()
        self.thread.start()

    def _progressed(self) -> None:
        self.progress_at = time.monotonic()

    def _wait(self, event: threading.Event) -> bool:
        """Engine thread: waits for `event` while the load progresses; False once this wait has seen no progress
        for stall_seconds, or the load ran out of time."""
        waiting_since = time.monotonic()
        while not event.is_set():
            stalled_at = max(self.progress_at, waiting_since) + self.stall_seconds
            remaining = min(self.deadline, stalled_at) - time.monotonic()
            if remaining <= 0:
                return False
            event.wait(remaining)
        return True

    def wait_layer(self, index: int) -> None:
        """On the engine's thread: returns once layer `index` is in the KV cache as the forward pass sees it
        (on a CUDA device: its copy is queued and the compute stream waits for it), or once the load is given
        up (then join() reports it failed, and vLLM discards this pass's output for its requests)."""
        if self.given_up:
            return
        if not self._wait(self.events[index]):
            self._give_up()
            return
        self.copies.wait_layer(index)

    def join(self) -> bool:
        """On the engine's thread, after the forward pass (or before it, loading not lazily): whether every
        block is in the KV cache. Waits no longer than wait_layer would."""
        if not self.given_up and not self._wait(self.finished):
            self._give_up()
        self.copies.settle()  # copies already queued land before anything the engine does next
        return not self.given_up and self.ok

    def _give_up(self) -> None:
        with self.lock:  # from here on the load's thread copies nothing into blocks vLLM may reuse
            self.given_up = self.cancelled = True
        stalled = time.monotonic() < self.deadline
        if self.window is not None:
            # The service may still write into this window once it is back: the next load takes a fresh one.
            self.window.stale = True
        call = self.call
        if call is not None:
            call.cancel()
        why = (f"no progress for {self.stall_seconds:.1f}s" if stalled
               else f"not done within its {self.timeout:.0f}s deadline")
        logger.warning("prefix-KV offload: loading %d blocks from cache service %s stalled (%s); recomputing them",
                       len(self.keys), self.client.backoff.address, why)
        # The next steps should not wait on that service too: loads and saves skip it for a while.
        self.client.backoff.failed("GetBlocks", TimeoutError(why), logged=True)

    def _run(self) -> None:
        try:
            self.ok = self._receive()
            if self.ok:
                self.client.backoff.succeeded()
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:  # evicted since the Lookup: the service is fine
                logger.warning("prefix-KV offload: %s; recomputing %d blocks", error.details(), len(self.keys))
            elif error.code() != grpc.StatusCode.CANCELLED or not self.cancelled:
                # A load in flight always gets its line: it is a request's blocks being recomputed.
                logger.warning("prefix-KV offload: loading %d blocks failed (%s); recomputing them",
                               len(self.keys), error.code().name)
                self.client.backoff.failed("GetBlocks", error, logged=True)
        except Exception as error:  # any other fault: the blocks are recomputed, never a failed request
            logger.warning("prefix-KV offload: loading %d blocks failed (%s); recomputing them",
                           len(self.keys), error)
        finally:
            for event in self.events:
                event.set()
            self.finished.set()

    def _receive(self) -> bool:
        if not self.client.backoff.ready():
            # The service failed moments ago (a stall, an error): recompute rather than wait on it again.
            return False
        copier = self.layout.copier
        # The load window is reused load after load (and replaced, unmapped, when too small): the service
        # must not write into it while an earlier load's copies may still read it.
        copier.wait_host_reads()
        for attempt in range(2):
            with self.client.load_window(self.size) as window:
                if window is None:
                    break
                self.window = window
                copier.page_lock(window)
                self._progressed()  # making and attaching a window is done; the bytes are due now
                try:
                    return self._receive_into(window.tensor[:self.size], window)
                except grpc.RpcError as error:
                    if attempt or self.layers_done or not window_gone(error):
                        raise
                    window.stale = True  # the service restarted: the next try attaches a fresh window
        return self._receive_into(copier.host_buffer(self.size), None)

    def _receive_into(self, staged: torch.Tensor, window: ShmWindow | None) -> bool:
        """Streams the blocks into `staged` (segment-major), copying each layer out once complete."""
        ref = None if window is None else kv_cache_pb2.WindowRef(window_id=window.window_id, offset=0,
                                                                 length=self.size)
        remaining = max(0.001, self.deadline - time.monotonic())
        call = self.call = self.client.get_stream(self.keys, remaining, ref)
        if self.cancelled:
            call.cancel()
        first = next(call)
        self._progressed()
        if first.WhichOneof("kind") != "headers":
            raise ValueError(f"GetBlocks began with {first.WhichOneof('kind') or 'an empty message'}, not the "
                             "blocks' headers")
        headers = first.headers.blocks
        block_bytes = self.layout.block_bytes
        if len(headers) != len(self.keys) or any(
                h.size != block_bytes or h.num_segments != self.num_layers for h in headers):
            raise ValueError("a block's size or segment count does not match this engine's KV layout")
        view = byte_view(staged)
        per_segment = self.layout.segment_bytes * len(self.keys)
        received = 0
        # Into a window the service sends only progress; without one, only bytes.
        expected = "block_bytes" if window is None else "segments_in_window"
        for message in call:
            self._progressed()
            kind = message.WhichOneof("kind")
            if kind != expected:
                raise ValueError(f"GetBlocks sent {kind or 'an empty message'} where {expected} was due")
            if kind == "segments_in_window":
                if not self.layers_done <= message.segments_in_window <= self.num_layers:
                    raise ValueError(f"a progress message says {message.segments_in_window} segments")
                ready = message.segments_in_window
            else:
                received += self._place(view, message.block_bytes)
                ready = min(received // per_segment, self.num_layers)
            while self.layers_done < ready:
                start = self.layers_done * per_segment
                with self.lock:
                    if self.cancelled:
                        return False
                    self.copies.copy_layer(self.layers_done, staged[start:start + per_segment])
                self.events[self.layers_done].set()
                self.layers_done += 1
                self._progressed()
        if self.layers_done != self.num_layers:
            raise ValueError(f"the stream ended after {self.layers_done} of {self.num_layers} layers")
        return self._checksums_match(view, [h.checksum for h in headers])

    def _place(self, view: memoryview, chunk: kv_cache_pb2.BlockBytes) -> int:
        """Copies one gRPC chunk (bytes of one block at an offset) to its segment-major place."""
        segment_bytes, count = self.layout.segment_bytes, len(self.keys)
        data = memoryview(chunk.data)
        if chunk.block_index >= count or chunk.offset + len(data) > self.layout.block_bytes:
            raise ValueError("a chunk lies outside its block")
        offset = chunk.offset
        while data:
            segment, within = divmod(offset, segment_bytes)
            take = min(len(data), segment_bytes - within)
            at = (segment * count + chunk.block_index) * segment_bytes + within
            view[at:at + take] = data[:take]
            data, offset = data[take:], offset + take
        return len(chunk.data)

    def _checksums_match(self, view: memoryview, checksums: Sequence[int]) -> bool:
        segment_bytes, count = self.layout.segment_bytes, len(self.keys)
        for index, expected in enumerate(checksums):
            crc = 0
            for segment in range(self.num_layers):
                at = (segment * count + index) * segment_bytes
                crc = zlib.crc32(view[at:at + segment_bytes], crc)
            if crc != expected:
                raise ValueError(f"block {self.keys[index].hex()[:16]}... failed its checksum")
            self._progressed()  # checksums of a large load take a while; the engine must not give up on them
        return True


@dataclass
class SaveBatch:
    """One step's saved blocks; their bytes lie in `ring` from `start` on, or in private memory, once
    `copied` is done (None: they are there already)."""

    payloads: list[BlockPayload]
    size: int
    ring: SaveRing | None = None
    start: int = 0
    copied: CopyDone | None = None


class Sender:
    """Sends saved blocks to the service on its own thread, off the engine's critical path."""

    _ATTACH = "attach"  # a queue item: attach a save ring

    def __init__(self, client: KVBlockClient, *, copier: KVCopier, ring_bytes: int = SAVE_RING_BYTES):
        self.client = client
        self.ring_bytes = ring_bytes
        self.copier = copier
        self.ring: SaveRing | None = None
        self._attach_queued = False
        self.queue: queue.Queue[SaveBatch | str | None] = queue.Queue()
        self.pending_bytes = 0
        self.lock = threading.Lock()
        self.dropped_logged = False
        self.thread = threading.Thread(target=self._run, name="kv-offload-save", daemon=True)
        self.thread.start()
        # Attach the ring now, so that the first saves already use it; but not one to page-lock for a
        # device: vLLM captures CUDA graphs right after it registers the KV caches, and a runtime call
        # from another thread may break a capture. Then the first save asks for the ring (reserve).
        if client.shared_memory and not self.copier.pins_host_memory:
            self._attach_queued = True
            self.queue.put(self._ATTACH)

    def reserve(self, size: int) -> tuple[torch.Tensor, SaveRing | None, int] | None:
        """Room for `size` bytes of saves: (flat uint8 buffer, its ring or None, start in the ring),
        or None when the service is behind or down (the save is dropped; a future miss, never a stall)."""
        if not self.client.backoff.ready():
            self._dropped()
            return None
        ring = self.ring
        if ring is not None and ring.window.stale:
            self.ring = ring = None
        if ring is None and self.client.shared_memory and not self._attach_queued:
            self._attach_queued = True
            self.queue.put(self._ATTACH)
        if ring is not None and size <= ring.size:
            start = ring.allocate(size)
            if start is None:
                self._dropped()
                return None
            return ring.window.tensor[start:start + size], ring, start
        with self.lock:
            if self.pending_bytes + size > MAX_PENDING_SAVE_BYTES:
                self._dropped()
                return None
            self.pending_bytes += size
        return self.copier.host_buffer(size), None, 0

    def _dropped(self) -> None:
        if not self.dropped_logged:
            logger.warning("prefix-KV offload: the cache service is behind or down; dropping saves "
                           "(those blocks will be recomputed when needed)")
            self.dropped_logged = True

    def submit(self, batch: SaveBatch) -> None:
        self.queue.put(batch)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if isinstance(item, str):
                self._attach_ring()
                continue
            try:
                if item.copied is not None:
                    item.copied.synchronize()  # the bytes are in host memory from here on
                window = item.ring.window if item.ring is not None else None
                if self.client.put(item.payloads, SAVE_TIMEOUT_SECONDS, window) is not None:
                    self.dropped_logged = False
            except Exception as error:  # never let a fault end the thread: later saves still go
                logger.warning("prefix-KV offload: saving %d blocks failed (%s)", len(item.payloads), error)
            finally:
                if item.ring is not None:
                    item.ring.free(item.start)
                else:
                    with self.lock:
                        self.pending_bytes -= item.size

    def _attach_ring(self) -> None:
        self._attach_queued = False
        if self.ring is None and self.client.shared_memory:
            window = self.client.attach(self.ring_bytes)
            if window is not None:
                self.copier.page_lock(window)
                self.ring = SaveRing(window)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(5.0)
        self.copier.synchronize()  # no copy into the ring may be left when it is unmapped
        ring, self.ring = self.ring, None
        if ring is not None:
            self.client.detach(ring.window)
