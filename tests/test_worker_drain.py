"""Draining on SIGTERM, against real worker processes (one at a time, each stopped by its test).

Also checked on the first worker: its registry key goes at once, and its spans join the caller's trace."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from taco_llm.protos import engine_pb2, rich_status
from taco_llm.protos.engine_limits import ENGINE_SERVICE
from taco_llm.protos.registry_keys import REGISTRY_KEY_PREFIX

from .support import RedisServer, WorkerProcess, free_port, start_worker

pytestmark = pytest.mark.e2e

FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", "256M", "--seed", "0",
         "--max-num-seqs", "4", "--disable-log-stats"]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC receiver: keeps every span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service.name, span name, trace id hex)
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span.name, span.trace_id.hex()) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def _request(max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(text="Once upon a time", sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


class Stream(threading.Thread):
    """A Generate call read in the background; `first` is set once its first token arrived."""

    def __init__(self, worker: WorkerProcess, request: engine_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(daemon=True)
        self.call = worker.engine.Generate(request, metadata=metadata)
        self.first = threading.Event()
        self.messages: list[engine_pb2.GenerateResponse] = []
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

    def tokens(self) -> int:
        return sum(len(c.token_ids) for m in self.messages if m.WhichOneof("phase") == "delta" for c in m.delta.choices)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path, persist=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(0)


def test_drain_finishes_running_streams_and_refuses_new_ones(log_dir: Path, redis_server: RedisServer,
                                                             collector: tuple[Collector, int]) -> None:
    receiver, otlp_port = collector
    worker = start_worker("worker-drain", [
        *FLAGS, "--shutdown-timeout", "60", "--registry-url", redis_server.url, "--registry-ttl", "30",
        "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}",
    ], log_dir)
    registry = redis.Redis.from_url(redis_server.url)
    try:
        keys = registry.keys(REGISTRY_KEY_PREFIX + "*")
        assert len(keys) == 1, "the serving worker registered"
        stream = Stream(worker, _request(200), metadata=(("traceparent", TRACEPARENT),))
        assert stream.first.wait(120) and stream.error is None
        worker.process.popen.send_signal(15)
        signalled = time.monotonic()
        while any(worker.status(name) != health_pb2.HealthCheckResponse.NOT_SERVING for name in ("", ENGINE_SERVICE)):
            assert time.monotonic() - signalled < 1.0, "health turns NOT_SERVING at once"
            time.sleep(0.02)
        assert not registry.keys(REGISTRY_KEY_PREFIX + "*"), "the registry key is deleted at once, not left to expire"
        with pytest.raises(grpc.RpcError) as refused:
            list(worker.engine.Generate(_request(5), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert rich_status.details_of(refused.value).reason == "WORKER_DRAINING"
        stream.join(120)
        assert stream.error is None, stream.error
        assert stream.messages[-1].WhichOneof("phase") == "finished" and stream.tokens() == 200
        assert worker.process.popen.wait(60) == 0, worker.process.tail()
    finally:
        registry.close()
        worker.channel.close()
        worker.process.stop()
    # The worker's spans (sent at the latest when it exits) continue the caller's trace, and so do vLLM's.
    traced = {(service, name) for service, name, trace in receiver.spans if trace == TRACE_ID}
    assert ("taco-llm-worker", "/taco_llm.engine.v1.Engine/Generate") in traced, receiver.spans
    assert any(service != "taco-llm-worker" for service, _ in traced), f"vLLM's request span: {receiver.spans}"


def test_streams_past_the_shutdown_timeout_end_with_worker_draining(log_dir: Path) -> None:
    metrics_port = free_port()
    worker = start_worker("worker-cut", [*FLAGS, "--shutdown-timeout", "1", "--metrics-port", str(metrics_port)],
                          log_dir)
    try:
        info = worker.engine.GetModelInfo(engine_pb2.GetModelInfoRequest())
        assert (info.metrics_port, info.prefix_cache_service) == (metrics_port, "")
        stream = Stream(worker, _request(1500))
        assert stream.first.wait(120) and stream.error is None
        worker.process.popen.send_signal(15)
        signalled = time.monotonic()
        stream.join(30)
        assert stream.error is not None, "cut, not finished"
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
        assert rich_status.details_of(stream.error).reason == "WORKER_DRAINING"
        assert time.monotonic() - signalled < 1.0 + 5.0
        assert all(m.WhichOneof("phase") != "finished" for m in stream.messages)
        assert 0 < stream.tokens() < 1500
        assert worker.process.popen.wait(60) == 0, worker.process.tail()
    finally:
        worker.channel.close()
        worker.process.stop()
