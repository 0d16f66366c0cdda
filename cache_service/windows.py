"""Shared-memory windows: client-owned /dev/shm files the service reads puts from and writes gets into.

A window is a transport buffer, never storage: a put's bytes are copied out into the block store,
a get's bytes are copied in, and the window's memory belongs to (and is counted by) the client.

The service keeps each window's file descriptor, not a mapping, and copies with pread/pwrite: a
client that shrinks its file after attaching it then gets a short read or a refused call, where a
mapping would take the whole service down with SIGBUS on the first touch past the new end.

Pure bookkeeping plus file I/O, no gRPC: the servicer validates requests and reports the errors
raised here (WindowError carries the status, the reason of protos/errors.proto, the field and a
message naming it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from taco_llm.protos.kv_cache_limits import (
    MAX_WINDOW_BYTES,
    NONCE_BYTES,
    SHM_DIR,
    WINDOW_NAME_PATTERN,
    WINDOW_NAME_PREFIX,
)
from taco_llm.protos.rich_status import Reason

MAX_WINDOWS = 64            # the least recently used beyond this are dropped
IDLE_SECONDS = 600.0        # a window unused this long is dropped (its client may be gone)


class WindowError(Exception):
    """A refusal: the gRPC status, its reason (an ErrorReason value), the field at fault, and a message
    that begins with that field's path (so that `under` can re-root both)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: int, field: str):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.field = field

    def under(self, parent: str) -> WindowError:
        """The same refusal for a field that lies in the message `parent` (a WindowRef in a PutBlocks
        chunk's `windowed` block rather than in the request itself)."""
        return WindowError(self.code, f"{parent}.{self.message}", self.reason, f"{parent}.{self.field}")


@dataclass
class Window:
    window_id: int
    name: str
    fd: int
    size: int
    last_used: float
    users: int = 0         # calls copying through it now: its fd is closed only once this is 0
    dropped: bool = False

    def read(self, offset: int, length: int) -> bytes:
        """The range's bytes; WindowError if the client shrank the file under us."""
        with _os_errors("read"):
            data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise WindowError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"window: read {len(data)} of {length} bytes at offset {offset} of window "
                              f"{self.window_id}; the client shrank its window", Reason.WINDOW_IO_FAILED, "window")
        return data

    def write(self, offset: int, data: memoryview) -> None:
        written = 0
        while written < len(data):
            with _os_errors("write"):
                step = os.pwrite(self.fd, data[written:], offset + written)
            if step <= 0:
                raise WindowError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"window: the write into window {self.window_id} stopped at {written} bytes",
                                  Reason.WINDOW_IO_FAILED, "window")
            written += step


