"""The fleet end to end: `taco_llm serve --num-workers 2` (two real vLLM workers on the default model,
small KV caches so that they differ, a shared cache service), workers registered in a real Redis, traces
sent to an in-process OTLP receiver, and the real openai SDK as the client.

Which worker served a request is read from the workers' own Prometheus counters (each worker has its
--metrics-port), never from the gateway's word for it. The tests that stop a worker come last: each
waits for serve to restart it and for the gateway to take it back before the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import psutil
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from taco_llm.protos import engine_pb2, engine_pb2_grpc, rich_status
from taco_llm.protos.engine_limits import ENGINE_SERVICE
from taco_llm.protos.registry_keys import REGISTRY_KEY_PREFIX

from .conftest import build_tiny_lora
from .otlp_receiver import OtlpReceiver
from .support import (
    ROOT,
    Process,
    RedisServer,
    consecutive_free_ports,
    free_port,
    grpc_serving,
    http_status,
    start,
    wait_until,
)

NUM_WORKERS = 2
# float32 for token-exact greedy output whatever the batch; 96 MiB of KV cache a worker (about 2,100
# tokens of this model) so that the two workers' caches differ. The balance thresholds are low so that
# a handful of concurrent streams is enough to count as skew.
# Shorter than the default (30 s) so that the freeze test takes less time; still twice the longest step
# measured on this machine, and a worker whose engine steps is never abandoned, whatever the deadline.
STREAM_STALL_TIMEOUT = 15.0
FLEET_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8",
               "--kv-cache-memory-bytes", "96M", "--seed", "0", "--enable-prefix-cache-offload",
               "--routing", "cache_aware", "--cache-aware-balance-abs-threshold", "3",
               "--cache-aware-balance-rel-threshold", "2", "--shutdown-timeout", "60",
               "--stream-stall-timeout", str(STREAM_STALL_TIMEOUT),
               # Adapters loaded at runtime, through the gateway, on both workers (vLLM's condition for it).
               "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
FLEET_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
REGISTRY_TTL = 3.0
SURVIVE = 180.0  # seconds a restarted worker may take to start again and rejoin


@dataclass
class Fleet:
    process: Process
    base_url: str
    grpc_ports: list[int]
    metrics_ports: list[int]
    redis: RedisServer
    receiver: OtlpReceiver

    def worker_address(self, index: int) -> str:
        return f"127.0.0.1:{self.grpc_ports[index]}"

    def gateway_metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def gateway_value(self, name: str, **labels: str) -> float:
        """The sum of a gateway sample over the label sets that include `labels`."""
        return sum(value for (sample, sample_labels), value in self.gateway_metrics().items()
                   if sample == name and set(labels.items()) <= set(sample_labels))

    def served(self) -> list[float]:
        """Requests each worker has finished, from its own vLLM counter."""
        counts = []
        for port in self.metrics_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                    text = reply.read().decode()
            except OSError:
                counts.append(float("nan"))
                continue
            counts.append(sum(sample.value for family in text_string_to_metric_families(text)
                              for sample in family.samples if sample.name == "vllm:request_success_total"))
        return counts

    def worker_pid(self, index: int) -> int:
        """The worker process serve started for worker `index` (found by its --grpc-port)."""
        flag = str(self.grpc_ports[index])
        for child in psutil.Process(self.process.popen.pid).children():
            try:
                argv = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "taco_llm.engine_worker" in argv and flag in argv:
                return child.pid
        raise AssertionError(f"no worker process with --grpc-port {flag}")

    def active_streams(self, index: int) -> int:
        with grpc.insecure_channel(self.worker_address(index)) as channel:
            load = engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        return int(load.num_active_streams)

    def wait_rejoined(self, index: int) -> None:
        """Until serve has restarted worker `index` and the gateway routes to it again."""
        address = self.worker_address(index)
        deadline = time.monotonic() + SURVIVE
        while time.monotonic() < deadline:
            if grpc_serving(address) and self.gateway_value("taco_llm_worker_ready", worker=address) == 1:
                return
            time.sleep(1)
        raise AssertionError(f"worker {address} did not rejoin within {SURVIVE:.0f}s:\n{self.process.tail()}")


@pytest.fixture(scope="module")
def fleet(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    redis_server = RedisServer(free_port(), tmp_path_factory.mktemp("fleet-redis"))
    redis_server.start()
    receiver = OtlpReceiver(free_port())
    receiver.start()
    port, grpc_port, metrics_port = free_port(), consecutive_free_ports(NUM_WORKERS), \
        consecutive_free_ports(NUM_WORKERS)
    process = start("fleet", [
        "serve", "--port", str(port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
        "--num-workers", str(NUM_WORKERS), "--registry-url", redis_server.url,
        "--otlp-traces-endpoint", receiver.endpoint, *FLEET_FLAGS,
    ], log_dir, env=FLEET_ENV)
    base_url = f"http://127.0.0.1:{port}"
    fleet = Fleet(process, base_url, [grpc_port + i for i in range(NUM_WORKERS)],
                  [metrics_port + i for i in range(NUM_WORKERS)], redis_server, receiver)
    try:
        wait_until(process, lambda: http_status(f"{base_url}/health") == 200
                   and all(fleet.gateway_value("taco_llm_worker_ready", worker=fleet.worker_address(i)) == 1
                           for i in range(NUM_WORKERS)))
        yield fleet
    finally:
        code = process.stop(timeout=120)
        receiver.stop()
        redis_server.stop()
    assert code == 0, f"taco_llm serve exited with {code} on SIGTERM:\n{process.tail()}"


@pytest.fixture(scope="module")
def fleet_client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _document(topic: int, words: int = 220) -> str:
    """A long, distinct, deterministic text: a prefix worth caching."""
    vocabulary = ["river", "engine", "lantern", "copper", "meadow", "signal", "harbor", "cipher", "orchard",
                  "glacier", "falcon", "quartz", "tunnel", "violet", "ember", "saddle", "beacon", "thistle"]
    return " ".join(vocabulary[(topic * 7 + i * i * 3 + i) % len(vocabulary)] + str((topic * 31 + i) % 97)
                    for i in range(words))


def _which(fleet: Fleet, before: list[float]) -> int:
    after = fleet.served()
    moved = [i for i in range(NUM_WORKERS) if after[i] > before[i]]
    assert len(moved) == 1, f"expected one worker to finish the request: {before} -> {after}"
    return moved[0]


def test_repeated_prefixes_stick_and_distinct_ones_spread(fleet: Fleet, fleet_client: openai.OpenAI) -> None:
    homes: dict[int, set[int]] = {}
    for topic in range(6):
        for question in ("What is this about?", "Name one word in it.", "Summarise it."):
            before = fleet.served()
            fleet_client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=f"{_document(topic)}\n\nQ: {question}\nA:", max_tokens=2,
                temperature=0)
            homes.setdefault(topic, set()).add(_which(fleet, before))
    assert all(len(workers) == 1 for workers in homes.values()), f"a prefix moved between workers: {homes}"
    assert {next(iter(w)) for w in homes.values()} == set(range(NUM_WORKERS)), f"prefixes did not spread: {homes}"
    assert fleet.gateway_value("taco_llm_router_decisions_total", policy="cache_aware", reason="prefix_match") >= 12


def _metric(base_url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and set(labels.items()) <= set(sample.labels.items()))


def test_a_second_gateway_routes_on_what_the_workers_publish(fleet: Fleet, fleet_client: openai.OpenAI,
                                                             log_dir: Path) -> None:
    # Another gateway replica on the same registry: it never sees the requests the first one routes,
    # yet sends each prefix to the worker whose KV cache holds it, from what the workers publish
    # (their vLLM KV cache events, through Redis). Its own approximate index would know nothing of them.
    port = free_port()
    second_url = f"http://127.0.0.1:{port}"
    second = start("fleet-gateway-2", ["gateway", "--port", str(port), "--registry-url", fleet.redis.url,
                                       "--routing", "cache_aware"], log_dir)
    try:
        wait_until(second, lambda: http_status(f"{second_url}/health") == 200 and all(
            _metric(second_url, "taco_llm_worker_ready", worker=fleet.worker_address(i)) == 1
            for i in range(NUM_WORKERS)))
        clients = [fleet_client, openai.OpenAI(base_url=f"{second_url}/v1", api_key="unused", max_retries=0,
                                               timeout=300)]
        # Short documents (one or two KV blocks each), so that all of them fit in the two caches at once:
        # a prefix that stays held must stay put.
        homes: dict[int, list[int]] = {}
        for round_ in range(3):
            for topic in range(100, 108):
                before = fleet.served()
                # Each repeat through the other gateway than the time before.
                clients[(topic + round_) % 2].completions.create(
                    model="SmolLM2-135M-Instruct", prompt=f"{_document(topic, words=60)}\n\nQ: Go on.\nA:",
                    max_tokens=2, temperature=0)
                homes.setdefault(topic, []).append(_which(fleet, before))
        moved = {topic: workers for topic, workers in homes.items() if len(set(workers)) > 1}
        assert not moved, f"prefixes moved between workers when asked through the other gateway: {moved}"
        assert _metric(second_url, "taco_llm_router_prefix_view_lookups_total", view="shared") > 0
        assert _metric(second_url, "taco_llm_router_prefix_view_lookups_total", view="approximate") == 0
    finally:
        second.stop()


def test_stored_responses_are_one_store_for_every_gateway(fleet: Fleet, fleet_client: openai.OpenAI,
                                                          log_dir: Path) -> None:
    # The Responses API behind two gateway replicas on the registry's Redis: whichever replica takes a
    # call finds what the other stored, chains on it, polls a background response the other runs, and
    # cancels it there.
    port = free_port()
    second_url = f"http://127.0.0.1:{port}"
    second = start("fleet-gateway-responses", ["gateway", "--port", str(port), "--registry-url", fleet.redis.url],
                   log_dir)
    try:
        wait_until(second, lambda: http_status(f"{second_url}/health") == 200)
        first, other = fleet_client, openai.OpenAI(base_url=f"{second_url}/v1", api_key="unused", max_retries=0,
                                                   timeout=300)
        asked = first.responses.create(model="SmolLM2-135M-Instruct", input="My name is Ada. Say hello to me.",
                                       max_output_tokens=8, temperature=0)
        assert other.responses.retrieve(asked.id).output_text == asked.output_text
        chained = other.responses.create(model="SmolLM2-135M-Instruct", previous_response_id=asked.id,
                                         input="What is my name?", max_output_tokens=8, temperature=0)
        assert chained.usage is not None and asked.usage is not None
        assert chained.usage.input_tokens > asked.usage.input_tokens + asked.usage.output_tokens

        queued = other.responses.create(model="SmolLM2-135M-Instruct", input="Count to five.",
                                        max_output_tokens=8, temperature=0, background=True)
        assert queued.status in ("queued", "in_progress")
        deadline = time.monotonic() + 120
        while (polled := first.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline, f"background response still {polled.status}"
            time.sleep(0.2)
        assert polled.status in ("completed", "incomplete") and polled.output_text

        # A long one, run by the second gateway, cancelled through the first: its engine request stops.
        long = other.responses.create(model="SmolLM2-135M-Instruct", input="Write a long story.",
                                      max_output_tokens=1500, temperature=0, background=True,
                                      extra_body={"ignore_eos": True})
        wait_until(second, lambda: first.responses.retrieve(long.id).status == "in_progress", timeout=120)
        assert first.responses.cancel(long.id).status == "cancelled"
        wait_until(second, lambda: sum(fleet.active_streams(i) for i in range(NUM_WORKERS)) == 0, timeout=10)
        assert other.responses.retrieve(long.id).status == "cancelled"

        other.responses.delete(asked.id)
        with pytest.raises(openai.NotFoundError):
            first.responses.retrieve(asked.id)
    finally:
        second.stop()


def _worker_adapters(fleet: Fleet, index: int) -> dict[str, bool]:
    """The worker's adapters, as its own ModelInfo lists them: name -> loaded at runtime."""
    with grpc.insecure_channel(fleet.worker_address(index)) as channel:
        info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
    return {adapter.name: adapter.loaded_at_runtime for adapter in info.lora_adapters}


