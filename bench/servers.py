"""Starting and stopping the servers a benchmark compares: shared by the scripts in bench/."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def save_report(path: Path, report: dict[str, Any]) -> None:
    """The bench's JSON, its folder made if need be: also called between rows, so a run stopped partway
    keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def write_report(path: Path, report: dict[str, Any], summary: object) -> None:
    """The bench's last word: the JSON saved, its summary printed, and where it went."""
    save_report(path, report)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, processes: list[subprocess.Popen[bytes]], timeout: float = 900) -> None:
    """Until GET url answers 200; an exited process or the timeout is an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"a server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f}s")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group (servers are started in their own session), then SIGKILL."""
    if process.poll() is None:
        resume(process)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def pause(process: subprocess.Popen[bytes]) -> None:
    """Freezes a server's whole process group. Idle vLLM CPU engines still poll and take a fifth of a
    core each, so a benchmark that keeps several servers up freezes all but the one it measures."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGSTOP)


def resume(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGCONT)


def launch(argv: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """Starts a server in its own session (so that stop() reaches its children), output to `log`."""
    with log.open("ab") as handle:
        return subprocess.Popen(argv, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def wait_grpc_healthy(address: str, processes: list[subprocess.Popen[bytes]], timeout: float = 120) -> None:
    """Until the gRPC health service at `address` says SERVING; an exited process or the timeout is an error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for process in processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a server exited with {process.returncode}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    finally:
        channel.close()
    raise RuntimeError(f"{address} was not serving within {timeout:.0f}s")
