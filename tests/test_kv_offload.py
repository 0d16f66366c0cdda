"""Prefix-KV offload end to end: real engines, a real cache service, gRPC and the OpenAI SDK.

Engines started here: one `taco_llm serve --enable-prefix-cache-offload` (which starts its own cache
service), a second worker on the same service (twice: before and after a restart), and a bfloat16
worker. The reference for greedy output is the suite's shared `stack` (offload off). All float32.

On one host block bytes go through shared memory (the default transport, "auto"): the service's
shm byte counters show it. The restarted second worker runs with `--apc-offload-transport grpc`, so
the gRPC-bytes path is covered end to end too.

The tests run in file order: they share the engines and build on what the cache service holds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.protos import engine_pb2, engine_pb2_grpc, kv_cache_pb2, kv_cache_pb2_grpc

from .support import Process, Stack, free_port, start, start_stack, wait_until

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU block size, in tokens
# A KV cache of 12 blocks (float32, 5.9 MB each): two 10-block prompts evict everything else from
# vLLM's own cache. Prompts stay short: each prefill costs seconds on these shared CPUs.
SMALL_KV = ["--dtype", "float32", "--max-model-len", "1280", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", "72000000", "--seed", "0"]
MODEL = "SmolLM2-135M-Instruct"
# The scheduler gives a Lookup 0.25 s by default, then recomputes. These CPUs also run the test
# itself and the suite's other engines: a slow answer here would be a correct recompute, but not what
# these tests look for. The fault paths have their own test (killing the service mid-load).
OFFLOAD = ["--enable-prefix-cache-offload", "--apc-offload-lookup-timeout", "3"]


def tokens(seed: int, count: int) -> list[int]:
    """A deterministic prompt of `count` token ids (the vocabulary has 49152)."""
    return [100 + (seed * 7919 + i * 104729 + i * i * 31) % 40000 for i in range(count)]


def generate(stub: engine_pb2_grpc.EngineStub, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], int]:
    """Greedy output token ids, and the prompt tokens the engine reported as cached."""
    out: list[int] = []
    cached = -1
    request = engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=prompt),
                                         sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
    for message in stub.Generate(request, timeout=300):
        for choice in message.delta.choices:
            out += list(choice.token_ids)
        if message.HasField("finished"):
            cached = message.finished.usage.cached_prompt_tokens
    return out, cached


def stats(store: kv_cache_pb2_grpc.KVBlockStoreStub) -> kv_cache_pb2.StatsResponse:
    return store.Stats(kv_cache_pb2.StatsRequest(), timeout=10)


def served(before: kv_cache_pb2.StatsResponse, after: kv_cache_pb2.StatsResponse) -> tuple[int, int, int]:
    """Blocks served between two Stats, their bytes, and how many of those bytes went through shared memory."""
    return (after.blocks_served - before.blocks_served, after.bytes_served - before.bytes_served,
            after.bytes_served_shm - before.bytes_served_shm)


class Offload:
    """`taco_llm serve --enable-prefix-cache-offload` and the cache service it started."""

    def __init__(self, stack: Stack, cache_address: str):
        self.stack = stack
        self.cache_address = cache_address
        self.engine = engine_pb2_grpc.EngineStub(grpc.insecure_channel(stack.grpc_address))
        self.store = kv_cache_pb2_grpc.KVBlockStoreStub(grpc.insecure_channel(cache_address))
        self.client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    def evict_local(self, seed: int) -> None:
        """Two long unrelated prompts push everything else out of vLLM's own 12-block cache."""
        for i in range(2):
            generate(self.engine, tokens(10_000 + seed * 10 + i, 9 * BLOCK + 5), max_tokens=1)

    def complaints(self) -> str:
        """The worker's offload warnings, for assertion messages: why a load or lookup fell back."""
        lines = self.stack.process.log.read_text().splitlines()
        return "\n".join(line for line in lines if "prefix-KV offload" in line and "WARNING" in line)[-4000:]

    def cache_service_pid(self) -> int:
        for child in psutil.Process(self.stack.process.popen.pid).children():
            # A service just killed stays a zombie until serve reaps it: it is no longer the service.
            with contextlib.suppress(psutil.NoSuchProcess):
                if "cache_service" in " ".join(child.cmdline()):
                    return int(child.pid)
        raise AssertionError("serve started no cache service")


@pytest.fixture(scope="module")
def offload(model_dir: Path, log_dir: Path) -> Iterator[Offload]:
    cache_port = free_port()
    stack = start_stack("serve-offload", [*SMALL_KV, *OFFLOAD, "--cache-service-port", str(cache_port)], log_dir)
    yield Offload(stack, f"127.0.0.1:{cache_port}")
    code = stack.process.stop()
    assert code == 0, f"serve exited with {code}:\n{stack.process.tail()}"


