"""A worker cut off by the network, as hosts and containers are: no connection is refused, packets just
stop. The gateway must notice through gRPC keepalive and its health deadlines, migrate the worker's
running stream, stop routing to it, and take it back when the network returns.

Two hosts on one machine: a network namespace holds one synthetic engine (bench/synthetic_engine.py, a
gRPC server on the engine contract), reached over a veth pair; the other engine listens on loopback. A
real `taco_llm gateway` process routes to both. The cut is the namespace's end of the pair going down,
with the gateway side's neighbour entry pinned: the gateway's packets leave and are never answered, and
new connections hang instead of being refused, as across a partitioned network.

Needs root and `ip netns` (iproute2); skipped, with the reason, where either is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .support import ROOT, Process, free_port, http_status, start, wait_until

MODEL = "synthetic"
# The bound documented in docs/fleet.md: from the cut to the stream's next token (from the other worker)
# and to the worker's being out of rotation. The keepalive alone closes the connection within 5 s.
PARTITION_BOUND_SECONDS = 10.0
# The stream: long enough to be running on the cut worker when the cut comes, short enough for the test.
TOKEN_INTERVAL = 0.02
MAX_TOKENS = 400
TOKENS_BEFORE_CUT = 20
# Once the link is back: TCP's retransmitted SYN and gRPC's reconnect backoff (2 s at most) bring it back.
REJOIN_WITHIN = 20.0


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    subprocess.run(command, check=True, capture_output=True, timeout=10)


@dataclass
class Namespace:
    """A network namespace joined to this one by a veth pair: `address` is its side's IPv4 address."""

    name: str
    host_link: str
    inner_link: str
    address: str

    def cut(self) -> None:
        _ip("link", "set", self.inner_link, "down", namespace=self.name)

    def restore(self) -> None:
        _ip("link", "set", self.inner_link, "up", namespace=self.name)


