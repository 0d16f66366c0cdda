"""Shared-memory windows the worker owns, for block bytes to and from a cache service on the same host.

A window is a file in /dev/shm that this process creates, maps, and has the cache service attach
(AttachWindow); then it unlinks the file at once, so nothing is left in /dev/shm whatever crashes
later: the two processes' open mappings keep the memory. The memory is reserved when the window is
made (posix_fallocate): a /dev/shm too small for it (docker's default is 64 MB) is an error here, on
creation, never a SIGBUS on some later write.

The save ring hands out byte ranges of one window in FIFO order: wait_for_save copies a step's
blocks into a range (on a CUDA device through the side stream, device_copy.py), and the sender
thread frees it once PutBlocks has returned (the service copies the bytes out before it answers).

For a CUDA KV cache a window is page-locked (registered with CUDA) before its first copy; a
registration must end while its memory is still mapped, so the window runs its `before_unmap`
releases on close, or when it is collected without one.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from taco_llm.protos.kv_cache_limits import NONCE_BYTES, SHM_DIR, window_name


class ShmWindow:
    """A mapped /dev/shm file: `tensor` is its bytes, `window_id` what the service calls it."""

    def __init__(self, size: int, shm_dir: str = SHM_DIR):
        self.name = window_name(os.getpid(), secrets.token_hex(8))
        self.path = os.path.join(shm_dir, self.name)
        self.size = size
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.window_id = 0
        # Set when the service no longer knows window_id (it restarted, or dropped the window).
        self.stale = False
        self._before_unmap: list[weakref.finalize] = []
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # a file system without fallocate: sparse, as good as we can do
            self._map = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)  # the mapping keeps the memory
        self._map[:NONCE_BYTES] = self.nonce
        # Through a memoryview, which holds an export of the mapping: while any tensor view of it lives,
        # mmap.close() refuses (BufferError) instead of unmapping memory a view still points at.
        self.tensor = torch.frombuffer(memoryview(self._map), dtype=torch.uint8)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def before_unmap(self, release: Callable[[], None]) -> None:
        """Runs `release` once, on close() or when this window is collected without one: in both cases
        before the mapping goes (a tensor view may keep it longer, never shorter)."""
        finalizer = weakref.finalize(self, release)
        finalizer.atexit = False  # at exit the pages go with the process, and CUDA may be gone already
        self._before_unmap.append(finalizer)

    def close(self) -> None:
        """Unmaps now, or (while a view of it is still alive) once the last view is gone."""
        self.unlink()
        for finalizer in self._before_unmap:
            finalizer()
        self._before_unmap.clear()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):
            self._map.close()


@dataclass
class _Range:
    start: int
    end: int
    freed: bool = False


class SaveRing:
    """FIFO byte ranges of one window, allocated at the head and freed at the tail; thread-safe."""

    def __init__(self, window: ShmWindow):
        self.window = window
        self.size = window.size
        self._lock = threading.Lock()
        self._live: deque[_Range] = deque()  # oldest first

    def allocate(self, length: int) -> int | None:
        """The start of a free range of `length` bytes, or None while the ring is too full."""
        if not 0 < length <= self.size:
            return None
        with self._lock:
            if not self._live:
                start: int | None = 0
            else:
                first, last = self._live[0].start, self._live[-1].end
                if self._live[-1].start >= first:  # not wrapped: free are [last, size) and [0, first)
                    start = last if self.size - last >= length else (0 if first >= length else None)
                else:  # wrapped: free is [last, first)
                    start = last if first - last >= length else None
            if start is not None:
                self._live.append(_Range(start, start + length))
            return start

    def free(self, start: int) -> None:
        with self._lock:
            for entry in self._live:
                if entry.start == start and not entry.freed:
                    entry.freed = True
                    break
            while self._live and self._live[0].freed:
                self._live.popleft()

    def in_use(self) -> int:
        with self._lock:
            return sum(r.end - r.start for r in self._live)
