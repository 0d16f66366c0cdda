"""The bench tools run: the synthetic engine speaks the Engine contract, and the gateway relay bench
writes its report. No timings are asserted (these machines are shared and noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.protos import engine_pb2, engine_pb2_grpc
from taco_llm.protos.engine_limits import ENGINE_SERVICE

from .support import ROOT, free_port, http_status, start, wait_until

BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def synthetic_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("synthetic") / "engine.log"
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, str(BENCH / "synthetic_engine.py"), "--port", str(port)],
                                   stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 20
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"the synthetic engine did not serve:\n{log.read_text()}"
                time.sleep(0.2)
        yield address
    finally:
        process.terminate()
        process.wait(10)


def test_the_synthetic_engine_streams_the_asked_tokens(synthetic_engine: str) -> None:
    with grpc.insecure_channel(synthetic_engine) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
        request = engine_pb2.GenerateRequest(request_id="smoke", model=info.served_model_names[0], text="a b c",
                                             sampling=engine_pb2.SamplingParams(max_tokens=7))
        messages = list(stub.Generate(request, timeout=10))
    phases = [m.WhichOneof("phase") for m in messages]
    assert phases == ["started", *["delta"] * 7, "finished"]
    assert all(m.request_id == "smoke" for m in messages)
    assert len(messages[0].started.prompt_token_ids) == 3
    deltas = [m.delta.choices[0] for m in messages[1:-1]]
    assert all(len(d.token_ids) == 1 and len(d.text) == 4 for d in deltas)
    assert [d.finish_reason for d in deltas] == [engine_pb2.FINISH_REASON_UNSPECIFIED] * 6 + [
        engine_pb2.FINISH_REASON_LENGTH]
    assert messages[-1].finished.usage.completion_tokens == 7


def test_the_synthetic_engine_refuses_an_unknown_model_by_code(synthetic_engine: str) -> None:
    with grpc.insecure_channel(synthetic_engine) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(engine_pb2.GenerateRequest(model="nope", text="x"), timeout=5))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_relay_bench_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "gateway_relay.py"), "--concurrency", "4", "--max-tokens", "16", "--rounds", "1",
         "--modes", "saturated", "--api-server-counts", "--log-dir", str(tmp_path / "logs"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] >= 1
    rows = {row["target"]: row for row in report["rows"]}
    assert set(rows) == {"direct", "gateway"}
    for row in rows.values():
        assert row["errors"] == 0, row["first_errors"]
        assert row["tokens"] == 4 * 16
        for key in ("ttfb_p50_ms", "ttfb_p99_ms", "gap_p50_ms", "gap_p99_ms", "engine_cpu_s", "client_cpu_s"):
            assert key in row
    gateway = rows["gateway"]
    assert {"gateway_cpu_s", "tokens_per_gateway_cpu_s", "added"} <= set(gateway)
    assert set(gateway["added"]) >= {"ttfb_p99_ms", "gap_p99_ms"}


def test_the_soak_bench_writes_its_report(synthetic_engine: str, tmp_path: Path) -> None:
    """bench/soak.py against a gateway in front of the synthetic engine: no errors, windows, process samples."""
    port = free_port()
    gateway = start("soak-smoke-gateway", ["gateway", "--engine", synthetic_engine, "--port", str(port)], tmp_path)
    try:
        wait_until(gateway, lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, timeout=60)
        out = tmp_path / "soak.json"
        run = subprocess.run(
            [sys.executable, str(BENCH / "soak.py"), "--url", f"http://127.0.0.1:{port}", "--pid",
             str(gateway.popen.pid), "--model", "synthetic", "--requests", "24", "--concurrency", "4",
             "--max-tokens", "4", "--warm-up", "4", "--window", "1", "--sample-every", "0.5", "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        gateway.stop()
    report = json.loads(out.read_text())
    assert (report["requests"], report["errors"]) == (24, 0)
    assert sum(w["requests"] for w in report["windows"]) == 24
    assert {"ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"} <= set(report["windows"][0])
    assert report["samples"] and "taco_llm.cli" in report["end"]["processes"]


def test_the_lookahead_sync_bench_writes_its_report(tmp_path: Path) -> None:
    """bench/lookahead_sync.py with two simulated workers against a real cache service and redis-server: every
    sequence reaches the other worker, and the report has its latencies and byte counts."""
    out = tmp_path / "sync.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "lookahead_sync.py"), "--workers", "2", "--rate", "5", "--seconds", "2",
         "--prompt-tokens", "16", "--output-tokens", "8", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["workers"] == 2 and row["sequences"] > 0
    assert row["lost"] == 0 and row["deliveries"] == row["sequences"]
    assert set(row["latency_ms"]) == {"p50", "p90", "p99", "max"}
    assert row["bytes_per_output_token"]["redis_held"] > 0
    assert row["bytes_per_output_token"]["grpc_published"] > 0


def test_the_delivery_quantiles_interpolate_within_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import lookahead_sync_load

    # 100 deliveries: 50 within 10 ms, 40 more within 50 ms, 9 within 100 ms, 1 past every bound.
    buckets = [(0.01, 50.0), (0.05, 90.0), (0.1, 99.0), (float("inf"), 100.0)]
    assert lookahead_sync_load.quantile(buckets, 0.5) == pytest.approx(0.01)
    assert lookahead_sync_load.quantile(buckets, 0.7) == pytest.approx(0.03)
    assert lookahead_sync_load.quantile(buckets, 0.95) == pytest.approx(0.05 + 0.05 * 5 / 9)
    assert lookahead_sync_load.quantile(buckets, 0.999) == pytest.approx(0.1)
    assert lookahead_sync_load.within(buckets, 0.1) == pytest.approx(0.99)
    assert lookahead_sync_load.quantile([(0.01, 0.0), (float("inf"), 0.0)], 0.5) is None