@pytest.fixture(scope="module")
def namespace() -> Iterator[Namespace]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: no network namespace for a partition")
    if os.geteuid() != 0:
        pytest.skip("`ip netns` needs root: no network namespace for a partition")
    tag = os.getpid() % 50_000
    subnet = f"10.{231 + tag // 250 % 20}.{tag % 250}"
    made = Namespace(f"taco-part-{tag}", f"tph{tag}", f"tpn{tag}", f"{subnet}.2")
    try:
        _ip("netns", "add", made.name)
    except (subprocess.CalledProcessError, OSError) as error:
        stderr = getattr(error, "stderr", b"") or b""
        pytest.skip(f"`ip netns add` is not permitted here: {stderr.decode(errors='replace').strip() or error}")
    try:
        _ip("link", "add", made.host_link, "type", "veth", "peer", "name", made.inner_link)
        _ip("link", "set", made.inner_link, "netns", made.name)
        _ip("addr", "add", f"{subnet}.1/30", "dev", made.host_link)
        _ip("link", "set", made.host_link, "up")
        _ip("addr", "add", f"{made.address}/30", "dev", made.inner_link, namespace=made.name)
        _ip("link", "set", made.inner_link, "up", namespace=made.name)
        _ip("link", "set", "lo", "up", namespace=made.name)
        # Pinned, so that while the far end is down the kernel still sends (into nothing) instead of
        # answering "no route to host" after a failed ARP: a partition refuses nothing.
        mac = subprocess.run(["ip", "netns", "exec", made.name, "cat", f"/sys/class/net/{made.inner_link}/address"],
                             check=True, capture_output=True, text=True, timeout=10).stdout.strip()
        _ip("neigh", "replace", made.address, "lladdr", mac, "dev", made.host_link, "nud", "permanent")
        yield made
    finally:
        subprocess.run(["ip", "link", "del", made.host_link], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", made.name], capture_output=True, timeout=10)


def _engine(address: tuple[str, int], log: Path, *, namespace: str | None = None) -> subprocess.Popen[bytes]:
    host, port = address
    command = [sys.executable, str(ROOT / "bench" / "synthetic_engine.py"), "--host", host, "--port", str(port),
               "--served-model-name", MODEL, "--token-interval", str(TOKEN_INTERVAL)]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


@dataclass
class Partitioned:
    gateway: Process
    base_url: str
    far: str    # the engine in the namespace, as the gateway names it
    near: str   # the engine on loopback

    def metric(self, name: str, **labels: str) -> float | None:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return None

    def ready(self, worker: str) -> bool:
        return self.metric("taco_llm_worker_ready", worker=worker) == 1


@pytest.fixture(scope="module")
def partitioned(namespace: Namespace, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Partitioned]:
    logs = tmp_path_factory.mktemp("partition")
    far, near = (namespace.address, free_port()), ("127.0.0.1", free_port())
    engines = [_engine(far, logs / "far-engine.log", namespace=namespace.name), _engine(near, logs / "near-engine.log")]
    gateway: Process | None = None
    try:
        port = free_port()
        # round_robin goes by address: the first request goes to the far engine (10.x sorts before 127.x).
        gateway = start("partition-gateway", ["gateway", "--engine", f"{far[0]}:{far[1]}", "--engine",
                                              f"{near[0]}:{near[1]}", "--routing", "round_robin", "--port",
                                              str(port)], logs)
        stack = Partitioned(gateway, f"http://127.0.0.1:{port}", f"{far[0]}:{far[1]}", f"{near[0]}:{near[1]}")
        wait_until(gateway, lambda: http_status(f"{stack.base_url}/health") == 200
                   and stack.ready(stack.far) and stack.ready(stack.near), timeout=60)
        yield stack
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.terminate()
            engine.wait(10)


def _until(condition: Callable[[], bool], within: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, f"{what}: not within {within} s"
        time.sleep(0.05)
    return time.monotonic() - started


@dataclass
class StreamLog:
    """A streamed completion read in a thread: when each token came, how it ended."""

    arrivals: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None


def _stream(base_url: str, log: StreamLog) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        for chunk in client.completions.create(model=MODEL, prompt="tell a long story", max_tokens=MAX_TOKENS,
                                               stream=True):
            for choice in chunk.choices:
                if choice.text:
                    log.arrivals.append(time.monotonic())
                if choice.finish_reason:
                    log.finish_reason = choice.finish_reason
    except BaseException as error:  # reported by the test
        log.error = error


def test_a_partitioned_worker_is_dropped_and_its_stream_migrates_within_the_bound(partitioned: Partitioned,
                                                                                   namespace: Namespace) -> None:
    migrated_before = partitioned.metric("taco_llm_router_migrations_total", outcome="resumed") or 0.0
    log = StreamLog()
    reader = threading.Thread(target=_stream, args=(partitioned.base_url, log), daemon=True)
    reader.start()
    _until(lambda: len(log.arrivals) >= TOKENS_BEFORE_CUT or log.error is not None, 20, "the stream's first tokens")
    assert log.error is None, log.error
    # The gauge is published at each health round (every 0.5 s), which the first tokens can beat.
    _until(lambda: partitioned.metric("taco_llm_worker_load", worker=partitioned.far, kind="gateway_streams") == 1,
           5, "the stream on the engine behind the veth")

    namespace.cut()
    cut = time.monotonic()
    tokens_at_cut = len(log.arrivals)
    try:
        out_of_rotation = _until(lambda: not partitioned.ready(partitioned.far), PARTITION_BOUND_SECONDS,
                                 "the cut-off worker out of rotation")
        reader.join(PARTITION_BOUND_SECONDS + MAX_TOKENS * TOKEN_INTERVAL * 2 + 10)
        assert not reader.is_alive(), "the stream hung"
        assert log.error is None, f"the client saw an error: {log.error!r}"
        assert log.finish_reason == "length"
        resumed = next(t for t in log.arrivals[tokens_at_cut:] if t > cut) - cut
        migrated = (partitioned.metric("taco_llm_router_migrations_total", outcome="resumed") or 0.0) - migrated_before
        assert migrated == 1, "the stream was not migrated"
        assert resumed <= PARTITION_BOUND_SECONDS, f"the stream resumed {resumed:.1f} s after the cut"
        assert partitioned.ready(partitioned.near)
        print(f"\npartition: out of rotation {out_of_rotation:.1f} s after the cut, the stream's next token "
              f"(from the other worker) {resumed:.1f} s after it (bound {PARTITION_BOUND_SECONDS:g} s)")
    finally:
        namespace.restore()
    rejoined = _until(lambda: partitioned.ready(partitioned.far), REJOIN_WITHIN, "the worker rejoins")
    print(f"partition: ready again {rejoined:.1f} s after the link came back")