def _worker_text(fleet: Fleet, index: int, model: str) -> str:
    with grpc.insecure_channel(fleet.worker_address(index)) as channel:
        replies = list(engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest(
            model=model, text="The best thing about the sea is",
            sampling=engine_pb2.SamplingParams(max_tokens=8, temperature=0)), timeout=120))
    return "".join(d.text for r in replies if r.WhichOneof("phase") == "delta" for d in r.delta.choices)


def test_a_lora_adapter_loaded_at_runtime_reaches_every_worker(fleet: Fleet, fleet_client: openai.OpenAI,
                                                              model_dir: Path, tmp_path: Path) -> None:
    adapter = build_tiny_lora(model_dir, tmp_path / "runtime-lora")
    name = "runtime-lora"

    def post(route: str, body: dict[str, Any]) -> tuple[int, str]:
        request = urllib.request.Request(f"{fleet.base_url}{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=180) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    status, text = post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)})
    assert status == 200 and "Success" in text, text
    assert all(_worker_adapters(fleet, i) == {name: True} for i in range(NUM_WORKERS))
    # Each worker generates with it, alike, and unlike the base model (the adapter's B is not zero).
    texts = {_worker_text(fleet, i, name) for i in range(NUM_WORKERS)}
    assert len(texts) == 1 and texts != {_worker_text(fleet, 0, "SmolLM2-135M-Instruct")}
    models = {model.id: model for model in fleet_client.models.list().data}
    assert models[name].model_extra is not None and models[name].model_extra["parent"] == "SmolLM2-135M-Instruct"
    through_gateway = fleet_client.completions.create(model=name, prompt="The best thing about the sea is",
                                                      max_tokens=8, temperature=0)
    assert through_gateway.choices[0].text in texts

    # A worker that lacks it (as one does after a restart) is given it again by the gateway's loop.
    with grpc.insecure_channel(fleet.worker_address(1)) as channel:
        engine_pb2_grpc.EngineStub(channel).UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name=name),
                                                              timeout=10)
    deadline = time.monotonic() + 20
    while name not in _worker_adapters(fleet, 1):
        assert time.monotonic() < deadline, "the gateway did not give the adapter back to the worker"
        time.sleep(0.2)

    status, text = post("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path / "none")})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path", text
    assert all("broken" not in _worker_adapters(fleet, i) for i in range(NUM_WORKERS))
    status, text = post("/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404 and json.loads(text)["error"]["param"] == "lora_name", text

    status, text = post("/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200 and "Success" in text, text
    assert all(_worker_adapters(fleet, i) == {} for i in range(NUM_WORKERS))
    with pytest.raises(openai.NotFoundError):
        fleet_client.completions.create(model=name, prompt="Hi", max_tokens=2)
    assert name not in {model.id for model in fleet_client.models.list().data}


def test_skewed_load_spills_to_the_idle_worker(fleet: Fleet) -> None:
    prompt = f"{_document(40)}\n\nQ: Continue the list.\nA:"
    spill_reasons = ("balance", "shared_cache", "least_load")

    def spills() -> float:
        return sum(fleet.gateway_value("taco_llm_router_decisions_total", policy="cache_aware", reason=reason)
                   for reason in spill_reasons)

    spilled = spills()
    before = fleet.served()

    async def burst() -> None:
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        await asyncio.gather(*(client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=48, temperature=0,
            extra_body={"ignore_eos": True}) for _ in range(10)))
        await client.close()

    asyncio.run(burst())
    after = fleet.served()
    shares = [after[i] - before[i] for i in range(NUM_WORKERS)]
    assert sum(shares) == 10 and min(shares) >= 1, f"one prefix under load stayed on one worker: {shares}"
    # The spill is by load: the balance rule, or (the workers sharing a cache service, where the idle one
    # holds the prefix at a discount) the cost of load against the discounted prefix.
    assert spills() > spilled


def test_a_flood_of_client_errors_opens_no_circuit(fleet: Fleet, fleet_client: openai.OpenAI) -> None:
    for _ in range(40):
        # Token ids past the vocabulary: the gateway forwards them and the worker refuses them.
        with pytest.raises(openai.BadRequestError):
            fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt=[10_000_000], max_tokens=2)
    for index in range(NUM_WORKERS):
        address = fleet.worker_address(index)
        assert fleet.gateway_value("taco_llm_worker_circuit_state", worker=address) == 0
        assert fleet.gateway_value("taco_llm_worker_ready", worker=address) == 1
    assert fleet.gateway_value("taco_llm_router_retries_total") == 0
    answer = fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens == 3


def test_metrics_parse_and_move(fleet: Fleet, fleet_client: openai.OpenAI) -> None:
    generated = fleet.gateway_value("vllm:generation_tokens_total")
    succeeded = fleet.gateway_value("vllm:request_success_total")
    ok = fleet.gateway_value("taco_llm_gateway_requests_total", route="/v1/chat/completions", status="200")
    stream = fleet_client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Count to five."}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert fleet.gateway_value("vllm:generation_tokens_total") == generated + usage.completion_tokens
    assert fleet.gateway_value("vllm:request_success_total") == succeeded + 1
    assert fleet.gateway_value("taco_llm_gateway_requests_total", route="/v1/chat/completions",
                               status="200") == ok + 1
    assert fleet.gateway_value("vllm:time_to_first_token_seconds_count") >= 1
    for index in range(NUM_WORKERS):
        assert fleet.gateway_value("taco_llm_worker_load", worker=fleet.worker_address(index),
                                   kind="running") >= 0


def test_the_workers_metrics_are_found_through_the_gateway(fleet: Fleet) -> None:
    with urllib.request.urlopen(f"{fleet.base_url}/metrics/targets", timeout=10) as reply:
        groups = json.load(reply)
    targets = {group["labels"]["worker"]: group["targets"] for group in groups}
    assert targets == {fleet.worker_address(i): [f"127.0.0.1:{fleet.metrics_ports[i]}"] for i in range(NUM_WORKERS)}
    for [target] in targets.values():
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
            assert "vllm:" in reply.read().decode()


def test_one_trace_spans_gateway_worker_and_vllm(fleet: Fleet, fleet_client: openai.OpenAI) -> None:
    fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt="Trace me", max_tokens=2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        services_by_trace: dict[str, set[str]] = {}
        for span in fleet.receiver.spans():
            services_by_trace.setdefault(span.trace_id, set()).add(span.service)
        # The gateway's, the worker's and vLLM's own request span (its service is neither of ours).
        ours = {"taco-llm-gateway", "taco-llm-worker"}
        if any(ours < services for services in services_by_trace.values()):
            return
        time.sleep(1)
    seen = sorted({(span.service, span.name) for span in fleet.receiver.spans()})
    raise AssertionError(f"no trace id spans the gateway, a worker and vLLM; spans seen: {seen}")


def test_discovery_a_worker_started_later_joins_and_a_stopped_one_leaves(
        fleet: Fleet, log_dir: Path) -> None:
    grpc_port = free_port()
    address = f"127.0.0.1:{grpc_port}"
    late = start("fleet-late-worker", [
        "worker", "--grpc-port", str(grpc_port), "--registry-url", fleet.redis.url,
        "--registry-ttl", str(REGISTRY_TTL), *FLEET_FLAGS_WORKER,
    ], log_dir)
    try:
        wait_until(late, lambda: fleet.gateway_value("taco_llm_worker_ready", worker=address) == 1)
        keys = redis.Redis.from_url(fleet.redis.url)
        assert any(keys.scan_iter(match=f"{REGISTRY_KEY_PREFIX}*")), "the worker wrote no registry key"
        # Frozen: it stops heartbeating (and answering), so its key expires and the gateway drops it.
        os.killpg(late.popen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while fleet.gateway_value("taco_llm_worker_ready", worker=address) == 1:
            assert time.monotonic() - stopped < REGISTRY_TTL + 2, "the frozen worker stayed in the pool"
            time.sleep(0.2)
        registered = [k for k in keys.scan_iter(match=f"{REGISTRY_KEY_PREFIX}*")
                      if address.encode() in (keys.get(k) or b"")]
        deadline = stopped + REGISTRY_TTL + 1
        while registered and time.monotonic() < deadline:
            time.sleep(0.2)
            registered = [k for k in registered if keys.exists(k)]
        assert not registered, "the frozen worker's key outlived its TTL"
    finally:
        os.killpg(late.popen.pid, signal.SIGKILL)
        late.popen.wait()


# The late worker's own flags: FLEET_FLAGS less those that belong to serve and the gateway.
FLEET_FLAGS_WORKER = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8",
                      "--kv-cache-memory-bytes", "96M", "--seed", "0"]


def _stream_text(client: openai.OpenAI, prompt: str, max_tokens: int,
                 on_chunk: Callable[[int], None] | None = None) -> tuple[str, int, str | None]:
    """Streams a greedy completion: its text, its counted completion tokens and its finish reason."""
    text, finish, completion_tokens, chunks = "", None, -1, 0
    for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            chunks += 1
            if on_chunk is not None:
                on_chunk(chunks)
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return text, completion_tokens, finish


Results = list[tuple[str, int, str | None] | BaseException]


def _greedy_streams(fleet: Fleet, client: openai.OpenAI, prompts: list[str], max_tokens: int,
                    while_running: Callable[[list[int]], None]) -> tuple[Results, list[threading.Thread]]:
    """Starts the prompts' streams side by side and, once each has had 5 chunks, calls `while_running`
    with each worker's active streams. Returns where each stream's result (or the error its client saw)
    will be, and the threads to join."""
    results: Results = [RuntimeError("not run")] * len(prompts)
    going = threading.Barrier(len(prompts) + 1)

    def run(n: int) -> None:
        def on_chunk(count: int) -> None:
            if count == 5:
                going.wait(120)

        try:
            results[n] = _stream_text(client, prompts[n], max_tokens, on_chunk)
        except BaseException as error:  # every client-visible error is a failure of the test
            results[n] = error

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(len(prompts))]
    for thread in threads:
        thread.start()
    going.wait(180)
    while_running([fleet.active_streams(i) for i in range(NUM_WORKERS)])
    return results, threads


