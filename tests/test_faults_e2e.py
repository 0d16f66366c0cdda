"""Faults with real processes: each costs no request, or fails it with a clean error, and leaves the
stack serving.

- A client that reads its stream slowly, on the suite's shared `stack`: a normal stream beside it
  finishes with the text it gives alone, and the gateway holds at most MAX_PENDING of the slow stream's
  messages (its gauge taco_llm_gateway_stream_buffered_messages); the rest waits at the worker, held
  back by gRPC's flow control.
- 200 streams opened and dropped after their first chunk, on the shared `stack`: the worker's running
  count returns to 0, and the gateway's and the worker's file descriptors, memory and connections to
  the worker return to their warm levels.
- `kill -9` of a cache service (its own process, as on a fleet: `taco_llm cache-service`) while a
  worker with the prefix-KV offload and the Lookahead Cache uses it; then its Redis stopped and started.

Engines started here: one worker (`taco_llm serve --cache-service ...`, offload and lookahead on, float32),
besides the shared `stack`, which is the greedy reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import openai
import psutil
import pytest
from openai.types.chat import ChatCompletionMessageParam

from taco_llm.gateway.from_engine import MAX_PENDING, coalesced
from taco_llm.protos import (
    engine_pb2,
    engine_pb2_grpc,
    kv_cache_pb2,
    kv_cache_pb2_grpc,
    lookahead_pb2,
    lookahead_pb2_grpc,
)

from .support import (
    ROOT,
    Footprint,
    Process,
    RedisServer,
    Stack,
    child_pid,
    connections_to,
    free_port,
    http_status,
    process_footprints,
    start,
    start_stack,
    wait_until,
)

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, grpc.RpcError):
            if condition():
                return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} is not in the gateway's /metrics"
    return float(found.group(1))


def load(grpc_address: str) -> engine_pb2.Load:
    with grpc.insecure_channel(grpc_address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


def idle(grpc_address: str) -> bool:
    now = load(grpc_address)
    return now.num_running_requests == 0 and now.num_waiting_requests == 0 and now.num_active_streams == 0


# ---------------------------------------------------------------------------------------------------
# The bound, without processes: a source far faster than a client that never takes.


def test_the_relay_stops_reading_a_source_once_its_buffer_is_full() -> None:
    read = 0

    async def source() -> AsyncIterator[engine_pb2.GenerateResponse]:
        nonlocal read
        for i in range(10 * MAX_PENDING):
            await asyncio.sleep(0)  # as a gRPC read would
            read += 1
            yield engine_pb2.GenerateResponse(delta=engine_pb2.Delta(
                choices=[engine_pb2.ChoiceDelta(index=0, token_ids=[i])]))

    async def main() -> list[int]:
        batches = coalesced([source()])
        sizes = [len(await anext(batches))]
        await asyncio.sleep(0.2)  # a client that does not take: the reading task runs ahead
        sizes.append(len(await anext(batches)))
        await batches.aclose()
        return sizes

    first, second = asyncio.run(main())
    assert second == MAX_PENDING, f"{second} messages were buffered for a client that took none"
    assert read <= first + second + 1, f"the reading task read {read} messages, its client took {first + second}"


# ---------------------------------------------------------------------------------------------------
# A slow reader, on the shared stack.


@dataclass
class SlowReader:
    """A raw HTTP/1.1 client with a 4 KiB receive buffer that reads a little at a time."""

    base_url: str
    body: dict[str, object]
    received: bytearray = field(default_factory=bytearray)
    sock: socket.socket = field(init=False)

    def __post_init__(self) -> None:
        url = urlsplit(self.base_url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((url.hostname or "127.0.0.1", url.port or 80))
        payload = json.dumps(self.body).encode()
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        self.sock.settimeout(60)

    def read_some(self, size: int = 1024) -> int:
        got = self.sock.recv(size)
        self.received += got
        return len(got)

    @property
    def done(self) -> bool:
        return b"data: [DONE]" in self.received

    def close(self) -> None:
        self.sock.close()


def buffered(base_url: str) -> float:
    return metric(base_url, "taco_llm_gateway_stream_buffered_messages")


def normal_stream_beside(client: openai.OpenAI, messages: list[ChatCompletionMessageParam],
                         into: dict[str, str], max_tokens: int = 32) -> threading.Thread:
    def run() -> None:
        stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True)
        into["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_slow_reader_stalls_no_one_and_the_gateway_buffers_a_bounded_part_of_its_reply(
        stack: Stack, client: openai.OpenAI) -> None:
    """On the real engine: a stream beside the slow one finishes, with the text it gives alone, while the
    slow one has most of its reply still to come; the gateway never holds more than MAX_PENDING of its
    messages; when it leaves, its request ends in the engine. (Whether the gateway's buffer fills here
    depends on the kernel's socket buffers, which take megabytes on loopback: the test below fills it.)"""
    question: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three rivers."}]
    alone = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=32)
    slow = SlowReader(stack.base_url, {
        "model": MODEL, "messages": [{"role": "user", "content": "Count from one to a thousand."}],
        "stream": True, "max_tokens": 1500, "ignore_eos": True,
    })
    try:
        slow.read_some()
        assert slow.received.startswith(b"HTTP/1.1 200"), bytes(slow.received[:200])
        beside: dict[str, str] = {}
        thread = normal_stream_beside(client, question, beside)
        peak = 0.0
        while thread.is_alive():
            slow.read_some()
            peak = max(peak, buffered(stack.base_url))
            time.sleep(0.25)
        assert beside.get("text") == alone.choices[0].message.content, "the stream beside the slow one changed"
        for _ in range(8):  # the slow one goes on
            slow.read_some()
            peak = max(peak, buffered(stack.base_url))
            time.sleep(0.25)
        assert not slow.done, "the slow reader got its whole reply: it was not slow enough to test anything"
        assert peak <= MAX_PENDING, f"{peak} messages buffered for one stream (bound {MAX_PENDING})"
    finally:
        slow.close()
    # The client left: its request ends in the engine too.
    wait_for(lambda: idle(stack.grpc_address), "the worker to end the slow reader's request", timeout=15)
    assert buffered(stack.base_url) == 0


