"""Containment of engine failures, against real worker processes (each started and killed by its test).

- `kill -9` of the worker mid-stream: every process it started (vLLM's EngineCore, its executor's Worker)
  dies with it (engine_worker/die_with_parent.py); before, they lived on as orphans holding gigabytes.
- `kill -9` of vLLM's EngineCore mid-stream: the worker says NOT_SERVING, ends the stream with
  UNAVAILABLE / ENGINE_DEAD, and exits non-zero so that its supervisor restarts it; nothing is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2

from taco_llm.engine_worker.die_with_parent import DIE_WITH_PARENT_ENV
from taco_llm.protos import engine_pb2, rich_status

from .support import WorkerProcess, start_worker

FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "128M", "--enforce-eager",
         "--max-num-seqs", "2", "--disable-log-stats"]
GONE_WITHIN_SECONDS = 10.0


def _descendants(worker: WorkerProcess) -> list[psutil.Process]:
    return psutil.Process(worker.process.popen.pid).children(recursive=True)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[WorkerProcess]:
    running = start_worker("worker", FLAGS, tmp_path)
    process = running.process
    try:
        yield running
    finally:
        running.channel.close()
        # Whatever a failed test left: the worker's session holds every process it started.
        leftovers = _descendants(running) if process.popen.poll() is None else []
        process.stop()
        for child in leftovers:
            if child.is_running():
                child.kill()


class Stream(threading.Thread):
    """A long greedy Generate call read in the background; `first` is set once its first token arrived."""

    def __init__(self, worker: WorkerProcess):
        super().__init__(daemon=True)
        request = engine_pb2.GenerateRequest(text="Once upon a time", sampling=engine_pb2.SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True))
        self.call = worker.engine.Generate(request)
        self.first = threading.Event()
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            for message in self.call:
                if message.WhichOneof("phase") == "delta":
                    self.first.set()
        except grpc.RpcError as error:
            self.error = error
        self.first.set()


def _alive(processes: list[psutil.Process]) -> list[str]:
    """Those still running (a zombie has released everything and waits only to be reaped)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {process.name()} ({process.memory_info().rss >> 20} MiB)")
        except psutil.NoSuchProcess:
            continue
    return alive


def _wait_gone(processes: list[psutil.Process]) -> list[str]:
    deadline = time.monotonic() + GONE_WITHIN_SECONDS
    while _alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(processes)


def _engine_core(processes: list[psutil.Process]) -> psutil.Process:
    cores = [p for p in processes if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    assert len(cores) == 1, f"expected one EngineCore among {[(p.pid, p.name()) for p in processes]}"
    return cores[0]


@pytest.mark.e2e
def test_killed_worker_takes_its_engine_processes_with_it(worker: WorkerProcess) -> None:
    descendants = _descendants(worker)
    _engine_core(descendants)  # the processes that used to be orphaned are there to be checked
    assert len(descendants) >= 2, [p.name() for p in descendants]
    stream = Stream(worker)
    assert stream.first.wait(120) and stream.error is None, stream.error
    worker.process.popen.send_signal(signal.SIGKILL)
    worker.process.popen.wait()
    survivors = _wait_gone(descendants)
    assert not survivors, f"outlived the killed worker: {survivors}"


@pytest.mark.e2e
def test_engine_core_death_fails_streams_and_stops_the_worker(worker: WorkerProcess) -> None:
    descendants = _descendants(worker)
    core = _engine_core(descendants)
    watch = worker.health.Watch(health_pb2.HealthCheckRequest(), timeout=120)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    stream = Stream(worker)
    assert stream.first.wait(120) and stream.error is None, stream.error
    core.send_signal(signal.SIGKILL)

    stream.join(60)
    assert stream.error is not None, "the stream finished normally on a dead engine"
    assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
    assert rich_status.details_of(stream.error).reason == "ENGINE_DEAD"
    # Gateways and probes are told before the worker goes.
    statuses: list[int] = []
    with contextlib.suppress(grpc.RpcError):  # the server ends the watch as it stops
        for reply in watch:
            statuses.append(reply.status)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, statuses
    assert worker.process.popen.wait(60) != 0, worker.process.tail()
    survivors = _wait_gone(descendants)
    assert not survivors, f"outlived the dead engine: {survivors}"


class _DyingEngine:
    """Stands in for AsyncLLM's check_health: healthy `healthy_checks` times, then dead."""

    def __init__(self, healthy_checks: int):
        self.checks = 0
        self.healthy_checks = healthy_checks

    async def check_health(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        self.checks += 1
        if self.checks > self.healthy_checks:
            raise EngineDeadError()


async def test_an_idle_workers_dead_engine_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no stream to raise EngineDeadError, the worker's watch is what stops it (the e2e test above
    kills the engine mid-stream)."""
    from taco_llm.engine_worker.frontend import server

    monkeypatch.setattr(server, "ENGINE_CHECK_SECONDS", 0.01)
    engine = _DyingEngine(healthy_checks=3)
    died: list[bool] = []
    await asyncio.wait_for(server._watch_engine(engine, lambda: died.append(True)), 10)  # type: ignore[arg-type]
    assert died == [True] and engine.checks == 4


# A parent that arms its children as the worker does, then starts one by spawn (a new interpreter that
# runs the plugin hook, as vLLM's EngineCore does) and one by fork, prints their pids and waits to be killed.
PARENT = """
import os, subprocess, sys, time
from taco_llm.engine_worker import die_with_parent
die_with_parent.arm()
spawned = subprocess.Popen([sys.executable, "-c", "from taco_llm.engine_worker import die_with_parent; "
                            "die_with_parent.register(); import time; time.sleep(600)"])
forked = os.fork()
if forked == 0:
    time.sleep(600)
    os._exit(0)
print(spawned.pid, forked, flush=True)
time.sleep(600)
"""


def test_the_plugin_makes_children_die_with_a_killed_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert parent.stdout is not None
        children = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        time.sleep(1.0)  # the spawned child runs register() once its interpreter is up
        assert len(_alive(children)) == 2
        parent.kill()
        parent.wait()
        assert not _wait_gone(children), "outlived their killed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)


def test_a_process_whose_parent_died_before_it_armed_kills_itself() -> None:
    """The race prctl cannot cover: the expected parent is gone by the time the plugin runs."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    run = subprocess.run([sys.executable, "-c", "from taco_llm.engine_worker import die_with_parent; "
                          "die_with_parent.register(); print('still running')"],
                         env={**os.environ, DIE_WITH_PARENT_ENV: str(gone.pid)}, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == -signal.SIGKILL and "still running" not in run.stdout