@pytest.fixture(scope="module")
def reference(engine: engine_pb2_grpc.EngineStub) -> Callable[[list[int]], list[int]]:
    """Greedy output with offload off (the suite's shared float32 stack)."""
    return lambda prompt: generate(engine, prompt)[0]


@pytest.fixture(scope="module")
def engine(stack: Stack) -> Iterator[engine_pb2_grpc.EngineStub]:
    channel = grpc.insecure_channel(stack.grpc_address)
    yield engine_pb2_grpc.EngineStub(channel)
    channel.close()


def start_worker(name: str, cache_address: str, log_dir: Path, extra: list[str] | None = None) -> tuple[Process, str]:
    port = free_port()
    flags = extra if extra is not None else SMALL_KV
    process = start(name, ["worker", "--grpc-port", str(port), *flags, *OFFLOAD, "--cache-service", cache_address],
                    log_dir)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def serving() -> bool:
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1
        except grpc.RpcError:
            return False

    wait_until(process, serving)
    return process, f"127.0.0.1:{port}"


LONG = tokens(1, 1000)  # 7 full blocks and a partial one
PARTIAL = LONG[:4 * BLOCK + 40] + tokens(2, 400)  # shares 4 blocks with LONG
UNRELATED = tokens(3, 500)
SHARED = tokens(4, 900)  # 7 blocks


def test_offload_on_equals_off_for_full_partial_and_no_hits(
        offload: Offload, reference: Callable[[list[int]], list[int]]) -> None:
    expected = {name: reference(p) for name, p in (("long", LONG), ("partial", PARTIAL), ("unrelated", UNRELATED))}
    first, cached = generate(offload.engine, LONG)
    assert first == expected["long"] and cached == 0
    offload.evict_local(1)
    before = stats(offload.store)
    again, cached = generate(offload.engine, LONG)
    assert again == expected["long"], "a full offload hit changed the greedy output"
    assert cached == 7 * BLOCK, offload.complaints()
    blocks, size, shm = served(before, stats(offload.store))
    assert blocks == 7 and size == shm > 0, "the load did not go through shared memory"

    offload.evict_local(2)
    before = stats(offload.store)
    partial, cached = generate(offload.engine, PARTIAL)
    assert partial == expected["partial"], "a partial offload hit changed the greedy output"
    assert cached == 4 * BLOCK, offload.complaints()
    after = stats(offload.store)
    blocks, size, shm = served(before, after)
    assert blocks == 4 and size == shm > 0

    unrelated, cached = generate(offload.engine, UNRELATED)
    assert unrelated == expected["unrelated"] and cached == 0
    # Saves went through the shared-memory ring, not as gRPC bytes.
    assert after.bytes_stored_shm == after.bytes_stored > 0 and after.windows_attached >= 2
    log = offload.stack.process.log.read_text()
    assert "block bytes go through shared memory" in log and "not usable" not in log


def test_eviction_then_hit_shows_in_openai_usage_and_service_hits(offload: Offload) -> None:
    prompt = tokens(5, 1100)  # 8 blocks
    first = offload.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    offload.evict_local(3)
    before = stats(offload.store)
    started = time.monotonic()
    again = offload.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    elapsed = time.monotonic() - started
    assert again.choices[0].text == first.choices[0].text
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 8 * BLOCK, (
        f"not served from the cache service:\n{offload.complaints()}")
    after = stats(offload.store)
    assert after.blocks_served - before.blocks_served == 8
    assert after.bytes_used <= after.bytes_budget
    print(f"offload hit of {8 * BLOCK} tokens answered in {elapsed:.2f}s")


