"""Where block bytes cross between the paged KV cache and host memory.

On the CPU (and any device without a CUDA side path) these are plain tensor copies on the calling
thread: a load's load thread, a save's engine thread (`KVCopier`).

On a CUDA device (`CudaKVCopier`) neither direction may hold up the engine's thread or the forward pass:
- Host staging is page-locked: a copy to or from pageable memory is synchronous, and CUDA stages it
  through a bounce buffer. Shared-memory windows are registered with CUDA (cudaHostRegister) before
  their first copy and unregistered before they are unmapped; private buffers come from torch's pinned
  allocator, which also keeps one from being reused while a copy still reads it.
- Loads run on the connector's side stream, which first waits for everything the compute stream had
  queued when the load began: vLLM may hand a load blocks that work still in flight uses (a request
  that finished in a step the GPU has not finished yet; vLLM zeroing new blocks). Each layer's bytes go
  host-to-device and into the paged cache (index_copy_) on that stream, then its event is recorded;
  wait_for_layer_load makes the compute stream wait on the event, the host never waits for the copy.
- Saves gather the blocks on the compute stream into a device staging tensor, in order after the pass
  that wrote them and before any later step can reuse them (a device-side copy, cheap); the
  device-to-host copy into the ring or private buffer runs on the side stream, and the sender thread
  waits on its event before it computes CRCs and sends.

This module needs only torch, so that the transfer code stays importable without vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from .window import ShmWindow

if TYPE_CHECKING:
    from .transfer import KVLayout

logger = logging.getLogger("taco_llm.kv_offload")

# cudaHostRegisterPortable: page-locked for every CUDA context of the process, not only the one current
# on the registering thread (a load or sender thread starts on device 0, the worker's device may differ).
HOST_REGISTER_PORTABLE = 1


class CopyDone(Protocol):
    """What a save's reader waits on before it reads the host bytes (a CUDA event)."""

    def synchronize(self) -> None: ...


class LoadCopies:
    """One load's copies into the KV cache, layer by layer; here synchronous, on the load thread."""

    def __init__(self, layout: KVLayout, block_ids: Sequence[int]):
        self.layout = layout
        self.block_ids = list(block_ids)
        self._index: torch.Tensor | None = None

    def begin(self) -> None:
        """Engine thread, before the load's thread starts."""

    def copy_layer(self, index: int, source: torch.Tensor) -> None:
        """Load thread: writes layer `index` of the blocks from `source` ([blocks, segment bytes] uint8)."""
        self.layout.scatter_layer(index, self._block_index(), source)

    def wait_layer(self, index: int) -> None:
        """Engine thread, once the load thread is past copy_layer(index): the forward pass may read it."""

    def settle(self) -> None:
        """Engine thread, once no copy_layer can start any more (the load finished or was cancelled):
        whatever the engine does next comes after every copy made."""

    def _block_index(self) -> torch.Tensor:
        if self._index is None:  # made on the thread that copies (for CUDA: in its stream's order)
            self._index = self.layout.block_index(self.block_ids)
        return self._index


class KVCopier:
    """Plain tensor copies on the calling thread."""

    # Whether host memory is page-locked before copies use it (a CUDA runtime call, see Sender).
    pins_host_memory = False

    def host_buffer(self, size: int) -> torch.Tensor:
        """Private staging of `size` bytes."""
        return torch.empty(size, dtype=torch.uint8)

    def indices(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=device)

    def page_lock(self, window: ShmWindow) -> None:
        """Makes a window ready for copies, once; any thread."""

    def load_copies(self, layout: KVLayout, block_ids: Sequence[int]) -> LoadCopies:
        return LoadCopies(layout, block_ids)

    def save(self, layout: KVLayout, block_ids: Sequence[int], out: torch.Tensor) -> CopyDone | None:
        """Engine thread: copies the blocks into host `out` ([blocks, layers, segment bytes] uint8);
        returns what to wait on before reading `out`, or None when it is ready now."""
        layout.gather(block_ids, out)
        return None

    def wait_host_reads(self) -> None:
        """Load thread, before a load window is reused or replaced: returns once no copy of an earlier
        load still reads host staging."""

    def synchronize(self) -> None:
        """Returns once every copy started is done (before windows are unmapped at shutdown)."""


