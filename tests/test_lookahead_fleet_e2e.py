"""The Lookahead Cache across a fleet: `taco_llm serve --num-workers 2 --routing round_robin` with lookahead on
(TACO-LLM's default config), two tenants and no --redis-url. serve starts a Redis of its own behind the cache
service, so the two workers share one index: an answer finished on one worker drafts, with accepted tokens,
when the same tenant asks the question again on the other; still does after a rolling restart of every
worker, and after a restart of the whole of serve (--lookahead-redis-dir keeps Redis's append-only file);
and never drafts for the other tenant, on either worker. Every answer is the one the no-speculation stack
gives (float32, greedy).

Which worker served a request is read from the workers' own Prometheus counters (each has its
--metrics-port), and so are the accepted draft tokens.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from .support import (
    Process,
    child_command,
    consecutive_free_ports,
    free_port,
    grpc_serving,
    http_status,
    start,
    wait_until,
)

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
NUM_WORKERS = 2
MAX_TOKENS = 64
FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8", "--kv-cache-memory-bytes", "256M",
         "--seed", "0", "--routing", "round_robin", "--shutdown-timeout", "30"]
SURVIVE = 180.0  # seconds a restarted worker may take to start again and rejoin
ALICE, BOB = "alice-key", "bob-key"  # two tenants: each has a scope of its own in the shared index


@dataclass
class LookaheadFleet:
    process: Process
    base_url: str
    grpc_ports: list[int]
    metrics_ports: list[int]
    serve_args: list[str]
    log_dir: Path

    def wait_ready(self) -> None:
        wait_until(self.process, lambda: http_status(f"{self.base_url}/health") == 200
                   and all(self.gateway_ready(i) for i in range(NUM_WORKERS)))

    def restart_everything(self) -> None:
        """serve stopped as an operator stops it (SIGTERM: workers, cache service and its Redis all exit),
        then started again with the same flags."""
        code = self.process.stop(timeout=120)
        assert code == 0, f"taco_llm serve exited with {code} on SIGTERM:\n{self.process.tail()}"
        self.process = start("lookahead-fleet-restarted", self.serve_args, self.log_dir)
        self.wait_ready()

    def worker_total(self, index: int, name: str) -> float:
        """The sum of a worker's samples named `name`, from its own /metrics page."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[index]}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name)

    def totals(self, name: str) -> list[float]:
        return [self.worker_total(i, name) for i in range(NUM_WORKERS)]

    def worker_pid(self, index: int) -> int:
        return child_command(self.process.popen.pid, "taco_llm.engine_worker", str(self.grpc_ports[index]))[0]

    def records(self) -> int:
        """Records in the shared index's Redis streams, through the Unix socket of the Redis serve started."""
        client = redis.Redis(unix_socket_path=self.redis_socket())
        try:
            return sum(int(client.xlen(key)) for key in client.scan_iter("taco_llm:lookahead:*"))
        finally:
            client.close()

    def redis_socket(self) -> str:
        """The Unix socket the Redis serve started listens on (redis-server rewrites its command line, so the
        socket is read from its listening sockets)."""
        for process in psutil.Process(self.process.popen.pid).children():
            if process.name() == "redis-server":
                paths = [c.laddr for c in process.net_connections(kind="unix") if c.laddr]
                assert paths, "serve's Redis listens on no Unix socket"
                return str(paths[0])
        raise AssertionError("serve started no redis-server")

    def gateway_ready(self, index: int) -> bool:
        request = urllib.request.Request(f"{self.base_url}/metrics", headers={"Authorization": f"Bearer {ALICE}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            text = reply.read().decode()
        address = f"127.0.0.1:{self.grpc_ports[index]}"
        return any(sample.name == "taco_llm_worker_ready" and sample.labels.get("worker") == address
                   and sample.value == 1 for family in text_string_to_metric_families(text)
                   for sample in family.samples)


@pytest.fixture(scope="module")
def fleet(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LookaheadFleet]:
    config_dir = tmp_path_factory.mktemp("lookahead-fleet-config")
    (config_dir / "lookahead_cache_config.json").write_text("{}")  # TACO-LLM's defaults
    redis_dir = tmp_path_factory.mktemp("lookahead-fleet-redis")
    port, grpc_port, metrics_port = free_port(), consecutive_free_ports(NUM_WORKERS), \
        consecutive_free_ports(NUM_WORKERS)
    serve_args = [
        "serve", "--port", str(port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
        "--num-workers", str(NUM_WORKERS), "--cache-service-port", str(free_port()),
        "--lookahead-cache-config-dir", str(config_dir), "--lookahead-redis-dir", str(redis_dir),
        "--api-key", f"alice={ALICE}", "--api-key", f"bob={BOB}", *FLAGS,
    ]
    fleet = LookaheadFleet(start("lookahead-fleet", serve_args, log_dir), f"http://127.0.0.1:{port}",
                           [grpc_port + i for i in range(NUM_WORKERS)], [metrics_port + i for i in range(NUM_WORKERS)],
                           serve_args, log_dir)
    try:
        fleet.wait_ready()
        yield fleet
    finally:
        code = fleet.process.stop(timeout=120)
    assert code == 0, f"taco_llm serve exited with {code} on SIGTERM:\n{fleet.process.tail()}"


def _tenant_client(fleet: LookaheadFleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def fleet_client(fleet: LookaheadFleet) -> openai.OpenAI:
    return _tenant_client(fleet, ALICE)


def _answer(client: openai.OpenAI, question: str) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    return reply.choices[0].message.content or ""


@dataclass(frozen=True)
class Served:
    worker: int
    accepted: float  # drafted tokens that worker's model accepted while answering
    answer: str


def _served(fleet: LookaheadFleet, client: openai.OpenAI, question: str) -> Served:
    finished = fleet.totals("vllm:request_success_total")
    accepted = fleet.totals("taco_llm_lookahead_accepted_tokens_total")
    answer = _answer(client, question)
    moved = [after - before for before, after in zip(finished, fleet.totals("vllm:request_success_total"),
                                                     strict=True)]
    assert sorted(moved) == [0.0] * (NUM_WORKERS - 1) + [1.0], f"finished requests per worker moved by {moved}"
    worker = moved.index(1.0)
    return Served(worker, fleet.worker_total(worker, "taco_llm_lookahead_accepted_tokens_total") - accepted[worker],
                  answer)


def _published(fleet: LookaheadFleet, records: int) -> None:
    """Until the finished sequence is in Redis; then a moment for the other workers' subscriptions, which
    deliver within milliseconds (bench/lookahead_sync.py measures how many)."""
    deadline = time.monotonic() + 30
    while fleet.records() <= records:
        assert time.monotonic() < deadline, "the finished sequence never reached the shared index"
        time.sleep(0.05)
    time.sleep(1.0)


def test_an_answer_finished_on_one_worker_drafts_on_the_other(fleet: LookaheadFleet, fleet_client: openai.OpenAI,
                                                              client: openai.OpenAI) -> None:
    question = "Explain how a bicycle gear system works to a child."
    reference = _answer(client, question)  # the session stack: no speculation
    records = fleet.records()
    first = _served(fleet, fleet_client, question)
    _published(fleet, records)
    again = _served(fleet, fleet_client, question)
    assert again.worker != first.worker, "round_robin sent both requests to one worker"
    assert first.answer == reference and again.answer == reference
    assert again.accepted > first.accepted + MAX_TOKENS // 4, \
        f"on the other worker: {again.accepted} accepted tokens, {first.accepted} on the first"


def test_after_a_rolling_restart_the_first_repeat_drafts_from_the_shared_index(
        fleet: LookaheadFleet, fleet_client: openai.OpenAI, client: openai.OpenAI) -> None:
    question = "Give three tips for keeping houseplants alive in winter."
    reference = _answer(client, question)
    records = fleet.records()
    first = _served(fleet, fleet_client, question)
    _published(fleet, records)
    # A rolling restart as an operator does it: SIGTERM to one worker at a time (it drains and exits, serve
    # starts it again), the next once the gateway routes to the restarted one.
    for index in range(NUM_WORKERS):
        old = fleet.worker_pid(index)
        os.kill(old, signal.SIGTERM)
        deadline = time.monotonic() + SURVIVE
        while not (_restarted(fleet, index, old) and grpc_serving(f"127.0.0.1:{fleet.grpc_ports[index]}")
                   and fleet.gateway_ready(index)):
            assert time.monotonic() < deadline, f"worker {index} did not rejoin:\n{fleet.process.tail()}"
            time.sleep(1)
    again = _served(fleet, fleet_client, question)
    assert first.answer == reference and again.answer == reference
    assert again.accepted > first.accepted + MAX_TOKENS // 4, \
        f"after a rolling restart: {again.accepted} accepted tokens, {first.accepted} before"


def _restarted(fleet: LookaheadFleet, index: int, old_pid: int) -> bool:
    try:
        return fleet.worker_pid(index) != old_pid
    except (AssertionError, psutil.NoSuchProcess):
        return False  # between the old process's exit and the new one's start


def test_one_tenants_answer_never_drafts_for_another_on_any_worker(fleet: LookaheadFleet, client: openai.OpenAI
                                                                  ) -> None:
    """Alice's answer reaches the shared index under her scope only: bob's same question, on the other
    worker, accepts nothing from it, while alice's repeat on that worker drafts from it."""
    alice, bob = _tenant_client(fleet, ALICE), _tenant_client(fleet, BOB)
    question = "Describe how to brew a good cup of green tea."
    reference = _answer(client, question)
    records = fleet.records()
    first = _served(fleet, alice, question)
    _published(fleet, records)
    records = fleet.records()
    bobs = _served(fleet, bob, question)
    _published(fleet, records)
    filler = _served(fleet, bob, "Name a colour.")  # round_robin: alice's repeat goes to bob's worker
    again = _served(fleet, alice, question)
    assert bobs.worker != first.worker and again.worker == bobs.worker != filler.worker, \
        f"round_robin served alice, bob, bob, alice on workers {first.worker}, {bobs.worker}, {filler.worker}, " \
        f"{again.worker}"
    assert first.answer == bobs.answer == again.answer == reference
    assert bobs.accepted < first.accepted + MAX_TOKENS // 8, \
        f"bob accepted {bobs.accepted} drafted tokens after alice's answer (alice's first: {first.accepted})"
    assert again.accepted > first.accepted + MAX_TOKENS // 4, \
        f"alice's repeat on the other worker accepted {again.accepted}, her first {first.accepted}"


def test_after_a_restart_of_everything_the_index_comes_back_from_the_redis_dir(
        fleet: LookaheadFleet, fleet_client: openai.OpenAI, client: openai.OpenAI) -> None:
    """serve stops whole (workers, cache service, its Redis) and starts again with the same
    --lookahead-redis-dir: Redis reloads its append-only file, the cache service serves it, and the new
    workers draft from it for a question answered before the restart. Runs last: it restarts the fleet."""
    question = "What should a beginner know before running a first marathon?"
    reference = _answer(client, question)
    records = fleet.records()
    first = _served(fleet, fleet_client, question)
    _published(fleet, records)
    fleet.restart_everything()
    assert fleet.records() >= records + 1, "the restarted Redis did not load the append-only file"
    again = _served(fleet, _tenant_client(fleet, ALICE), question)
    assert first.answer == reference and again.answer == reference
    assert again.accepted > first.accepted + MAX_TOKENS // 4, \
        f"after a restart of everything: {again.accepted} accepted tokens, {first.accepted} before"
