"""The command line: help, clear refusals of bad flags, and a gateway with no worker ready."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .support import free_port, http_status, start, wait_until


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "taco_llm.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_help() -> None:
    top = _run("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "worker" in top.stdout
    serve = _run("serve", "-h")
    assert serve.returncode == 0 and "--port" in serve.stdout and "taco_llm worker -h" in serve.stdout


def test_unknown_command_and_bad_port_are_refused() -> None:
    unknown = _run("frobnicate")
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr
    bad_port = _run("serve", "--port", "70000")
    assert bad_port.returncode == 2 and "--port 70000" in bad_port.stderr
    gateway = _run("gateway", "--engine", "nohostport")
    assert gateway.returncode == 2 and "HOST:PORT" in gateway.stderr


def test_bad_engine_flag_is_refused_without_traceback() -> None:
    result = _run("worker", "--dtype", "bogus")
    assert result.returncode == 2
    assert "--dtype" in result.stderr and "Traceback" not in result.stderr


def test_gateway_without_a_ready_worker_answers_503(tmp_path: Path) -> None:
    port = free_port()
    gateway = start("lonely-gateway", ["gateway", "--engine", f"127.0.0.1:{free_port()}", "--port", str(port)],
                    tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(gateway, lambda: http_status(f"{base}/health") is not None, timeout=60)
        assert http_status(f"{base}/health") == 503
        reply = httpx.post(f"{base}/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "no_engine_ready"
    finally:
        # uvicorn shuts down gracefully, then re-raises SIGTERM: -15 is its clean exit.
        assert gateway.stop() in (0, -15)


def test_bad_worker_counts_are_refused_at_once() -> None:
    none = _run("serve", "--num-workers", "0")
    assert none.returncode == 2 and "--num-workers 0" in none.stderr
    single = _run("serve", "--num-workers", "2", "--disable-frontend-multiprocessing")
    assert single.returncode == 2
    assert "--disable-frontend-multiprocessing" in single.stderr and "--num-workers 2" in single.stderr
    assert "Traceback" not in none.stderr + single.stderr


def test_serve_stops_when_a_worker_cannot_start() -> None:
    """Both workers refuse a bad engine flag (no engine is started): serve says which, exits non-zero and
    leaves nothing running."""
    run = _run("serve", "--num-workers", "2", "--grpc-port", str(free_port()), "--port", str(free_port()),
               "--dtype", "bogus")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "exited with code 2 before it ever became ready" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", run.stdout)]
    assert len(pids) == 3, run.stdout
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_serve_refuses_ports_in_use_at_once() -> None:
    """Ports given to serve that another process listens on (another serve's gateway and worker) are
    refused before anything starts, each naming its flag, rather than by a worker once its engine has
    loaded. (--ready-timeout bounds the run should serve start its processes after all.)"""
    with socket.socket() as gateway, socket.socket() as worker:
        for held in (gateway, worker):
            held.bind(("127.0.0.1", 0))
            held.listen()
        port, grpc_port = gateway.getsockname()[1], worker.getsockname()[1]
        run = _run("serve", "--port", str(port), "--grpc-port", str(grpc_port), "--ready-timeout", "20")
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--port: port {port} on 127.0.0.1 is in use by another process" in run.stderr
    assert f"--grpc-port: port {grpc_port} on 127.0.0.1 is in use by another process" in run.stderr
    assert "leave the flag out: serve then picks free ports" in run.stderr
    assert run.stdout == "" and "Traceback" not in run.stderr, run.stdout + run.stderr