def test_a_worker_whose_engine_freezes_loses_no_stream(fleet: Fleet, fleet_client: openai.OpenAI) -> None:
    """One worker's vLLM engine processes frozen (SIGSTOP) while greedy streams run on both workers: its
    gRPC server still answers, so only the gateway's stall deadline (--stream-stall-timeout) can tell.
    Its streams are abandoned and migrated; every stream finishes with one worker's greedy text, within
    the deadline and a margin. The engine is thawed (SIGCONT) and the worker serves again."""
    prompts = [f"{_document(70 + n, words=120)}\n\nQ: Tell me more.\nA:" for n in range(4)]
    max_tokens = 64
    reference = [fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0].text
                 for p in prompts]
    migrations = fleet.gateway_value("taco_llm_router_migrations_total", outcome="resumed")
    bound = STREAM_STALL_TIMEOUT + 60
    engines: list[psutil.Process] = []
    loads: list[int] = []
    threads: list[threading.Thread] = []

    def freeze(active: list[int]) -> None:
        loads.extend(active)
        victim = max(range(NUM_WORKERS), key=lambda i: active[i])
        engines.extend(psutil.Process(fleet.worker_pid(victim)).children(recursive=True))
        assert engines, "vLLM's EngineCore runs in a process of its own"
        for process in engines:
            process.suspend()

    try:
        results, threads = _greedy_streams(fleet, fleet_client, prompts, max_tokens, freeze)
        deadline = time.monotonic() + bound
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = sum(thread.is_alive() for thread in threads)
    finally:
        for process in engines:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()
        for thread in threads:
            thread.join(600)
    victim = max(range(NUM_WORKERS), key=lambda i: loads[i])
    assert not hung, f"{hung} stream(s) of the frozen worker still ran {bound:.0f} s after the freeze (loads {loads})"
    for n, result in enumerate(results):
        assert not isinstance(result, BaseException), f"stream {n} failed: {result!r}"
        text, completion_tokens, finish = result
        assert text == reference[n], f"stream {n} differs from one worker's greedy run"
        assert completion_tokens == max_tokens and finish == "length", (n, completion_tokens, finish)
    assert fleet.gateway_value("taco_llm_router_migrations_total", outcome="resumed") - migrations == loads[victim]
    # Thawed, the worker serves again, and the abandoned calls left nothing on the gateway's books.
    fleet.wait_rejoined(victim)
    settled = time.monotonic() + 10
    while fleet.gateway_value("taco_llm_worker_load", kind="gateway_streams") != 0:
        assert time.monotonic() < settled, "the gateway still counts streams in flight"
        time.sleep(0.5)
    before = fleet.served()[victim]
    for n in range(6):
        fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"{_document(80 + n)}\nQ: Hi\nA:",
                                        max_tokens=2)
    assert fleet.served()[victim] > before, "the thawed worker takes no request"


