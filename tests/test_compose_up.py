"""`docker compose up`, for real: the image built from this repository, docker-compose.yml's stack with its
containers as hosts, driven through the gateway with the openai SDK and straight to a worker over gRPC,
and the faults a cluster does to its hosts, each while greedy streams run.

The group (marker `compose`) runs first in the suite (conftest.py) and shares one stack, started once;
its tests run in the order written. Docker is set up when it is missing (Debian's docker.io, started
by hand and stopped again); where it cannot run at all, the group is skipped with the reason printed.
Figures (seconds to the first answer, to drop and to rejoin a worker, the image's size) are printed.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from taco_llm.protos import engine_pb2, engine_pb2_grpc, kv_cache_pb2, kv_cache_pb2_grpc

from .compose_stack import (
    ComposeProject,
    Docker,
    DockerUnavailable,
    build_image,
    disconnected,
    ensure_base_images,
    ensure_docker,
    image_size_bytes,
    wait_for,
)

# The first test also builds the image (minutes, when nothing is cached) and starts the stack.
pytestmark = [pytest.mark.compose, pytest.mark.e2e, pytest.mark.timeout(1800)]

MODEL = "SmolLM2-135M-Instruct"
WORKERS = 2
# Long enough that every fault lands while the streams run (ignore_eos: each is exactly this long).
STREAM_TOKENS = 160
STREAMS = 4
# The gateway must stop routing to a failed worker within this (docs/fleet.md: about 5 s for a partition).
DROP_BOUND_SECONDS = 10.0
# How long a restarted gateway's container may take to answer at all (Python's imports included).
GATEWAY_RESTART_BOUND_SECONDS = 30.0


@dataclass
class Stack:
    project: ComposeProject
    say: object

    @property
    def base_url(self) -> str:
        return self.project.base_url


@pytest.fixture(scope="module")
def say(request: pytest.FixtureRequest) -> object:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        # Shown as it happens, whatever pytest captures: these steps take minutes.
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(f"[compose] {line}")
    return write


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory, say) -> Iterator[Docker]:  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("docker")
    try:
        found = ensure_docker(work, say)
    except DockerUnavailable as why:
        say(f"skipped: {why}")
        pytest.skip(f"docker cannot run here: {why}")
    yield found
    if found.daemon is not None:
        say("stopping the dockerd this group started")
    found.stop_daemon()


@pytest.fixture(scope="module")
def stack(docker: Docker, tmp_path_factory: pytest.TempPathFactory, say) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("compose")
    images = ensure_base_images(docker, work, say)
    seconds = build_image(docker, images.python, say)
    say(f"image built in {seconds:.0f}s (cached layers count), {image_size_bytes(docker) / 1e9:.2f} GB")
    project = ComposeProject(docker, f"tacollmtest{threading.get_native_id()}", images)
    started = time.monotonic()
    try:
        project.up(WORKERS)
        wait_for(lambda: _answer(project.base_url) is not None, 600, "the first answer through the gateway", 1.0)
        say(f"first answer {time.monotonic() - started:.1f}s after `up` ({WORKERS} workers)")
        wait_for(lambda: len(_ready_workers(project.base_url)) == WORKERS, 300, f"{WORKERS} workers ready")
        yield Stack(project, say)
    except BaseException:
        for service in ("worker", "gateway", "cache-service"):
            say(f"--- {service} logs ---\n{project.logs(service)}")
        raise
    finally:
        project.down()


def _answer(base_url: str) -> str | None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                               max_tokens=4, temperature=0)
    except openai.OpenAIError:
        return None
    return reply.choices[0].message.content


def _gateway_metrics(base_url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _ready_workers(base_url: str) -> set[str]:
    """The addresses the gateway routes to now."""
    ready = _gateway_metrics(base_url).get("taco_llm_worker_ready", {})
    return {dict(labels)["worker"] for labels, value in ready.items() if value == 1}


def _load(address: str) -> engine_pb2.Load:
    with grpc.insecure_channel(f"{address}:50051") as channel:
        return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None
    first_token_at: float | None = None


_WORDS = ("harbor", "lantern", "copper", "meadow", "signal", "orchard", "granite", "violet", "compass", "ember",
          "willow", "quartz", "thunder", "saddle", "marble", "falcon", "canyon", "velvet", "anchor", "glacier")


def document(tag: str, words: int = 400) -> str:
    """Deterministic prose of its own per tag: a prompt several KV blocks long (vLLM's CPU blocks hold 128
    tokens, and only whole prompt blocks are offloaded), that no earlier request shares."""
    rng = random.Random(tag)
    return f"Notes {tag}. " + " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


class GreedyStreams:
    """`count` greedy chat streams through the gateway, each exactly `tokens` long, in threads; with
    `long_prompts`, each on a document of its own several KV blocks long."""

    def __init__(self, base_url: str, count: int, *, tokens: int = STREAM_TOKENS, tag: str,
                 long_prompts: bool = False) -> None:
        self.tokens = tokens
        self.long_prompts = long_prompts
        self.results = [StreamResult() for _ in range(count)]
        self._client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        self._pool = ThreadPoolExecutor(count)
        self._futures = [self._pool.submit(self._one, i, f"{tag} {i}") for i in range(count)]

    def _one(self, index: int, tag: str) -> None:
        result = self.results[index]
        messages: list[dict[str, str]] = [{"role": "user", "content": f"[{tag}] Tell me a long story about the sea."}]
        if self.long_prompts:
            messages.insert(0, {"role": "system", "content": document(tag)})
        try:
            stream = self._client.chat.completions.create(
                model=MODEL, messages=messages,  # type: ignore[arg-type]
                max_tokens=self.tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.usage is not None:
                    result.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content and result.first_token_at is None:
                        result.first_token_at = time.monotonic()
                    result.text += choice.delta.content or ""
                    result.finish_reason = choice.finish_reason or result.finish_reason
        except Exception as error:  # every error is what the client saw: the test reports them all
            result.error = f"{type(error).__name__}: {error}"

    def wait_started(self, timeout: float = 300) -> None:
        wait_for(lambda: all(r.first_token_at is not None or r.error for r in self.results), timeout,
                 "every stream's first token")

    def finish(self, timeout: float = 600) -> list[StreamResult]:
        for future in self._futures:
            future.result(timeout)
        self._pool.shutdown()
        return self.results

    def assert_whole(self) -> None:
        """Every stream finished, none lost a token: 0 client-visible errors."""
        results = self.finish()
        errors = [r.error for r in results if r.error]
        assert not errors, f"{len(errors)} of {len(results)} streams failed: {errors}"
        for r in results:
            assert r.finish_reason == "length" and r.completion_tokens == self.tokens, r


def _busy_worker(project: ComposeProject) -> str:
    """A worker container with streams running on it now."""
    for container in project.containers("worker"):
        if _load(project.address(container)).num_running_requests > 0:
            return container
    raise AssertionError("no worker is running a request")


def test_up_answers_through_the_gateway_and_straight_over_grpc(stack: Stack) -> None:
    project = stack.project
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens > 0
    # A gRPC client calling a worker directly, at its container's address on the compose network.
    worker = project.address(project.containers("worker")[0])
    with grpc.insecure_channel(f"{worker}:50051") as channel:
        messages = list(engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest(
            text="The capital of France is", sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=8)),
            timeout=120))
    phases = [m.WhichOneof("phase") for m in messages]
    assert phases[0] == "started" and phases[-1] == "finished" and "delta" in phases
    assert messages[-1].finished.usage.completion_tokens == 8


def test_the_image_runs_as_a_user_with_what_vllm_loads(stack: Stack) -> None:
    docker = stack.project.docker
    # vLLM's CPU kernels as vLLM loads them: the library for this CPU's instruction set (vllm._C itself
    # needs AVX-512 with bf16, and dies of an illegal instruction on an AVX2 machine).
    probe = docker.run("run", "--rm", "--entrypoint", "sh", stack.project.image, "-c",
                       "id -u; python -c 'from vllm.platforms import current_platform; "
                       "current_platform.import_kernels(); import torch, taco_llm.gateway; "
                       "print(\"ok\" if hasattr(torch.ops._C, \"rms_norm\") else \"no-kernels\")'")
    uid, ok = probe.stdout.split()[:2]
    assert int(uid) != 0 and ok == "ok", probe.stdout + probe.stderr


def test_scaling_to_three_joins_a_worker_that_takes_traffic(stack: Stack) -> None:
    project = stack.project
    before = set(project.containers("worker"))
    started = time.monotonic()
    project.up(3)
    (new,) = set(project.containers("worker")) - before
    address = project.address(new)
    wait_for(lambda: f"{address}:50051" in _ready_workers(stack.base_url), 300, "the third worker joining")
    joined = time.monotonic() - started
    # Distinct prompts spread over the fleet's caches: the new, empty worker gets its share.
    streams = GreedyStreams(stack.base_url, 6, tokens=8, tag="scale")
    streams.assert_whole()
    with urllib.request.urlopen(f"http://{address}:9100/metrics", timeout=5) as reply:
        worker_metrics = reply.read().decode()
    finished = sum(s.value for f in text_string_to_metric_families(worker_metrics) for s in f.samples
                   if s.name == "vllm:request_success_total")
    stack.say(f"--scale worker=3: the third worker ready {joined:.1f}s after `up`, served {finished:.0f} requests")
    assert finished > 0, "the third worker took no request"
    project.up(WORKERS)  # back to two: a scale-down stops a worker, which drains
    wait_for(lambda: len(_ready_workers(stack.base_url)) == WORKERS, 120, "back to two workers")


def test_a_killed_worker_s_streams_finish_and_it_rejoins(stack: Stack) -> None:
    project = stack.project
    # `docker kill`: the host is gone. Docker counts a kill as a stop by hand and does not restart the
    # container (an orchestrator would): the test starts it again, a new incarnation of the same instance.
    streams = GreedyStreams(stack.base_url, STREAMS, tag="kill")
    streams.wait_started()
    victim = _busy_worker(project)
    address = f"{project.address(victim)}:50051"
    killed = time.monotonic()
    # In a thread: `docker kill` returns once every process has exited, which can take a minute (see kill).
    killing = threading.Thread(target=project.kill, args=(victim,))
    killing.start()
    dropped = wait_for(lambda: address not in _ready_workers(stack.base_url), DROP_BOUND_SECONDS, "dropping it")
    streams.assert_whole()
    killing.join(600)
    project.docker.run("start", victim)
    new_address = f"{project.address(victim)}:50051"
    rejoined = wait_for(lambda: new_address in _ready_workers(stack.base_url), 300, "the killed worker rejoining")
    stack.say(f"docker kill: dropped in {dropped:.1f}s, {STREAMS}/{STREAMS} streams whole, "
              f"rejoined {rejoined:.1f}s after `docker start` ({time.monotonic() - killed:.0f}s in all)")

    # A crash (the OOM killer's SIGKILL to the worker's process): the restart policy brings it back.
    streams = GreedyStreams(stack.base_url, STREAMS, tag="crash")
    streams.wait_started()
    victim = _busy_worker(project)
    restarts = project.restart_count(victim)
    project.crash(victim)
    streams.assert_whole()
    wait_for(lambda: project.restart_count(victim) > restarts, 60, "docker restarting the crashed worker")
    address = f"{project.address(victim)}:50051"
    rejoined = wait_for(lambda: address in _ready_workers(stack.base_url), 300, "the crashed worker rejoining")
    stack.say(f"worker crash: {STREAMS}/{STREAMS} streams whole, restarted by docker, rejoined in {rejoined:.1f}s")


def test_a_partitioned_worker_is_dropped_its_streams_move_and_it_rejoins(stack: Stack) -> None:
    project = stack.project
    streams = GreedyStreams(stack.base_url, STREAMS, tag="partition")
    streams.wait_started()
    victim = _busy_worker(project)
    address = f"{project.address(victim)}:50051"
    with disconnected(project, victim):
        dropped = wait_for(lambda: address not in _ready_workers(stack.base_url), DROP_BOUND_SECONDS,
                           "dropping the partitioned worker")
        streams.assert_whole()
    new_address = f"{project.address(victim)}:50051"
    rejoined = wait_for(lambda: new_address in _ready_workers(stack.base_url), 60, "the worker rejoining")
    stack.say(f"partition: dropped in {dropped:.1f}s (bound {DROP_BOUND_SECONDS:.0f}s), {STREAMS}/{STREAMS} "
              f"streams whole, rejoined {rejoined:.1f}s after reconnecting ({address} -> {new_address})")


def _cache_stats(project: ComposeProject) -> kv_cache_pb2.StatsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{project.cache_service_port}") as channel:
        return kv_cache_pb2_grpc.KVBlockStoreStub(channel).Stats(kv_cache_pb2.StatsRequest(), timeout=5)


def test_workers_recompute_while_the_cache_service_is_down_or_cut_off(stack: Stack) -> None:
    project = stack.project
    (service,) = project.containers("cache-service")
    GreedyStreams(stack.base_url, STREAMS, tokens=8, tag="cache-warm", long_prompts=True).assert_whole()
    before = _cache_stats(project)
    assert before.incarnation and before.blocks_stored > 0, "the workers offloaded nothing to begin with"

    streams = GreedyStreams(stack.base_url, STREAMS, tag="cache-crash", long_prompts=True)
    streams.wait_started()
    project.crash(service)  # Docker's restart policy brings it back, empty
    streams.assert_whole()
    back = wait_for(lambda: _cache_stats(project).incarnation not in ("", before.incarnation), 120,
                    "the cache service back")
    # The workers reconnect: what they offload next reaches the new service.
    GreedyStreams(stack.base_url, STREAMS, tokens=8, tag="cache-back", long_prompts=True).assert_whole()
    wait_for(lambda: _cache_stats(project).blocks_stored > 0, 60, "blocks stored in the restarted service")

    streams = GreedyStreams(stack.base_url, STREAMS, tag="cache-cut", long_prompts=True)
    streams.wait_started()
    with disconnected(project, service):
        started = time.monotonic()
        streams.assert_whole()
        cut = time.monotonic() - started
        # New prompts while it is cut off: looked up, saved, neither ever answered; they must not wait on it.
        GreedyStreams(stack.base_url, STREAMS, tokens=8, tag="cache-while-cut", long_prompts=True).assert_whole()
    stored = _cache_stats(project).blocks_stored
    GreedyStreams(stack.base_url, STREAMS, tokens=8, tag="cache-reconnected", long_prompts=True).assert_whole()
    wait_for(lambda: _cache_stats(project).blocks_stored > stored, 60, "blocks stored after reconnecting")
    stack.say(f"cache service: crash {STREAMS}/{STREAMS} streams whole, back in {back:.1f}s, offloaded to again; "
              f"cut off {STREAMS}/{STREAMS} streams whole ({cut:.1f}s), offloaded to again once reconnected")


def _redis(project: ComposeProject, *args: str) -> str:
    (redis,) = project.containers("redis")
    return project.docker.run("exec", redis, "redis-cli", *args).stdout


def test_a_redis_restart_keeps_the_pool_and_the_lookahead_index(stack: Stack) -> None:
    project = stack.project
    index_keys = sorted(_redis(project, "--scan", "--pattern", "taco_llm:lookahead:*").split())
    lengths = {key: int(_redis(project, "xlen", key)) for key in index_keys
               if _redis(project, "type", key).strip() == "stream"}
    assert lengths and all(lengths.values()), f"no lookahead index in Redis to keep: {index_keys}"
    streams = GreedyStreams(stack.base_url, STREAMS, tag="redis")
    streams.wait_started()
    # The gateway's pool, read every 0.2 s across the restart; a read that fails is recorded as such.
    samples: list[int | str] = []
    watching = threading.Event()
    watching.set()

    def watch() -> None:
        while watching.is_set():
            try:
                samples.append(len(_ready_workers(stack.base_url)))
            except Exception as error:  # the test reports it
                samples.append(f"{type(error).__name__}: {error}")
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        (redis,) = project.containers("redis")
        restarted = time.monotonic()
        project.docker.run("restart", redis)
        restart_seconds = time.monotonic() - restarted
        streams.assert_whole()
        wait_for(lambda: len(_redis(project, "-n", "1", "--scan", "--pattern", "taco_llm:workers:*").split())
                 == WORKERS, 30, "the registry re-formed")
    finally:
        watching.clear()
        watcher.join()
    assert len(samples) >= restart_seconds / 0.5, f"too few samples of the pool across the restart: {samples}"
    assert all(sample == WORKERS for sample in samples), f"the pool changed while Redis restarted: {samples}"
    for key, length in lengths.items():
        assert int(_redis(project, "xlen", key)) >= length, f"{key} lost records over the restart"
    stack.say(f"redis restart ({restart_seconds:.1f}s): the pool kept {WORKERS} workers in all {len(samples)} "
              f"samples, the registry re-formed, {len(lengths)} lookahead streams back from the append-only file")


def test_a_restarted_gateway_finds_every_worker_before_it_serves(stack: Stack) -> None:
    """The gateway lists the registry before it takes connections: its first answer already routes to
    every worker. Measured from the container's start (Docker's StartedAt), so Python's own start-up
    (imports) counts too."""
    project = stack.project
    (gateway,) = project.containers("gateway")
    project.docker.run("restart", "--time", "20", gateway)
    started_at = project.docker.run("inspect", gateway, "--format", "{{.State.StartedAt}}").stdout.strip()
    first: set[str] | None = None
    deadline = time.monotonic() + GATEWAY_RESTART_BOUND_SECONDS
    while first is None:
        assert time.monotonic() < deadline, "the restarted gateway did not answer"
        with contextlib.suppress(OSError):
            first = _ready_workers(stack.base_url)
        time.sleep(0.02)
    answered = datetime.datetime.now(datetime.UTC)
    since_start = (answered - _docker_time(started_at)).total_seconds()
    assert len(first) == WORKERS, f"its first answer routed to {sorted(first)} only"
    assert _answer(stack.base_url)
    stack.say(f"gateway restart: its first answer, {since_start:.1f}s after its container started, already "
              f"routed to all {WORKERS} workers")


def _docker_time(text: str) -> datetime.datetime:
    # Docker's RFC 3339 with nanoseconds: fromisoformat takes at most microseconds.
    head, _, fraction = text.rstrip("Z").partition(".")
    return datetime.datetime.fromisoformat(f"{head}.{(fraction + '000000')[:6]}+00:00")


def test_down_leaves_no_container_network_or_volume(stack: Stack) -> None:
    project = stack.project
    assert project.leftovers()["volumes"], "the Redis volume should exist before `down -v`"
    project.down()
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}

