"""The worker's registry entry (engine_worker/frontend/registry.py) against a real redis-server: no engine."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from taco_llm.engine_worker.frontend.args import build_parser
from taco_llm.engine_worker.frontend.registry import Registrar, registry_options
from taco_llm.protos import registry_pb2
from taco_llm.protos.registry_keys import DEFAULT_TTL_SECONDS, REGISTRY_KEY_PREFIX

from .support import RedisServer, free_port

TTL = 1.5  # seconds: short, so that expiry is seen quickly


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"), persist=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def reader(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain (blocking) client: each of its calls is a local round trip, too short to starve the loop."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


def _record(client: redis.Redis, key: str) -> registry_pb2.WorkerRecord | None:
    raw = client.get(key)
    if raw is None:
        return None
    record = registry_pb2.WorkerRecord()
    record.ParseFromString(raw)  # type: ignore[arg-type]
    return record


async def _wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_the_record_appears_with_its_ttl_and_stop_deletes_it(redis_server: RedisServer,
                                                                   reader: redis.Redis) -> None:
    registrar = Registrar(redis_server.url, "10.1.2.3:50051", ["m", "m-lora"], ttl=TTL)
    await registrar.start()
    try:
        assert registrar.key == REGISTRY_KEY_PREFIX + registrar.record.worker_id
        record = _record(reader, registrar.key)
        assert record is not None
        assert record.address == "10.1.2.3:50051"
        assert list(record.served_model_names) == ["m", "m-lora"]
        assert len(record.worker_id) == 32
        assert 0 < record.started_unix_ms <= record.heartbeat_unix_ms <= time.time() * 1000
        assert 0 < reader.pttl(registrar.key) <= TTL * 1000
    finally:
        await registrar.stop()
    assert reader.get(registrar.key) is None, "stop deletes the key at once"


async def test_heartbeats_keep_the_record_past_its_ttl(redis_server: RedisServer, reader: redis.Redis) -> None:
    registrar = Registrar(redis_server.url, "h:1", ["m"], ttl=TTL)
    await registrar.start()
    try:
        first = _record(reader, registrar.key)
        await asyncio.sleep(TTL * 2)
        later = _record(reader, registrar.key)
        assert first is not None and later is not None, "the heartbeat rewrote the key before it expired"
        assert later.heartbeat_unix_ms > first.heartbeat_unix_ms
        assert later.started_unix_ms == first.started_unix_ms
    finally:
        await registrar.stop()


async def test_a_stopped_heartbeat_expires_within_the_ttl(redis_server: RedisServer, reader: redis.Redis) -> None:
    registrar = Registrar(redis_server.url, "h:1", ["m"], ttl=TTL)
    await registrar.start()
    assert registrar.heartbeats is not None
    # A frozen or killed worker: its heartbeat stops and nobody deletes the key.
    registrar.heartbeats.cancel()
    killed = time.monotonic()
    assert await _wait_for(lambda: not reader.exists(registrar.key), TTL + 1.0)
    assert time.monotonic() - killed <= TTL + 0.5
    await registrar.client.aclose()


async def test_a_redis_restart_is_survived(redis_server: RedisServer, reader: redis.Redis,
                                           caplog: pytest.LogCaptureFixture) -> None:
    registrar = Registrar(redis_server.url, "h:1", ["m"], ttl=TTL)
    await registrar.start()
    try:
        redis_server.stop()
        # Beats fail while Redis is down; the worker's loop is never blocked by them.
        started = time.monotonic()
        for _ in range(10):
            await asyncio.sleep(TTL / 10)
        assert time.monotonic() - started < TTL * 1.5
        assert not registrar.reachable
        warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(warnings) == 1, "an outage is logged once, not on every beat"
        redis_server.start()  # empty: persistence is off, so only a heartbeat brings the key back
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert await _wait_for(lambda: bool(client.exists(registrar.key)), TTL * 2)
        finally:
            client.close()
        assert registrar.reachable
    finally:
        await registrar.stop()


async def test_an_unreachable_redis_does_not_delay_start_or_stop() -> None:
    registrar = Registrar(f"redis://127.0.0.1:{free_port()}/0", "h:1", ["m"], ttl=TTL)
    started = time.monotonic()
    await registrar.start()
    await registrar.stop()
    assert time.monotonic() - started < TTL + 1.5
    assert not registrar.reachable


def _options(argv: list[str]) -> object:
    parser = build_parser()
    return registry_options(parser.parse_args(argv), parser)


def test_flags_default_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert _options([]) is None
    options = _options(["--registry-url", "redis://r:6379/0", "--grpc-port", "7000"])
    assert options is not None
    assert options.ttl == DEFAULT_TTL_SECONDS  # type: ignore[attr-defined]
    assert options.advertise_address == "127.0.0.1:7000"  # type: ignore[attr-defined]
    wildcard = _options(["--registry-url", "redis://r", "--grpc-host", "0.0.0.0", "--grpc-port", "7000"])
    assert wildcard.advertise_address == f"{socket.gethostbyname(socket.gethostname())}:7000"  # type: ignore[attr-defined]
    given = _options(["--registry-url", "redis://r", "--advertise-address", "worker-3:50051", "--registry-ttl", "2"])
    assert (given.advertise_address, given.ttl) == ("worker-3:50051", 2.0)  # type: ignore[attr-defined]
    for argv, flag in ((["--registry-url", "http://r:6379"], "--registry-url"),
                       (["--registry-url", "redis://r", "--registry-ttl", "0"], "--registry-ttl"),
                       (["--registry-url", "redis://r", "--advertise-address", "nohost"], "--advertise-address"),
                       (["--advertise-address", "h:1"], "--advertise-address")):
        with pytest.raises(SystemExit):
            _options(argv)
        assert flag in capsys.readouterr().err
