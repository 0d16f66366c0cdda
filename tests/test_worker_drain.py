"""A stream that outlasts --shutdown-timeout, against a real worker process: SIGTERM, then the stream is cut
with WORKER_DRAINING once the timeout has passed, and the worker exits 0.

The drain within the timeout (health NOT_SERVING at once, the registry key deleted, new requests refused,
the running stream finished) is held on the fleet, in test_fleet_e2e.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from taco_llm.protos import engine_pb2, rich_status

from .support import WorkerProcess, free_port, start_worker

pytestmark = pytest.mark.e2e

FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", "256M", "--seed", "0",
         "--max-num-seqs", "4", "--disable-log-stats"]


def _request(max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(text="Once upon a time", sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


class Stream(threading.Thread):
    """A Generate call read in the background; `first` is set once its first token arrived."""

    def __init__(self, worker: WorkerProcess, request: engine_pb2.GenerateRequest):
        super().__init__(daemon=True)
        self.call = worker.engine.Generate(request)
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
