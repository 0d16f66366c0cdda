"""The worker's side of stalls, abandoned requests and cache-service restarts, against one real worker
(vLLM's engine on the default model, real gRPC) that offloads prefix KV to a real cache service:

- its engine frozen (SIGSTOP of the worker's engine processes) mid-stream: GetLoad reports
  engine_stalled_ms, and health says NOT_SERVING once it passes --engine-stall-timeout, while the gRPC
  server goes on answering; SERVING again once the engine runs (SIGCONT), and the stream finishes with
  the text it would have had. Not a drain: the worker stays up.
- a request cancelled while it waits in the engine's queue leaves the queue at once and is never
  prefilled (vLLM's prompt-token counter does not grow by its prompt);
- GetLoad.prefix_cache_incarnation is the cache service's StatsResponse.incarnation, and follows the
  service's restart.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2

from taco_llm.protos import engine_pb2, kv_cache_pb2, kv_cache_pb2_grpc
from taco_llm.protos.engine_limits import ENGINE_SERVICE

from .support import Process, WorkerProcess, free_port, http_status, start, wait_until

pytestmark = pytest.mark.e2e

STALL_TIMEOUT_SECONDS = 3
# One sequence at a time: a second request waits in the engine's queue while the first runs.
FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", "256M", "--max-num-seqs", "1",
         "--disable-log-stats", "--engine-stall-timeout", str(STALL_TIMEOUT_SECONDS)]
# Generous bounds: the machine is shared, and these bound detection, not speed.
NOTICED_WITHIN_SECONDS = STALL_TIMEOUT_SECONDS + 12
RECOVERED_WITHIN_SECONDS = 30
LEFT_QUEUE_WITHIN_SECONDS = 5
PROMPT_TOKENS_METRIC = "vllm:prompt_tokens_total"


@dataclass
class Deployment:
    worker: WorkerProcess
    worker_address: str
    metrics_port: int
    cache: Process
    cache_address: str
    logs: Path

    def cache_stub(self) -> kv_cache_pb2_grpc.KVBlockStoreStub:
        return kv_cache_pb2_grpc.KVBlockStoreStub(grpc.insecure_channel(self.cache_address))

    def start_cache(self, name: str) -> None:
        port = self.cache_address.rsplit(":", 1)[1]
        self.cache = start(name, ["cache-service", "--grpc-port", port, "--memory", "64M"], self.logs)
        stub = self.cache_stub()
        wait_until(self.cache, lambda: _answers(stub), timeout=60)

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples (every label set) on the worker's /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name)] in "{ ")


def _answers(stub: kv_cache_pb2_grpc.KVBlockStoreStub) -> bool:
    try:
        stub.Stats(kv_cache_pb2.StatsRequest(), timeout=1)
        return True
    except grpc.RpcError:
        return False


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = Path(tmp_path_factory.mktemp("worker-progress"))
    cache_address = f"127.0.0.1:{free_port()}"
    metrics_port = free_port()
    grpc_port = free_port()
    running = Deployment(None, f"127.0.0.1:{grpc_port}", metrics_port, None, cache_address, logs)  # type: ignore[arg-type]
    running.start_cache("cache-service")
    try:
        # tests/support.py's start_worker, keeping the port: the gateway test dials it.
        process = start("worker-progress", [
            "worker", *FLAGS, "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
            "--cache-service", cache_address, "--enable-prefix-cache-offload"], logs)
        running.worker = WorkerProcess(process, grpc_port)
        wait_until(process, running.worker.serving)
        yield running
        running.worker.channel.close()
        code = running.worker.process.stop()
        assert code == 0, f"the worker exited with {code} on SIGTERM:\n{running.worker.process.tail()}"
    finally:
        running.cache.stop()


def _request(text: str, max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(text=text, sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


def _token_ids(messages: list[engine_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages if m.WhichOneof("phase") == "delta" for c in m.delta.choices for t in c.token_ids]


class Stream(threading.Thread):
    """A Generate call read in the background; `first` is set once its first token arrived."""

    def __init__(self, worker: WorkerProcess, request: engine_pb2.GenerateRequest):
        super().__init__(daemon=True)
        self.call = worker.engine.Generate(request)
        self.messages: list[engine_pb2.GenerateResponse] = []
        self.first = threading.Event()
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
                if message.WhichOneof("phase") == "delta":
                    self.first.set()
        except grpc.RpcError as error:
            self.error = error
        self.first.set()


def _load(worker: WorkerProcess) -> engine_pb2.Load:
    return worker.engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)


def _statuses(worker: WorkerProcess) -> set[int]:
    """The health status of the server ("") and of the Engine service."""
    return {worker.status(""), worker.status(ENGINE_SERVICE)}


def _wait_for(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until condition() held; fails past timeout."""
    start_at = time.monotonic()
    while not condition():
        assert time.monotonic() - start_at < timeout, f"not within {timeout}s"
        time.sleep(0.1)
    return time.monotonic() - start_at