@contextlib.contextmanager
def _os_errors(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        code = (grpc.StatusCode.RESOURCE_EXHAUSTED if error.errno in (errno.ENOSPC, errno.ENOMEM)
                else grpc.StatusCode.FAILED_PRECONDITION)
        raise WindowError(code, f"window: cannot {what} it ({os.strerror(error.errno or 0)})",
                          Reason.WINDOW_IO_FAILED, "window") from None


@dataclass
class WindowCounters:
    bytes_stored_shm: int = 0
    bytes_served_shm: int = 0


@dataclass
class WindowTable:
    """The attached windows, least recently used first."""

    max_windows: int = MAX_WINDOWS
    idle_seconds: float = IDLE_SECONDS
    shm_dir: str = SHM_DIR
    counters: WindowCounters = field(default_factory=WindowCounters)

    def __post_init__(self) -> None:
        self._windows: OrderedDict[int, Window] = OrderedDict()

    def __len__(self) -> int:
        return len(self._windows)

    def attach(self, name: str, size: int, nonce: bytes) -> int:
        if not WINDOW_NAME_PATTERN.fullmatch(name):
            raise WindowError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"name: {name[:80]!r} is not a window name ({WINDOW_NAME_PREFIX}<pid>-<hex digits>, "
                              f"a plain name under {self.shm_dir})", Reason.FIELD_INVALID, "name")
        if not NONCE_BYTES <= size <= MAX_WINDOW_BYTES:
            raise WindowError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"size: a window is {NONCE_BYTES} to {MAX_WINDOW_BYTES} bytes, got {size}",
                              Reason.FIELD_INVALID, "size")
        if len(nonce) != NONCE_BYTES:
            raise WindowError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"nonce: {NONCE_BYTES} bytes, got {len(nonce)}", Reason.FIELD_INVALID, "nonce")
        fd = self._open(name)
        try:
            self._check(fd, name, size, nonce)
        except BaseException:
            os.close(fd)
            raise
        window_id = secrets.randbits(63) + 1  # never 0 (proto3's unset), and no reuse after a restart
        self._windows[window_id] = Window(window_id, name, fd, size, time.monotonic())
        self._expire()
        return window_id

    def _open(self, name: str) -> int:
        path = os.path.join(self.shm_dir, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        try:
            return os.open(path, flags)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise WindowError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"name: {path} is a symbolic link, not a window", Reason.FIELD_INVALID,
                                  "name") from None
            if error.errno == errno.EISDIR:
                raise WindowError(grpc.StatusCode.INVALID_ARGUMENT, f"name: {name} is not a regular file",
                                  Reason.FIELD_INVALID, "name") from None
            raise WindowError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"name: window {path} is not reachable from the cache service "
                              f"({os.strerror(error.errno or 0)}): not the same host or IPC namespace",
                              Reason.WINDOW_UNREACHABLE, "name") from None

    def _check(self, fd: int, name: str, size: int, nonce: bytes) -> None:
        with _os_errors("stat"):
            info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WindowError(grpc.StatusCode.INVALID_ARGUMENT, f"name: {name} is not a regular file",
                              Reason.FIELD_INVALID, "name")
        if info.st_size != size:
            raise WindowError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"size: the window {name} holds {info.st_size} bytes, not {size}",
                              Reason.FIELD_INVALID, "size")
        with _os_errors("read"):
            found = os.pread(fd, NONCE_BYTES, 0)
        if found != nonce:
            raise WindowError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"nonce: the file {name} the cache service sees holds another nonce: not the "
                              "client's own window (not the same host or IPC namespace)", Reason.WINDOW_UNREACHABLE,
                              "nonce")

    def detach(self, window_id: int) -> bool:
        window = self._windows.pop(window_id, None)
        if window is None:
            return False
        self._drop(window)
        return True

    def acquire(self, window_id: int, offset: int, length: int) -> Window:
        """The window, pinned for one call's copies (release it after); checks the range."""
        self._expire()
        window = self._windows.get(window_id)
        if window is None:
            raise WindowError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"window.window_id {window_id} is not attached (the cache service restarted, or "
                              "dropped it): attach a new window", Reason.WINDOW_NOT_FOUND, "window.window_id")
        if offset > window.size:
            raise WindowError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"window.offset {offset} is beyond the window's {window.size} bytes",
                              Reason.FIELD_INVALID, "window.offset")
        if length == 0 or length > window.size - offset:
            raise WindowError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"window.length {length} at offset {offset} does not fit in the window's "
                              f"{window.size} bytes (or is 0)", Reason.FIELD_INVALID, "window.length")
        window.users += 1
        window.last_used = time.monotonic()
        self._windows.move_to_end(window_id)
        return window

    def release(self, window: Window) -> None:
        window.users -= 1
        if window.dropped and window.users == 0:
            os.close(window.fd)

    def close(self) -> None:
        for window_id in list(self._windows):
            self.detach(window_id)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._windows:
            oldest = next(iter(self._windows.values()))
            if len(self._windows) <= self.max_windows and now - oldest.last_used < self.idle_seconds:
                return
            del self._windows[oldest.window_id]
            self._drop(oldest)

    @staticmethod
    def _drop(window: Window) -> None:
        window.dropped = True
        if window.users == 0:
            os.close(window.fd)