class CudaKVCopier(KVCopier):
    """Copies between a CUDA KV cache and page-locked host memory on one side stream."""

    pins_host_memory = True

    def __init__(self, device: torch.device):
        self.device = device
        # High priority: the forward pass waits on the load copies layer by layer, so their small scatter
        # kernels should not queue behind its big ones. (torch's pool streams never wait on the legacy
        # default stream implicitly, which is what lets them overlap it.)
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self._lock = threading.Lock()
        # Windows whose page-locking was tried (whether or not CUDA agreed), so that it is tried once.
        self._tried: weakref.WeakSet[ShmWindow] = weakref.WeakSet()
        self._refused_logged = False
        self._last_load_copy: torch.cuda.Event | None = None

    def compute_stream(self) -> torch.cuda.Stream:
        """The calling thread's current stream: on the engine's thread, the one the forward pass uses."""
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def on_side_stream(self) -> Iterator[torch.cuda.Stream]:
        # Load and sender threads start on device 0 and its default stream.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield self.stream

    def host_buffer(self, size: int) -> torch.Tensor:
        with torch.cuda.device(self.device):
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def indices(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        # Through pinned memory: a copy from pageable memory makes the host wait until the stream reaches it,
        # and the streams here are busy with a forward pass or queued behind one.
        host = torch.tensor(list(block_ids), dtype=torch.long).pin_memory()
        return host.to(device, non_blocking=True)

    def page_lock(self, window: ShmWindow) -> None:
        with self._lock:
            if window in self._tried:
                return
            self._tried.add(window)
        pointer = window.tensor.data_ptr()
        error = register_host_memory(pointer, window.size, self.device)
        if error is not None:
            # Still correct, only slower: CUDA copies through pageable memory synchronously.
            if not self._refused_logged:
                self._refused_logged = True
                logger.warning("prefix-KV offload: CUDA would not page-lock a %d-byte shared-memory window (%s); "
                               "copies through such windows are synchronous", window.size, error)
            return
        window.before_unmap(_Unregister(pointer, self.device))

    def load_copies(self, layout: KVLayout, block_ids: Sequence[int]) -> LoadCopies:
        return _CudaLoadCopies(self, layout, block_ids)

    def save(self, layout: KVLayout, block_ids: Sequence[int], out: torch.Tensor) -> CopyDone:
        staging = torch.empty(out.shape, dtype=torch.uint8, device=self.device)
        layout.gather(block_ids, staging)  # on the compute stream: see the module's docstring
        self.stream.wait_stream(self.compute_stream())
        copied = torch.cuda.Event(blocking=True)  # the sender thread sleeps on it rather than spinning
        with self.on_side_stream() as stream:
            out.copy_(staging, non_blocking=True)
            copied.record(stream)
        # Allocated on the compute stream: without this, a later compute-stream allocation could take its
        # memory while the side stream still copies out of it.
        staging.record_stream(self.stream)
        return copied

    def note_load_copy(self, copied: torch.cuda.Event) -> None:
        with self._lock:
            self._last_load_copy = copied

    def wait_host_reads(self) -> None:
        # The side stream runs in order: its latest load copy done means all of them are.
        with self._lock:
            last = self._last_load_copy
        if last is not None:
            last.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()


class _CudaLoadCopies(LoadCopies):
    def __init__(self, copier: CudaKVCopier, layout: KVLayout, block_ids: Sequence[int]):
        super().__init__(layout, block_ids)
        self.copier = copier
        # Blocking: a host thread that waits on one (wait_host_reads) sleeps rather than spins.
        self.events = [torch.cuda.Event(blocking=True) for _ in range(layout.num_layers)]
        # Layers whose copy is queued. The engine thread waits only on those: an event is recorded on the
        # load thread, and a wait on one not recorded yet would be a silent no-op anyway.
        self.queued = 0

    def begin(self) -> None:
        self.copier.stream.wait_stream(self.copier.compute_stream())

    def copy_layer(self, index: int, source: torch.Tensor) -> None:
        with self.copier.on_side_stream() as stream:
            # One contiguous DMA from page-locked memory, then the scatter into the paged cache on the device.
            # Allocated and used on the side stream only, so it may be freed as soon as it is queued.
            staged = torch.empty(source.numel(), dtype=torch.uint8, device=self.copier.device)
            staged.copy_(source, non_blocking=True)
            self.layout.scatter_layer(index, self._block_index(), staged)
            self.events[index].record(stream)
        self.queued = index + 1
        self.copier.note_load_copy(self.events[index])

    def wait_layer(self, index: int) -> None:
        if index < self.queued:
            self.copier.compute_stream().wait_event(self.events[index])

    def settle(self) -> None:
        if self.queued:
            self.copier.compute_stream().wait_event(self.events[self.queued - 1])


def copier_for(device: torch.device) -> KVCopier:
    """The copier for a KV cache on `device`; each call makes its own (a CUDA one has its own stream)."""
    return CudaKVCopier(device) if device.type == "cuda" else KVCopier()


def register_host_memory(pointer: int, size: int, device: torch.device) -> str | None:
    """Page-locks [pointer, pointer + size) for CUDA: None when done, else CUDA's reason."""
    return _runtime_call(device, "cudaHostRegister", pointer, size, HOST_REGISTER_PORTABLE)


def unregister_host_memory(pointer: int, device: torch.device) -> str | None:
    """Ends a registration made by register_host_memory: None when done, else CUDA's reason."""
    return _runtime_call(device, "cudaHostUnregister", pointer)


def _runtime_call(device: torch.device, name: str, *args: int) -> str | None:
    """Calls the CUDA runtime function `name` on `device`: None on success, else CUDA's reason, with the
    failure cleared so that it does not surface later as another launch's."""
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        error = getattr(cudart, name)(*args)
        if error == cudart.cudaError.success:
            return None
        _forget_last_error(device)
    return str(cudart.cudaGetErrorString(error))


def _forget_last_error(device: torch.device) -> None:
    """A failed runtime call stays the thread's last error until something reads it, and torch reads it
    after its next kernel launch on this thread, as that launch's own failure. torch.cuda.cudart() has no
    cudaGetLastError: one tiny launch reads it here instead."""
    with contextlib.suppress(RuntimeError):
        torch.ones(1, device=device)


class _Unregister:
    """A window's release (ShmWindow.before_unmap): may run from the garbage collector, so it never raises."""

    def __init__(self, pointer: int, device: torch.device):
        self.pointer = pointer
        self.device = device

    def __call__(self) -> None:
        try:
            error = unregister_host_memory(self.pointer, self.device)
        except Exception as exception:  # CUDA torn down, or any other fault: the process's pages go anyway
            error = str(exception)
        if error is not None:
            logger.warning("prefix-KV offload: unregistering a shared-memory window from CUDA failed (%s)", error)