def test_a_frozen_engine_is_not_serving_until_it_runs_again(deployment: Deployment) -> None:
    worker = deployment.worker
    request = _request("Once upon a time", max_tokens=96)
    expected = _token_ids(list(worker.engine.Generate(request)))
    assert _load(worker).engine_stalled_ms == 0, "an idle engine is not stalled"
    engine_processes = psutil.Process(worker.process.popen.pid).children(recursive=True)
    assert engine_processes, "vLLM's EngineCore runs in a process of its own"
    stream = Stream(worker, request)
    assert stream.first.wait(120) and stream.error is None, stream.error
    for process in engine_processes:
        process.suspend()
    try:
        noticed = _wait_for(lambda: _statuses(worker) == {health_pb2.HealthCheckResponse.NOT_SERVING},
                            NOTICED_WITHIN_SECONDS)
        load = _load(worker)  # the gRPC server answers while the engine is frozen
        assert load.engine_stalled_ms >= STALL_TIMEOUT_SECONDS * 1000, load
        assert worker.process.popen.poll() is None, "a stalled engine is not a reason to exit"
        assert stream.is_alive() and stream.error is None, "the stream waits for the engine"
    finally:
        for process in engine_processes:
            process.resume()
    recovered = _wait_for(lambda: _statuses(worker) == {health_pb2.HealthCheckResponse.SERVING},
                          RECOVERED_WITHIN_SECONDS)
    stream.join(120)
    assert stream.error is None, stream.error
    assert _token_ids(stream.messages) == expected, "the stalled stream's greedy text is the uninterrupted one"
    assert _load(worker).engine_stalled_ms == 0
    print(f"NOT_SERVING {noticed:.1f}s after the freeze (--engine-stall-timeout {STALL_TIMEOUT_SECONDS}); "
          f"SERVING {recovered:.1f}s after SIGCONT")


def _queue_behind_a_running_request(deployment: Deployment) -> tuple[Stream, float]:
    """A long request running in the engine's one sequence slot; vLLM's prompt-token count after its
    prefill."""
    worker = deployment.worker
    running = Stream(worker, _request("Write a long story about the sea.", max_tokens=400))
    assert running.first.wait(120) and running.error is None, running.error
    return running, deployment.metric(PROMPT_TOKENS_METRIC)


def _left_the_queue_while_the_first_ran(deployment: Deployment, running: Stream) -> float:
    worker = deployment.worker
    left = _wait_for(lambda: _load(worker).num_waiting_requests == 0, LEFT_QUEUE_WITHIN_SECONDS)
    load = _load(worker)
    assert load.num_running_requests == 1 and running.is_alive(), "it left the queue, not through a free slot"
    running.call.cancel()
    running.join(30)
    _wait_for(lambda: _load(worker).num_running_requests == 0, 30)
    return left


def test_a_request_cancelled_in_the_queue_leaves_it_at_once_and_is_never_prefilled(deployment: Deployment) -> None:
    worker = deployment.worker
    running, prompt_tokens = _queue_behind_a_running_request(deployment)
    queued = Stream(worker, _request("hello " * 300, max_tokens=4))
    _wait_for(lambda: _load(worker).num_waiting_requests == 1, 20)
    queued.call.cancel()
    left = _left_the_queue_while_the_first_ran(deployment, running)
    queued.join(10)
    assert queued.error is not None and queued.error.code() == grpc.StatusCode.CANCELLED
    # Had it stayed queued, it would have taken the slot the first one freed, and run before the engine idled.
    assert deployment.metric(PROMPT_TOKENS_METRIC) == prompt_tokens, "the cancelled request was prefilled"
    assert _load(worker).num_active_streams == 0
    print(f"the cancelled request left the queue {left:.2f}s after the cancel")


def test_an_http_client_that_leaves_while_queued_frees_the_queue(deployment: Deployment) -> None:
    worker = deployment.worker
    port = free_port()
    gateway = start("gateway-progress", ["gateway", "--engine", deployment.worker_address, "--port", str(port)],
                    deployment.logs)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until(gateway, lambda: http_status(f"{base_url}/health") == 200, timeout=60)
        running, prompt_tokens = _queue_behind_a_running_request(deployment)
        body = {"prompt": "hello " * 300, "max_tokens": 4, "stream": True}
        # The client gives up before any response head (the gateway sends one after the first token).
        with (pytest.raises(httpx.ReadTimeout),
              httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=3.0) as reply):
            reply.read()
        try:
            _left_the_queue_while_the_first_ran(deployment, running)
        finally:
            running.call.cancel()
            _wait_for(lambda: _load(worker).num_active_streams == 0, 60)
        assert deployment.metric(PROMPT_TOKENS_METRIC) == prompt_tokens, "the abandoned request was prefilled"
    finally:
        gateway.stop()


def test_the_worker_reports_its_cache_services_incarnation_and_follows_its_restart(deployment: Deployment) -> None:
    worker = deployment.worker
    first = deployment.cache_stub().Stats(kv_cache_pb2.StatsRequest(), timeout=5).incarnation
    assert first, "the cache service draws an incarnation at start"
    _wait_for(lambda: _load(worker).prefix_cache_incarnation == first, 20)
    assert deployment.cache.stop() == 0
    deployment.start_cache("cache-service-restarted")
    second = deployment.cache_stub().Stats(kv_cache_pb2.StatsRequest(), timeout=5).incarnation
    assert second and second != first, "a restarted cache service is a new incarnation"
    _wait_for(lambda: _load(worker).prefix_cache_incarnation == second, 30)
    assert _token_ids(list(worker.engine.Generate(_request("The sea", max_tokens=4)))), "still serving"