def test_drain_lets_a_stream_finish_and_takes_nothing_new(fleet: Fleet, fleet_client: openai.OpenAI) -> None:
    import threading

    prompt = f"{_document(50)}\n\nQ: Write a long story.\nA:"
    result: dict[str, object] = {}
    started = threading.Event()

    def run() -> None:
        result["value"] = _stream_text(fleet_client, prompt, 160, lambda n: n >= 3 and started.set())

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(120), "the stream did not start"
    index = next(i for i in range(NUM_WORKERS) if fleet.active_streams(i) > 0)
    address = fleet.worker_address(index)
    draining_served = fleet.served()[index]
    migrations = fleet.gateway_value("taco_llm_router_migrations_total")  # earlier tests migrate streams
    registry = redis.Redis.from_url(fleet.redis.url)
    try:
        assert _registered(registry, address), "the serving worker is not registered"
        os.kill(fleet.worker_pid(index), signal.SIGTERM)
        signalled = time.monotonic()
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while any(health.Check(health_pb2.HealthCheckRequest(service=name), timeout=2).status
                      != health_pb2.HealthCheckResponse.NOT_SERVING for name in ("", ENGINE_SERVICE)):
                assert time.monotonic() - signalled < 1.0, "health turns NOT_SERVING at once"
                time.sleep(0.02)
            assert not _registered(registry, address), "the registry key is deleted at once, not left to expire"
            with pytest.raises(grpc.RpcError) as refused:
                list(engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest(
                    text="Hi", sampling=engine_pb2.SamplingParams(max_tokens=2)), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert rich_status.details_of(refused.value).reason == "WORKER_DRAINING"
    finally:
        registry.close()
    deadline = time.monotonic() + 2
    while fleet.gateway_value("taco_llm_worker_ready", worker=address) == 1:
        assert time.monotonic() < deadline, "the draining worker stayed in rotation"
        time.sleep(0.1)
    for n in range(4):
        fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"{_document(n)}\nQ: Hi\nA:",
                                        max_tokens=2)
    assert fleet.served()[index] == draining_served, "a new request reached the draining worker"
    thread.join(300)
    _text, completion_tokens, finish = result["value"]  # type: ignore[misc]
    assert finish == "length" and completion_tokens == 160, (finish, completion_tokens)
    assert fleet.gateway_value("taco_llm_router_migrations_total") == migrations, "a drained stream was migrated"
    fleet.wait_rejoined(index)
    assert f"the engine worker {index} exited with code 0" in fleet.process.log.read_text(errors="replace"), \
        "the drained worker did not exit cleanly"