def test_two_workers_share_one_cache_service_and_restart_keeps_hits(
        offload: Offload, log_dir: Path, reference: Callable[[list[int]], list[int]]) -> None:
    expected = reference(SHARED)
    computed, _ = generate(offload.engine, SHARED)  # computed on the serve stack's worker
    assert computed == expected
    time.sleep(1.0)  # saves are asynchronous
    worker, address = start_worker("offload-worker-b", offload.cache_address, log_dir)
    try:
        other = engine_pb2_grpc.EngineStub(grpc.insecure_channel(address))
        out, cached = generate(other, SHARED)
        assert out == expected and cached == 7 * BLOCK, "the second worker did not hit the first one's blocks"
        own = tokens(6, 800)  # 6 blocks
        own_expected, _ = generate(other, own)  # computed here, to be found after the restart
        time.sleep(1.0)
    finally:
        assert worker.stop() == 0, worker.tail()
    # The same worker again, now loading everything before the forward pass, and with block bytes in
    # gRPC messages (the transport across hosts), so that path is covered end to end.
    worker, address = start_worker("offload-worker-b-restarted", offload.cache_address, log_dir,
                                   [*SMALL_KV, "--apc-offload-not-lazy", "--apc-offload-transport", "grpc"])
    try:
        restarted = engine_pb2_grpc.EngineStub(grpc.insecure_channel(address))
        before = stats(offload.store)
        out, cached = generate(restarted, own)
        assert out == own_expected and cached == 6 * BLOCK, "the first request after a restart missed"
        blocks, size, shm = served(before, stats(offload.store))
        assert blocks == 6 and size > 0 and shm == 0, "--apc-offload-transport grpc still used shared memory"
        fresh = tokens(7, 400)
        assert generate(restarted, fresh)[0] == reference(fresh)
        time.sleep(1.0)
        after = stats(offload.store)
        assert after.bytes_stored > before.bytes_stored and after.bytes_stored_shm == before.bytes_stored_shm
        log = worker.log.read_text()
        assert "not lazy" in log and "transport grpc" in log and "shared memory with" not in log
    finally:
        assert worker.stop() == 0, worker.tail()


def test_a_different_dtype_never_hits(offload: Offload, log_dir: Path) -> None:
    before = stats(offload.store)
    bf16 = [*SMALL_KV[:1], "bfloat16", *SMALL_KV[2:]]
    worker, address = start_worker("offload-worker-bf16", offload.cache_address, log_dir, bf16)
    try:
        other = engine_pb2_grpc.EngineStub(grpc.insecure_channel(address))
        _, cached = generate(other, SHARED)  # float32 blocks of this prompt are in the service
        assert cached == 0
    finally:
        assert worker.stop() == 0, worker.tail()
    after = stats(offload.store)
    assert after.lookup_hit_blocks == before.lookup_hit_blocks
    assert after.blocks_served == before.blocks_served


# A request whose load stalls finishes within this many seconds of the stall: the worker gives a load up
# after LOAD_STALL_SECONDS without progress (2 s) and recomputes, and any later Lookup of the scheduler waits
# its --apc-offload-lookup-timeout (3 s here). Loose, as these CPUs are shared; the load deadline before the
# stall deadline existed was 30 s, every request of the engine waiting with it.
STALLED_REQUEST_BOUND = 25.0


def unfinished_loads(offload: Offload) -> int:
    """Loads of 9 blocks the worker logged as given up (stalled) or failed (an error, its deadline)."""
    log = offload.stack.process.log.read_text()
    return sum(1 for line in log.splitlines()
               if "loading 9 blocks" in line and ("stalled (" in line or "failed" in line))


def test_a_frozen_cache_service_costs_requests_a_deadline_not_a_hang(
        offload: Offload, reference: Callable[[list[int]], list[int]]) -> None:
    """The cache service is frozen (SIGSTOP: connections stay open and nothing answers, as when its host is cut
    off) just as a request starts loading from it: that request, and one sent during the freeze, finish within
    a bound with the greedy output of no offload. After SIGCONT, loads from the service work again. A freeze
    that came after the load had finished does not count, and the test tries again."""
    stalled = False
    for attempt in range(5):
        prompt = tokens(40 + attempt, 1200)  # 9 blocks
        other = tokens(50 + attempt, 300)
        expected, other_expected = reference(prompt), reference(other)
        assert generate(offload.engine, prompt)[0] == expected
        time.sleep(1.0)  # saves are asynchronous
        offload.evict_local(40 + attempt)
        pid = offload.cache_service_pid()
        unfinished_before = unfinished_loads(offload)
        lookups_before = stats(offload.store).lookups
        results: dict[str, tuple[list[int], int]] = {}

        def send(name: str, ids: list[int], into: dict[str, tuple[list[int], int]] = results) -> None:
            into[name] = generate(offload.engine, ids)

        request = threading.Thread(target=send, args=("prompt", prompt))
        request.start()
        # Freeze it once the scheduler's Lookup for this request is answered: the load comes next.
        frozen = False
        while request.is_alive() and not frozen:
            with contextlib.suppress(grpc.RpcError):
                now = stats(offload.store)
                frozen = now.lookups > lookups_before or now.reads_in_progress > 0
        if not frozen:
            request.join(300)
            continue
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            during = threading.Thread(target=send, args=("other", other))
            during.start()
            for thread in (request, during):
                thread.join(max(0.0, stopped_at + STALLED_REQUEST_BOUND - time.monotonic()))
            finished_in = time.monotonic() - stopped_at
            assert not request.is_alive() and not during.is_alive(), (
                f"requests still waiting {finished_in:.0f}s into a frozen cache service:\n{offload.complaints()}")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert results["prompt"][0] == expected, "a stalled load changed the greedy output"
        assert results["other"][0] == other_expected
        stalled = unfinished_loads(offload) > unfinished_before
        if stalled:
            print(f"both requests finished {finished_in:.1f}s after the cache service froze")
            break
    assert stalled, "never froze the cache service during a load"
    # Thawed: the worker's backoff passes and loads from the service work again.
    probe = tokens(60, 400)  # 3 blocks
    expected = reference(probe)
    deadline = time.monotonic() + 60
    while True:
        assert generate(offload.engine, probe)[0] == expected
        time.sleep(1.0)
        offload.evict_local(50)
        before = stats(offload.store)
        out, cached = generate(offload.engine, probe)
        assert out == expected
        if stats(offload.store).blocks_served - before.blocks_served == 3 and cached == 3 * BLOCK:
            break
        assert time.monotonic() < deadline, f"loads did not work again after the freeze:\n{offload.complaints()}"
        probe = [*probe[1:], probe[0]]  # another prompt: the last one's blocks may be local again
        expected = reference(probe)


