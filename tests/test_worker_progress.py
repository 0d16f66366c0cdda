"""The worker's engine-progress watch and its reading of the cache service's incarnation, without an engine
(tests/test_worker_progress_e2e.py runs them on the real one): the stall clock, the health flips, the flag,
and the incarnation read from a real KVBlockStore servicer over real gRPC."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2

from taco_llm.cache_service.config import CacheServiceConfig
from taco_llm.cache_service.kv_servicer import KVBlockStoreServicer
from taco_llm.engine_worker.frontend import server
from taco_llm.engine_worker.frontend.cache_incarnation import CacheServiceIncarnation
from taco_llm.engine_worker.frontend.engine import EngineProgress, LoadTracker
from taco_llm.protos import kv_cache_pb2_grpc
from taco_llm.protos.engine_limits import ENGINE_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_stall_clock_runs_only_while_the_engine_has_requests() -> None:
    clock = Clock()
    progress = EngineProgress(clock)
    clock.now += 600
    assert progress.stalled_seconds(unfinished=0) == 0.0, "an idle engine is not stalled"
    progress.submitting(unfinished=0)  # the first request after ten idle minutes starts the clock
    clock.now += 2
    assert progress.stalled_seconds(unfinished=1) == 2.0
    progress.stepped()
    clock.now += 0.5
    assert progress.stalled_seconds(unfinished=1) == 0.5
    # More requests sent to a busy engine that steps no more do not hide its stall.
    for _ in range(5):
        clock.now += 10
        progress.submitting(unfinished=1)
    assert progress.stalled_seconds(unfinished=6) == 50.5


def test_every_engine_output_counts_as_progress() -> None:
    clock = Clock()
    tracker = LoadTracker(EngineProgress(clock))
    stat_logger = tracker.stat_logger(None)  # type: ignore[arg-type]  # the config is not read
    clock.now += 30
    stat_logger.record(scheduler_stats=None, iteration_stats=None)
    assert tracker.progress.stalled_seconds(unfinished=1) == 0.0


async def _statuses(health_service: health.aio.HealthServicer) -> set[int]:
    replies = [await health_service.Check(health_pb2.HealthCheckRequest(service=name), None)  # type: ignore[arg-type]
               for name in ("", ENGINE_SERVICE)]
    return {reply.status for reply in replies}


async def test_health_is_not_serving_past_the_limit_and_serving_again_once_the_engine_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "PROGRESS_CHECK_SECONDS", 0.01)
    health_service = health.aio.HealthServicer()
    for name in ("", ENGINE_SERVICE):
        await health_service.set(name, SERVING)
    stall = [0.0]
    watch = asyncio.create_task(server._watch_progress(lambda: stall[0], 3.0, health_service))
    try:
        stall[0] = 2.9
        await asyncio.sleep(0.1)
        assert await _statuses(health_service) == {SERVING}, "within the limit"
        stall[0] = 3.1
        await asyncio.sleep(0.1)
        assert await _statuses(health_service) == {NOT_SERVING}
        stall[0] = 0.0
        await asyncio.sleep(0.1)
        assert await _statuses(health_service) == {SERVING}
        assert not watch.done(), "the watch goes on: a stall is no reason to stop"
    finally:
        watch.cancel()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_stall_timeout_that_is_not_positive_is_refused_by_name(value: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from taco_llm.engine_worker.frontend.args import parse

    with pytest.raises(SystemExit) as exit_info:
        parse(["--engine-stall-timeout", value])
    assert exit_info.value.code == 2
    assert "--engine-stall-timeout must be a positive number of seconds" in capsys.readouterr().err


def test_the_stall_timeout_defaults_to_a_minute() -> None:
    from taco_llm.engine_worker.frontend.args import DEFAULT_ENGINE_STALL_TIMEOUT, build_parser

    assert build_parser().parse_args([]).engine_stall_timeout == DEFAULT_ENGINE_STALL_TIMEOUT == 60.0
    assert math.isfinite(DEFAULT_ENGINE_STALL_TIMEOUT)


def _config() -> CacheServiceConfig:
    return CacheServiceConfig(grpc_host="127.0.0.1", grpc_port=0, kv_budget_bytes=1 << 20, redis_url=None,
                              min_access_threshold=1, count_hits=False)


async def _serve(servicer: KVBlockStoreServicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    grpc_server = grpc.aio.server()
    kv_cache_pb2_grpc.add_KVBlockStoreServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port(f"127.0.0.1:{port}")
    await grpc_server.start()
    return grpc_server, port


async def test_the_worker_keeps_the_last_incarnation_through_an_outage_and_takes_the_next_one() -> None:
    first = KVBlockStoreServicer(_config())
    grpc_server, port = await _serve(first)
    reader = CacheServiceIncarnation(f"127.0.0.1:{port}", interval=0.05)
    assert reader.latest == "", "empty until the service answered"
    reading = asyncio.create_task(reader.run())
    try:
        await _until(lambda: reader.latest == first.incarnation)
        await grpc_server.stop(0)
        await asyncio.sleep(0.3)
        assert reader.latest == first.incarnation, "a service that does not answer is not known to have restarted"
        second = KVBlockStoreServicer(_config())
        grpc_server, _ = await _serve(second, port)
        await _until(lambda: reader.latest == second.incarnation)
    finally:
        reading.cancel()
        await grpc_server.stop(0)


async def _until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    async def wait() -> None:
        while not condition():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(wait(), timeout)
