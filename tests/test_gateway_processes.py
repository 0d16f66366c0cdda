"""`taco_llm gateway --api-server-count 2`: two gateway processes on one port, against the synthetic engine
(bench/synthetic_engine.py, which computes nothing): both serve, every request is answered, /metrics counts
the requests of both, and SIGTERM stops them all with code 0."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .support import ROOT, free_port, http_status

REQUESTS = 48
MAX_TOKENS = 16


def _popen(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        return subprocess.Popen(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(process: subprocess.Popen[bytes], log: Path, ready: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.3)
    raise AssertionError(f"not ready after {timeout}s:\n{log.read_text(errors='replace')[-3000:]}")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _listening_inodes(port: int) -> set[str]:
    """Inodes of the sockets listening on 127.0.0.1:port (state 0A in /proc/net/tcp)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":
            inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with_target = os.readlink(fd) if fd.is_symlink() else ""
        if match := re.fullmatch(r"socket:\[(\d+)\]", with_target):
            inodes.add(match.group(1))
    return inodes


def _sample_sum(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def engine_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "synthetic_engine.log"
    engine = _popen([sys.executable, str(ROOT / "bench" / "synthetic_engine.py"), "--port", str(port),
                     "--token-interval", "0.002"], log)
    try:
        _wait(engine, log, lambda: _tcp_open(port))
        yield f"127.0.0.1:{port}"
    finally:
        engine.terminate()
        engine.wait(30)


def _tcp_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def _chat(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": "synthetic", "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": MAX_TOKENS,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
            usage = chunk["usage"] or usage
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS
    return text


async def _many(base_url: str) -> list[str]:
    async def one(i: int) -> str:
        # A connection of its own, so that the kernel spreads the requests over the processes.
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            return await _chat(client, i)

    return await asyncio.gather(*(one(i) for i in range(REQUESTS)))


def test_two_api_servers_share_the_port_and_their_metrics(engine_address: str, tmp_path: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    gateway = _popen([sys.executable, "-m", "taco_llm.gateway", "--engine", engine_address, "--port", str(port),
                      "--api-server-count", "2"], log)
    try:
        # /health answers once the first process listens; the second may still be starting.
        _wait(gateway, log, lambda: http_status(f"{base_url}/health") == 200 and len(_listening_inodes(port)) == 2)
        children = _children(gateway.pid)
        assert len(children) == 2, children
        listening = _listening_inodes(port)
        # Each child listens on the port with its own socket; the parent listens on none.
        assert all(_socket_inodes(child) & listening for child in children), (children, listening)
        assert not _socket_inodes(gateway.pid) & listening

        texts = asyncio.run(_many(base_url))
        assert all(len(text) == 4 * MAX_TOKENS for text in texts)

        metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
        assert _sample_sum(metrics, "taco_llm_gateway_requests_total", route="/v1/chat/completions",
                           status="200") == REQUESTS
        assert _sample_sum(metrics, "vllm:request_success_total", finished_reason="length") == REQUESTS
        assert _sample_sum(metrics, "vllm:generation_tokens_total") == REQUESTS * MAX_TOKENS
    finally:
        if gateway.poll() is None:
            gateway.send_signal(signal.SIGTERM)
        code = gateway.wait(60)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    # The parent waited for them: gone, not even zombies.
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]


def test_a_child_that_dies_stops_the_gateway(engine_address: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    gateway = _popen([sys.executable, "-m", "taco_llm.gateway", "--engine", engine_address, "--port", str(port),
                      "--api-server-count", "2"], log)
    try:
        _wait(gateway, log, lambda: http_status(f"http://127.0.0.1:{port}/health") == 200)
        children = _children(gateway.pid)
        os.kill(children[0], signal.SIGKILL)
        code = gateway.wait(60)
    finally:
        if gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGKILL)
            gateway.wait()
    assert code != 0
    assert not Path(f"/proc/{children[1]}").exists()


def test_api_server_count_must_be_positive(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "taco_llm.gateway", "--engine", "127.0.0.1:1", "--api-server-count",
                          "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--api-server-count" in run.stderr