def test_killing_the_cache_service_mid_load_costs_no_request(
        offload: Offload, reference: Callable[[list[int]], list[int]]) -> None:
    """The service is frozen, then killed, while it writes a load into the worker's shared-memory
    window: the worker recomputes those blocks, with the same greedy output. A kill that came just
    after the load had finished does not count, and the test tries again (serve restarts the service)."""
    interrupted = False
    for attempt in range(5):
        prompt = tokens(20 + attempt, 1200)  # 9 blocks, ~50 MiB of float32 KV to load
        expected = reference(prompt)
        assert generate(offload.engine, prompt)[0] == expected
        time.sleep(1.0)
        offload.evict_local(10 + attempt)
        pid = offload.cache_service_pid()
        failures_before = offload.stack.process.log.read_text().count("loading 9 blocks failed")
        result: dict[str, tuple[list[int], int]] = {}

        def send(prompt: list[int] = prompt, into: dict[str, tuple[list[int], int]] = result) -> None:
            into["out"] = generate(offload.engine, prompt)

        request = threading.Thread(target=send)
        request.start()
        caught = False
        while request.is_alive() and not caught:
            with contextlib.suppress(grpc.RpcError):
                caught = stats(offload.store).reads_in_progress > 0
        if caught:
            os.kill(pid, signal.SIGSTOP)  # frozen in the middle of writing the blocks into the window
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
        request.join(300)
        out, _ = result["out"]
        assert out == expected, "the request's greedy output changed when its load failed"
        if caught:
            wait_for_new_cache_service(offload, pid)
            log = offload.stack.process.log.read_text()
            interrupted = log.count("loading 9 blocks failed") > failures_before
            if interrupted:
                break
    assert interrupted, "never caught the cache service in the middle of a load"
    assert "Recovered from KV load failure" in offload.stack.process.log.read_text()
    # serve restarted its cache service; the worker reconnects, attaches fresh windows, fills it again.
    time.sleep(2.5)  # the worker's backoff after the failure
    fresh = tokens(30, 400)
    assert generate(offload.engine, fresh)[0] == reference(fresh)
    deadline = time.monotonic() + 30
    while stats(offload.store).blocks_stored == 0 and time.monotonic() < deadline:
        generate(offload.engine, tokens(31, 400), max_tokens=1)
        time.sleep(1.0)
    assert stats(offload.store).blocks_stored > 0, "the worker did not reconnect to the restarted service"
    probe = tokens(32, 400)  # 3 blocks, saved to the new service, then loaded from it
    expected = reference(probe)
    assert generate(offload.engine, probe)[0] == expected
    time.sleep(1.0)
    offload.evict_local(20)
    before = stats(offload.store)
    assert generate(offload.engine, probe)[0] == expected
    blocks, size, shm = served(before, stats(offload.store))
    assert blocks == 3 and size == shm, "after the restart the load did not go through a fresh window"
    log = offload.stack.process.log.read_text()
    assert "restarting it" in log and "Traceback" not in log


def wait_for_new_cache_service(offload: Offload, old_pid: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if offload.cache_service_pid() != old_pid and stats(offload.store).bytes_budget > 0:
                return
        except (grpc.RpcError, AssertionError):
            pass
        time.sleep(0.5)
    raise AssertionError("serve did not restart its cache service")
