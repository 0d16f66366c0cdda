"""Starting and stopping the real processes the end-to-end tests drive."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 600.0


def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_EPHEMERAL = _ephemeral_ports()


def free_port() -> int:
    """A port nothing listens on, chosen outside the kernel's ephemeral range.

    A port the kernel hands out for bind(0) lies in the range it also draws outgoing connections
    from: between this check and the server's own bind, some client's connection (the suite opens
    many) can take it. Outside that range only another listener can."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(15000, 65535)
        if port in _EPHEMERAL:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port outside the ephemeral range")


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 60.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
                raise AssertionError(f"{self.name} did not stop within {timeout}s of SIGTERM") from None
        return self.popen.returncode


def start(name: str, args: list[str], log_dir: Path, *, env: dict[str, str] | None = None) -> Process:
    """`taco_llm ARGS` in the background, logging to LOG_DIR/NAME.log; `env`: variables added to ours."""
    log = log_dir / f"{name}.log"
    handle = log.open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "taco_llm.cli", *args], stdout=handle, stderr=subprocess.STDOUT,
        cwd=ROOT, start_new_session=True, env={**os.environ, **env} if env else None,
    )
    return Process(name, popen, log)


def wait_until(process: Process, ready: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
        if ready():
            return
        time.sleep(0.5)
    process.stop()
    raise RuntimeError(f"{process.name} was not ready after {timeout}s:\n{process.tail()}")


@dataclass
class Stack:
    """`taco_llm serve` running: the gateway's URL and the worker's gRPC address."""

    process: Process
    base_url: str
    grpc_address: str


def start_stack(name: str, extra: list[str], log_dir: Path) -> Stack:
    port, grpc_port = free_port(), free_port()
    process = start(name, ["serve", "--port", str(port), "--grpc-port", str(grpc_port), *extra], log_dir)
    base_url = f"http://127.0.0.1:{port}"
    wait_until(process, lambda: http_status(f"{base_url}/health") == 200)
    return Stack(process, base_url, f"127.0.0.1:{grpc_port}")


class WorkerProcess:
    """`taco_llm worker` running, with a channel to its gRPC port: the Engine and Health stubs."""

    def __init__(self, process: Process, port: int):
        import grpc
        from grpc_health.v1 import health_pb2_grpc

        from taco_llm.protos import engine_pb2_grpc

        self.process = process
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.engine = engine_pb2_grpc.EngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def status(self, service: str = "") -> int:
        from grpc_health.v1 import health_pb2

        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status  # type: ignore[no-any-return]

    def serving(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2

        try:
            return self.status() == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def start_worker(name: str, args: list[str], log_dir: Path) -> WorkerProcess:
    """`taco_llm worker ARGS` on a free gRPC port, once it reports SERVING."""
    port = free_port()
    process = start(name, ["worker", *args, "--grpc-port", str(port)], log_dir)
    worker = WorkerProcess(process, port)
    try:
        wait_until(process, worker.serving)
    except BaseException:
        worker.channel.close()
        raise
    return worker


@dataclass
class RedisServer:
    """A real redis-server on a free port, restartable on it: with append-only persistence in its own
    folder, or (persist=False) with none, so that a restart comes back empty."""

    port: int
    folder: Path
    popen: subprocess.Popen[bytes] | None = None
    persist: bool = True

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = (self.folder / "redis.log").open("ab")
        self.popen = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             *(["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]),
             "--save", ""],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(20)
        self.popen = None


@dataclass(frozen=True)
class Footprint:
    """One process's resources at a moment: resident memory and open file descriptors."""

    rss: int
    fds: int


def process_footprints(root_pid: int) -> dict[str, Footprint]:
    """The footprint of a process and of every process under it, by a name that stays the same while
    they live: the module a `python -m` child runs (taco_llm.gateway, taco_llm.engine_worker), or else
    the process's own name (vLLM's EngineCore sets its title), numbered where several share one."""
    import psutil

    root = psutil.Process(root_pid)
    found: dict[str, Footprint] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            argv = process.cmdline()
            name = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else process.name()
            footprint = Footprint(process.memory_info().rss, process.num_fds())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        key, n = name, 1
        while key in found:
            n += 1
            key = f"{name}#{n}"
        found[key] = footprint
    return found


def connections_to(pid: int, port: int) -> int:
    """The TCP connections a process holds open to a local port (a gRPC channel's, say)."""
    import psutil

    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def child_pid(root_pid: int, module: str) -> int:
    """The pid of the process under root_pid that runs `python -m module`."""
    import psutil

    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            argv = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == module:
            return int(process.pid)
    raise AssertionError(f"no process runs {module} under {root_pid}")


def child_command(root_pid: int, *words: str) -> tuple[int, list[str]]:
    """The pid and command line of the process directly under root_pid whose command line holds every one
    of words."""
    import psutil

    for process in psutil.Process(root_pid).children():
        try:
            argv = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if all(word in argv for word in words):
            return process.pid, list(argv)
    raise AssertionError(f"no process under {root_pid} runs with {words}")


def grpc_serving(address: str) -> bool:
    """Whether the gRPC health service at address answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive free ports: serve gives worker i the port --grpc-port + i."""
    for _ in range(100):
        first = free_port()
        try:
            for offset in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", first + offset))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports")
