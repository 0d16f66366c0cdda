"""The worker's registry entry (engine_worker/frontend/registry.py) against a real redis-server: no engine."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from taco_llm.engine_worker.frontend.args import build_parser
from taco_llm.engine_worker.frontend.registry import (
    AdvertiseError,
    Registrar,
    advertise_address,
    registry_is_local,
    registry_options,
)
from taco_llm.protos import registry_pb2
from taco_llm.protos.registry_keys import DEFAULT_TTL_SECONDS, INSTANCE_ENV, REGISTRY_KEY_PREFIX

from .support import RedisServer, free_port

TTL = 1.5  # seconds: short, so that expiry is seen quickly



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
        # Gateways keep a member whose key they miss for this long (a Redis that lost its keys).
        assert record.ttl_ms == TTL * 1000
        # The instance outlives the process: this host's name and the advertised port, unless the
        # environment names it.
        assert record.instance == f"{socket.gethostname()}:50051"
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


async def test_the_instance_comes_from_the_environment(redis_server: RedisServer, reader: redis.Redis,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INSTANCE_ENV, "worker-7")
    first, second = (Registrar(redis_server.url, "h:1", ["m"], ttl=TTL) for _ in range(2))
    assert first.record.instance == second.record.instance == "worker-7"
    assert first.record.worker_id != second.record.worker_id, "each process is an incarnation of its own"
    assert Registrar(redis_server.url, "h:1", ["m"], instance="given").record.instance == "given"


def _options(argv: list[str]) -> object:
    parser = build_parser()
    return registry_options(parser.parse_args(argv), parser)


def test_flags_default_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert _options([]) is None
    options = _options(["--registry-url", "redis://127.0.0.1:6379/0", "--grpc-port", "7000"])
    assert options is not None
    assert options.ttl == DEFAULT_TTL_SECONDS  # type: ignore[attr-defined]
    assert options.advertise_address == "127.0.0.1:7000"  # type: ignore[attr-defined]
    given = _options(["--registry-url", "redis://r", "--advertise-address", "worker-3:50051", "--registry-ttl", "2"])
    assert (given.advertise_address, given.ttl) == ("worker-3:50051", 2.0)  # type: ignore[attr-defined]
    assert options.publish_prefix_cache is None, "on unless turned off"  # type: ignore[attr-defined]
    assert _options(["--registry-url", "redis://127.0.0.1:6379/0", "--no-publish-prefix-cache"]
                    ).publish_prefix_cache is False  # type: ignore[union-attr,attr-defined]
    for argv, flag in ((["--registry-url", "http://r:6379"], "--registry-url"),
                       (["--registry-url", "redis://r", "--registry-ttl", "0"], "--registry-ttl"),
                       (["--registry-url", "redis://r", "--advertise-address", "nohost"], "--advertise-address"),
                       (["--advertise-address", "h:1"], "--advertise-address"),
                       (["--publish-prefix-cache"], "--publish-prefix-cache"),
                       # A loopback --grpc-host with a registry elsewhere: no gateway there could dial it.
                       (["--registry-url", "redis://r"], "--advertise-address")):
        with pytest.raises(SystemExit):
            _options(argv)
        assert flag in capsys.readouterr().err


# -- the advertised address ------------------------------------------------------------------------


def _own_address() -> str:
    """A non-loopback IPv4 address of this machine, on an interface that is up."""
    import psutil

    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    pytest.skip("this machine has no non-loopback IPv4 address on an interface that is up")


def test_a_wildcard_host_advertises_the_interface_that_routes_to_the_registry() -> None:
    own = _own_address()
    # The registry on another interface of this machine stands for one on another host: the kernel's
    # route to it leaves from that interface, whatever /etc/hosts says this host's name is (Debian maps
    # it to 127.0.1.1, and this machine to 127.0.0.1: the name's address was what the worker registered).
    for wildcard in ("0.0.0.0", "::"):
        options = _options(["--registry-url", f"redis://{own}:6379/1", "--grpc-host", wildcard, "--grpc-port", "7000"])
        assert options.advertise_address == f"{own}:7000"  # type: ignore[attr-defined]
    assert not registry_is_local(f"redis://{own}:6379/1")
    # A registry on loopback: gateways reading it are on this machine, so loopback is right.
    for url in ("redis://127.0.0.1:6379/0", "redis://localhost/0", "unix:///run/redis.sock?db=1"):
        assert registry_is_local(url)
        assert advertise_address("0.0.0.0", 7000, url) == "127.0.0.1:7000", url
    # A host given explicitly is advertised as it is.
    assert advertise_address(own, 7000, f"redis://{own}:6379/1") == f"{own}:7000"
    assert advertise_address("127.0.0.1", 7000, "redis://127.0.0.1:6379/0") == "127.0.0.1:7000"


def test_a_loopback_address_is_refused_for_a_registry_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    own = _own_address()
    for host in ("127.0.0.1", "localhost", "127.0.1.1", "::1"):
        with pytest.raises(AdvertiseError, match="--advertise-address") as excinfo:
            advertise_address(host, 7000, f"redis://{own}:6379/1")
        assert "--grpc-host" in str(excinfo.value)
    # Asked for, it is taken.
    options = _options(["--registry-url", f"redis://{own}:6379/1", "--advertise-address", "127.0.0.1:7000"])
    assert options.advertise_address == "127.0.0.1:7000"  # type: ignore[attr-defined]
    # Through the worker's flags: an argparse error naming the flag, no traceback.
    with pytest.raises(SystemExit):
        _options(["--registry-url", f"redis://{own}:6379/1", "--grpc-port", "7000"])
    err = capsys.readouterr().err
    assert "--advertise-address" in err and "Traceback" not in err


def test_an_unresolvable_registry_host_falls_back_to_the_default_route() -> None:
    # The registry's container not started yet, say: the address on the default route, never loopback.
    try:
        address = advertise_address("0.0.0.0", 7000, "redis://registry.invalid:6379/1")
    except AdvertiseError as error:
        assert "--advertise-address" in str(error)  # a machine without a default route
        return
    host = address.rpartition(":")[0]
    assert not host.startswith("127."), address


async def test_a_derived_address_is_followed_at_each_heartbeat(redis_server: RedisServer, reader: redis.Redis) -> None:
    # A container reconnected to its network may come back at another address: the record follows it,
    # under the same worker_id (gateways re-dial the same member there).
    addresses = iter(["10.0.0.5:7000", "10.0.0.9:7000"])
    current = {"address": "10.0.0.5:7000"}
    registrar = Registrar(redis_server.url, next(addresses), ["m"], ttl=TTL, readdress=lambda: current["address"])
    await registrar.start()
    try:
        current["address"] = next(addresses)
        assert await _wait_for(lambda: getattr(_record(reader, registrar.key), "address", "") == "10.0.0.9:7000",
                               TTL), "the new address was not registered"
        # While the address cannot be told (cut off: no route to the registry), the last one stays.
        current["address"] = None  # type: ignore[assignment]
        await registrar.beat()
        record = _record(reader, registrar.key)
        assert record is not None and record.address == "10.0.0.9:7000"
    finally:
        await registrar.stop()


def test_only_a_derived_address_is_derived_again() -> None:
    own = _own_address()
    derived = _options(["--registry-url", f"redis://{own}:6379/1", "--grpc-host", "0.0.0.0", "--grpc-port", "7000"])
    assert derived.current_address() == f"{own}:7000"  # type: ignore[attr-defined]
    given = _options(["--registry-url", f"redis://{own}:6379/1", "--advertise-address", "10.9.9.9:7000"])
    assert given.current_address() is None  # type: ignore[attr-defined]
    explicit = _options(["--registry-url", f"redis://{own}:6379/1", "--grpc-host", own, "--grpc-port", "7000"])
    assert explicit.current_address() is None  # type: ignore[attr-defined]


async def test_a_hung_address_lookup_neither_delays_beats_nor_piles_up(redis_server: RedisServer,
                                                                        reader: redis.Redis) -> None:
    # A resolver that hangs (cut off from DNS): the beats go on on time, and one lookup thread waits,
    # not one more per beat.
    release = threading.Event()
    calls = []

    def hung() -> str | None:
        calls.append(time.monotonic())
        release.wait(30)
        return None

    registrar = Registrar(redis_server.url, "10.0.0.5:7000", ["m"], ttl=TTL, readdress=hung)
    await registrar.start()
    try:
        first = _record(reader, registrar.key)
        await asyncio.sleep(TTL)  # three beats
        later = _record(reader, registrar.key)
        assert first is not None and later is not None and later.heartbeat_unix_ms > first.heartbeat_unix_ms
        assert len(calls) == 1, f"{len(calls)} lookups started while the first one hung"
    finally:
        release.set()
        await registrar.stop()