def _registered(registry: redis.Redis, address: str) -> bool:
    """Whether a registry key names the worker at `address`."""
    return any(address.encode() in (registry.get(key) or b"")
               for key in registry.scan_iter(match=f"{REGISTRY_KEY_PREFIX}*"))


def test_kill_a_worker_mid_stream_loses_nothing(fleet: Fleet, fleet_client: openai.OpenAI) -> None:
    import threading

    prompts = [f"{_document(60 + n, words=120)}\n\nQ: Tell me more.\nA:" for n in range(4)]
    max_tokens = 96
    # What one worker produces, greedy: the reference each migrated stream must equal.
    reference = [fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0].text
                 for p in prompts]
    migrations = fleet.gateway_value("taco_llm_router_migrations_total", outcome="resumed")
    results: list[tuple[str, int, str | None] | BaseException] = [RuntimeError("not run")] * len(prompts)
    going = threading.Barrier(len(prompts) + 1)

    def run(n: int) -> None:
        def on_chunk(count: int) -> None:
            if count == 5:
                going.wait(120)

        try:
            results[n] = _stream_text(fleet_client, prompts[n], max_tokens, on_chunk)
        except BaseException as error:  # every client-visible error is a failure of this test
            results[n] = error

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(prompts))]
    for thread in threads:
        thread.start()
    going.wait(180)
    loads = [fleet.active_streams(i) for i in range(NUM_WORKERS)]
    victim = max(range(NUM_WORKERS), key=lambda i: loads[i])
    survivor = 1 - victim
    os.kill(fleet.worker_pid(victim), signal.SIGKILL)
    for thread in threads:
        thread.join(600)
    for n, result in enumerate(results):
        assert not isinstance(result, BaseException), f"stream {n} failed: {result!r}"
        text, completion_tokens, finish = result
        assert text == reference[n], f"stream {n} differs from one worker's greedy run"
        assert completion_tokens == max_tokens and finish == "length", (n, completion_tokens, finish)
    assert fleet.gateway_value("taco_llm_router_migrations_total", outcome="resumed") - migrations == loads[victim]
    before = fleet.served()
    for n in range(3):
        fleet_client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"after the kill {n}", max_tokens=2)
    assert fleet.served()[survivor] == before[survivor] + 3, "new requests did not go to the survivor"
    fleet.wait_rejoined(victim)


def test_serve_refuses_a_fleet_that_cannot_start(log_dir: Path) -> None:
    """A worker that cannot start at all stops serve, non-zero, naming the cause, with nothing left running."""
    port, grpc_port = free_port(), consecutive_free_ports(NUM_WORKERS)
    run = subprocess.run(
        [sys.executable, "-m", "taco_llm.cli", "serve", "/no/such/model", "--port", str(port), "--grpc-port",
         str(grpc_port), "--num-workers", str(NUM_WORKERS), "--ready-timeout", "300"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert run.returncode != 0
    assert "worker" in run.stdout + run.stderr
    for index in range(NUM_WORKERS):
        assert not grpc_serving(f"127.0.0.1:{grpc_port + index}")