@dataclass
class SyntheticStack:
    base_url: str
    gateway: Process
    engine: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def synthetic(log_dir: Path) -> Iterator[SyntheticStack]:
    """The gateway in front of bench/synthetic_engine.py, which writes tokens as fast as gRPC's flow
    control lets it: a client that falls behind is behind at once, by as much as the gateway will take."""
    port = free_port()
    with (log_dir / "faults-synthetic-engine.log").open("wb") as log:
        engine = subprocess.Popen([sys.executable, str(ROOT / "bench" / "synthetic_engine.py"), "--port", str(port),
                                   "--served-model-name", MODEL, "--max-model-len", "10000000"],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        http_port = free_port()
        gateway = start("faults-synthetic-gateway", ["gateway", "--engine", f"127.0.0.1:{port}", "--port",
                                                     str(http_port)], log_dir)
        base_url = f"http://127.0.0.1:{http_port}"
        wait_until(gateway, lambda: http_status(f"{base_url}/health") == 200, timeout=60)
        yield SyntheticStack(base_url, gateway, engine)
        gateway.stop()
    finally:
        engine.terminate()
        engine.wait(10)


def test_the_gateway_holds_a_bounded_part_of_a_slow_readers_reply(synthetic: SyntheticStack) -> None:
    slow = SlowReader(synthetic.base_url, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                           "stream": True, "max_tokens": 5_000_000})
    client = openai.OpenAI(base_url=f"{synthetic.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    gateway = psutil.Process(synthetic.gateway.popen.pid)
    try:
        wait_for(lambda: slow.read_some() >= 0 and buffered(synthetic.base_url) >= MAX_PENDING,
                 "the gateway's buffer for the slow reader to fill")
        full_rss = gateway.memory_info().rss
        beside: dict[str, str] = {}
        thread = normal_stream_beside(client, [{"role": "user", "content": "y"}], beside, max_tokens=64)
        thread.join(30)
        assert len(beside.get("text", "")) == 64 * 4, "the stream beside the slow one did not finish"
        for _ in range(12):  # meanwhile the engine would write thousands of tokens a second
            slow.read_some()
            now = buffered(synthetic.base_url)
            assert now <= MAX_PENDING, f"{now} messages buffered for one stream (bound {MAX_PENDING})"
            time.sleep(0.25)
        grown = gateway.memory_info().rss - full_rss
        assert grown < 16 * 2**20, f"the gateway's RSS grew {grown / 2**20:.0f} MiB while its slow client read"
        assert not slow.done
    finally:
        slow.close()
    wait_for(lambda: buffered(synthetic.base_url) == 0, "the slow stream's buffer to be released")


# ---------------------------------------------------------------------------------------------------
# Streams opened and dropped, on the shared stack.


async def _open_and_drop(http: httpx.AsyncClient, count: int, concurrency: int) -> None:
    """`count` streams, each dropped after its first chunk (the role chunk) or its first token: both
    ways out of the gateway's stream."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell story number {i}."}],
                "stream": True, "max_tokens": 256, "ignore_eos": True}
        async with gate, http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200, await reply.aread()
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and (i % 2 == 0 or '"content":""' not in line):
                    break

    await asyncio.gather(*(one(i) for i in range(count)))


def _drop(stack: Stack, count: int) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
            await _open_and_drop(http, count, concurrency=32)

    asyncio.run(main())


@dataclass
class Levels:
    footprints: dict[str, Footprint]
    channels: int


def levels(stack: Stack) -> Levels:
    serve = stack.process.popen.pid
    grpc_port = int(stack.grpc_address.rsplit(":", 1)[1])
    return Levels(process_footprints(serve), connections_to(child_pid(serve, "taco_llm.gateway"), grpc_port))


def assert_back_to(warm: Levels, now: Levels, *, memory_slack: float = 0.10, fd_slack: int = 4) -> None:
    assert now.channels <= warm.channels, f"the gateway holds {now.channels} connections to the worker, " \
                                          f"{warm.channels} when warm"
    for name, before in warm.footprints.items():
        after = now.footprints.get(name)
        assert after is not None, f"{name} is gone"
        assert after.fds <= before.fds + fd_slack, f"{name}: {after.fds} open fds, {before.fds} when warm"
        assert after.rss <= before.rss * (1 + memory_slack), \
            f"{name}: RSS {after.rss / 2**20:.0f} MiB, {before.rss / 2**20:.0f} MiB when warm"


def test_200_dropped_streams_leave_no_generation_fds_channels_or_memory_behind(stack: Stack) -> None:
    _drop(stack, 16)  # warm-up: the same shape
    wait_for(lambda: idle(stack.grpc_address), "the warm-up's dropped requests to end in the engine")
    warm = levels(stack)
    _drop(stack, 200)
    # Orphans would run on for minutes: 200 x 256 tokens at a few hundred tokens a second.
    wait_for(lambda: idle(stack.grpc_address), "the dropped requests to end in the engine (orphaned generation)",
             timeout=15)
    time.sleep(1.0)  # closed sockets leave the fd tables
    assert_back_to(warm, levels(stack))
    # And the stack still serves.
    with httpx.Client(base_url=stack.base_url, timeout=120) as http:
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert reply.status_code == 200, reply.text


# ---------------------------------------------------------------------------------------------------
# A worker with the prefix-KV offload and the Lookahead Cache on a cache service of its own, on Redis.

BLOCK = 128  # vLLM's CPU block size, in tokens
# A KV cache of 12 blocks (float32, 5.9 MB each; vLLM keeps one back): two 9-block prompts evict everything
# else. Other prompts stay short: each prefill costs seconds on shared CPUs.
SMALL_KV = ["--dtype", "float32", "--max-model-len", "1280", "--max-num-seqs", "8",
            "--kv-cache-memory-bytes", "72000000", "--seed", "0"]


def tokens(seed: int, count: int) -> list[int]:
    """A deterministic prompt of `count` token ids (the vocabulary has 49152)."""
    return [100 + (seed * 7919 + i * 104729 + i * i * 31) % 40000 for i in range(count)]


@dataclass
class FaultStack:
    """Redis, a cache service on it (`taco_llm cache-service`, its own process, restartable on its port)
    and `taco_llm serve --cache-service` with offload and lookahead on."""

    redis: RedisServer
    log_dir: Path
    cache_port: int
    metrics_port: int  # the worker's
    cache: Process | None = None
    serve: Stack | None = None
    restarts: int = 0

    @property
    def cache_address(self) -> str:
        return f"127.0.0.1:{self.cache_port}"

    def start_cache(self) -> None:
        self.restarts += 1
        self.cache = start(f"faults-cache-service-{self.restarts}", [
            "cache-service", "--grpc-host", "127.0.0.1", "--grpc-port", str(self.cache_port), "--memory", "256M",
            "--redis-url", self.redis.url], self.log_dir)
        wait_until(self.cache, lambda: self.cache_stats() is not None, timeout=60)

    def cache_stats(self) -> kv_cache_pb2.StatsResponse | None:
        with grpc.insecure_channel(self.cache_address) as channel:
            try:
                return kv_cache_pb2_grpc.KVBlockStoreStub(channel).Stats(kv_cache_pb2.StatsRequest(), timeout=5)
            except grpc.RpcError:
                return None

    def stats(self) -> kv_cache_pb2.StatsResponse:
        stats = self.cache_stats()
        assert stats is not None, "the cache service does not answer"
        return stats

    def records(self) -> int:
        """Sequences in the lookahead index, read through the cache service from Redis."""
        import redis

        with redis.Redis(port=self.redis.port) as client:
            namespaces = [key.decode().removeprefix("taco_llm:lookahead:") for key in client.scan_iter("taco_llm:*")]
        with grpc.insecure_channel(self.cache_address) as channel:
            stub = lookahead_pb2_grpc.LookaheadIndexStub(channel)
            return sum(stub.GetStats(lookahead_pb2.GetStatsRequest(namespace=n), timeout=10).records
                       for n in namespaces)

    @property
    def stack(self) -> Stack:
        assert self.serve is not None
        return self.serve

    def worker_metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.fixture(scope="module")
def faults(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    config_dir = tmp_path_factory.mktemp("faults-lookahead")
    (config_dir / "lookahead_cache_config.json").write_text(json.dumps({"log_interval": 5}))
    deployment = FaultStack(RedisServer(free_port(), tmp_path_factory.mktemp("faults-redis")), log_dir, free_port(),
                            metrics_port=free_port())
    deployment.redis.start()
    try:
        deployment.start_cache()
        deployment.serve = start_stack("serve-faults", [
            *SMALL_KV, "--enable-prefix-cache-offload", "--apc-offload-lookup-timeout", "3",
            "--cache-service", deployment.cache_address, "--lookahead-cache-config-dir", str(config_dir),
            "--metrics-port", str(deployment.metrics_port)], log_dir)
        yield deployment
    finally:
        if deployment.serve is not None:
            code = deployment.serve.process.stop()
            assert code == 0, f"serve exited with {code}:\n{deployment.serve.process.tail()}"
        if deployment.cache is not None:
            deployment.cache.stop()
        deployment.redis.stop()


def greedy_ids(base_url: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    """Greedy output token ids through the gateway (raises openai.APIStatusError on a refusal)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens,
                                      extra_body={"return_token_ids": True})
    assert reply.choices[0].model_extra is not None
    return list(reply.choices[0].model_extra["token_ids"])


def evict_local(base_url: str, seed: int) -> None:
    """Two long unrelated prompts push everything else out of vLLM's own 12-block cache."""
    for i in range(2):
        greedy_ids(base_url, tokens(10_000 + seed * 10 + i, 9 * BLOCK + 5), max_tokens=1)


def test_kill_9_of_the_cache_service_mid_transfer_costs_no_request(
        faults: FaultStack, stack: Stack) -> None:
    url = faults.stack.base_url
    loaded = tokens(1, 4 * BLOCK + 20)  # loaded back from the cache service once evicted locally
    fresh = [tokens(2 + i, 2 * BLOCK + 10) for i in range(2)]  # stored to it as they finish
    expected = {tuple(p): greedy_ids(stack.base_url, p) for p in [loaded, *fresh]}
    assert greedy_ids(url, loaded) == expected[tuple(loaded)]
    wait_for(lambda: faults.stats().blocks_stored >= 4, "the prompt's blocks to reach the cache service")
    evict_local(url, 1)
    assert faults.cache is not None
    killed = faults.cache

    results: dict[int, list[int] | openai.APIStatusError] = {}

    def send(i: int, prompt: list[int]) -> None:
        try:
            results[i] = greedy_ids(url, prompt)
        except openai.APIStatusError as error:
            results[i] = error

    threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate([loaded, *fresh])]
    for thread in threads:
        thread.start()
    # As soon as the service is reading the evicted prompt's blocks for the worker (or at once, if the
    # load went by before this saw it): kill -9, mid-transfer.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = faults.cache_stats()
        if stats is not None and stats.reads_in_progress > 0:
            break
        time.sleep(0.005)
    killed.popen.kill()
    killed.popen.wait(10)
    for thread in threads:
        thread.join(300)
    for i, prompt in enumerate([loaded, *fresh]):
        outcome = results[i]
        if isinstance(outcome, openai.APIStatusError):
            # A clean failure: the OpenAI error JSON, a retryable status, nothing internal.
            assert outcome.status_code == 503, outcome
            assert "127.0.0.1" not in str(outcome.body) and "Traceback" not in str(outcome.body)
        else:
            assert outcome == expected[tuple(prompt)], f"request {i}: the greedy output changed"

    # While the service is down, requests are served (recomputed) with the same output.
    down = tokens(6, BLOCK + 10)
    assert greedy_ids(url, down) == greedy_ids(stack.base_url, down)
    assert greedy_ids(url, loaded) == expected[tuple(loaded)]

    # Back on its port (empty: blocks live in its memory), the worker stores to it and loads from it again.
    faults.start_cache()
    probe = tokens(7, 2 * BLOCK + 10)
    reference = greedy_ids(stack.base_url, probe)
    seeds = iter(range(100, 200))  # new prompts until one is stored (the worker reconnects with backoff)
    wait_for(lambda: not greedy_ids(url, tokens(next(seeds), BLOCK + 10), max_tokens=1)
             or faults.stats().blocks_stored > 0, "the worker to store to the restarted cache service", 60)
    assert greedy_ids(url, probe) == reference
    evict_local(url, 2)
    served_before = faults.stats().blocks_served
    assert greedy_ids(url, probe) == reference
    assert faults.stats().blocks_served >= served_before + 2, "the restarted service served no blocks"
    assert "Traceback" not in faults.stack.process.log.read_text()


def test_redis_stopped_then_started_costs_no_request_and_the_index_syncs_again(
        faults: FaultStack, stack: Stack) -> None:
    url = faults.stack.base_url
    wait_for(lambda: faults.worker_metric("taco_llm_lookahead_sync_connected") == 1,
             "the worker's lookahead sync to be connected", 60)
    records = faults.records()
    faults.redis.stop()
    prompts = [tokens(40 + i, 200) for i in range(3)]
    for prompt in prompts:  # no 5xx while Redis is down: the same greedy output
        assert greedy_ids(url, prompt, max_tokens=16) == greedy_ids(stack.base_url, prompt, max_tokens=16)
    wait_for(lambda: faults.worker_metric("taco_llm_lookahead_sync_connected") == 0, "the worker to notice")
    faults.redis.start()
    # What finished while Redis was away reaches it once it is back, and the worker subscribes again.
    wait_for(lambda: faults.records() >= records + len(prompts), "the backlog to reach Redis", 60)
    wait_for(lambda: faults.worker_metric("taco_llm_lookahead_sync_connected") == 1, "the worker to reconnect", 60)
    after = tokens(50, 200)
    assert greedy_ids(url, after, max_tokens=16) == greedy_ids(stack.base_url, after, max_tokens=16)
