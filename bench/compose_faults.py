"""docker-compose.yml's stack under the faults a cluster does to its hosts: what a client sees, and how
soon the fleet routes around the failed part and takes it back.

    python bench/compose_faults.py [--rate 2.0] [--window 20] [--hold 20] [--faults worker_kill,...]
                                   [--cold-build] [--out bench/results/compose_faults.json]

The stack: the image built from this repository (`make image`; `--cold-build` builds it without Docker's
cache first, for the cold-build time), `docker compose up --scale worker=2` (tests/compose_stack.py sets up
Docker, and makes base images from Debian's packages where no registry answers), the first answer timed
from `up`.

Workload: streamed greedy chats at a steady --rate per second through the gateway (the openai SDK, no
retries: every failure counts), each on one of 4 pseudo-documents (bench/fleet.py's, about 600 tokens:
a shared prefix that the prefix cache and the offload hold) with a short question, 24 output tokens.

For each fault, in turn: --window seconds of traffic before it; the fault; --hold seconds with it; the
repair; --window seconds after the part is back. Reported per fault:
- requests sent and lost (an error, or a stream cut short), before, during and after;
- TTFT p50 and p99 during the fault and after it;
- detect_s: from the fault until the gateway stops routing to the failed part (worker faults; for the
  gateway's own restart, until it answers again);
- rejoin_s: from the repair until the part is routed to (a worker), serving again (the cache service:
  its new incarnation answers), or the gateway routes to every worker.

Faults: worker_kill (`docker kill` of a busy worker, `docker start` as the repair), worker_crash (SIGKILL to
the worker's process, as the OOM killer does: Docker's restart policy repairs it), worker_partition
(`docker network disconnect`, then connect), cache_kill (SIGKILL to the cache service's process: restarted
by Docker), cache_partition, redis_restart (`docker restart`), gateway_restart (`docker restart`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from fleet import chat, document_text, percentile
from servers import ROOT, save_report

sys.path.insert(0, str(ROOT))

import grpc
from prometheus_client.parser import text_string_to_metric_families

from taco_llm.protos import engine_pb2, engine_pb2_grpc, kv_cache_pb2, kv_cache_pb2_grpc
from tests.compose_stack import (
    ComposeProject,
    build_image,
    ensure_base_images,
    ensure_docker,
    image_size_bytes,
    wait_for,
)

MODEL = "SmolLM2-135M-Instruct"
WORKERS = 2
DOCUMENTS = 4
OUTPUT_TOKENS = 24
FAULTS = ("worker_kill", "worker_crash", "worker_partition", "cache_kill", "cache_partition", "redis_restart",
          "gateway_restart")
QUESTIONS = ("Summarize it in one sentence.", "Which names come up most?", "Give it a title.",
             "What is paragraph 2 about?", "List three facts from it.")


@dataclass
class Reply:
    sent: float
    phase: str
    ttft: float | None = None
    error: str | None = None


@dataclass
class Load:
    """Requests at a steady rate until stopped; each reply tagged with the phase it was sent in."""

    base_url: str
    rate: float
    seed: int
    phase: str = "before"
    replies: list[Reply] = field(default_factory=list)
    _stop: bool = False

    async def run(self) -> None:
        client = openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        documents = [document_text(i, self.seed, 450) for i in range(DOCUMENTS)]
        rng = random.Random(self.seed)
        tasks: set[asyncio.Task[None]] = set()
        next_send = time.monotonic()
        while not self._stop:
            messages = chat(rng.choice(documents), rng.choice(QUESTIONS))
            task = asyncio.create_task(self._one(client, messages))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_send += 1 / self.rate
            await asyncio.sleep(max(0.0, next_send - time.monotonic()))
        await asyncio.gather(*tasks)
        await client.close()

    async def _one(self, client: openai.AsyncOpenAI, messages: Any) -> None:
        reply = Reply(time.monotonic(), self.phase)
        self.replies.append(reply)
        tokens = 0
        try:
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=OUTPUT_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and reply.ttft is None:
                    reply.ttft = time.monotonic() - reply.sent
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if tokens != OUTPUT_TOKENS:
                reply.error = f"cut short: {tokens} of {OUTPUT_TOKENS} tokens"
        except Exception as error:  # what the client saw, counted as lost
            reply.error = f"{type(error).__name__}: {str(error)[:200]}"

    def stop(self) -> None:
        self._stop = True


def _ready_workers(base_url: str) -> set[str]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {s.labels["worker"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "taco_llm_worker_ready" and s.value == 1}


def _cache_incarnation(project: ComposeProject) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{project.cache_service_port}") as channel:
        stats = kv_cache_pb2_grpc.KVBlockStoreStub(channel).Stats(kv_cache_pb2.StatsRequest(), timeout=3)
    return str(stats.incarnation)


def _busy_worker(project: ComposeProject) -> str:
    best, most = project.containers("worker")[0], -1
    for container in project.containers("worker"):
        with grpc.insecure_channel(f"{project.address(container)}:50051") as channel:
            load = engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        if load.num_running_requests > most:
            best, most = container, load.num_running_requests
    return best


@dataclass
class Timing:
    detect_s: float | None = None
    rejoin_s: float | None = None


async def _fault(name: str, project: ComposeProject, hold: float) -> Timing:
    """Does the fault, holds it, repairs it; the detection and rejoin times."""
    docker, base_url = project.docker, project.base_url
    timing = Timing()

    async def waited(condition: Callable[[], bool], timeout: float, what: str) -> float:
        return await asyncio.to_thread(wait_for, condition, timeout, what, 0.1)

    async def held(started: float) -> None:
        await asyncio.sleep(max(0.0, hold - (time.monotonic() - started)))

    if name.startswith("worker_"):
        victim = await asyncio.to_thread(_busy_worker, project)
        address = f"{project.address(victim)}:50051"
        started = time.monotonic()
        # Timed from the fault, concurrently: `docker kill` returns only once every process has exited, which
        # can take a minute and more (tests/compose_stack.py, ComposeProject.kill).
        if name == "worker_kill":
            faulted = asyncio.ensure_future(asyncio.to_thread(project.kill, victim))
        elif name == "worker_crash":
            faulted = asyncio.ensure_future(asyncio.to_thread(project.crash, victim))
        else:
            faulted = asyncio.ensure_future(
                asyncio.to_thread(docker.run, "network", "disconnect", project.network(), victim))
        timing.detect_s = await waited(lambda: address not in _ready_workers(base_url), 60, "the worker dropped")
        await faulted
        await held(started)
        repaired = time.monotonic()
        if name == "worker_kill":
            await asyncio.to_thread(docker.run, "start", victim)
        elif name == "worker_partition":
            await asyncio.to_thread(docker.run, "network", "connect", project.network(), victim)

        def back() -> bool:
            return f"{project.address(victim)}:50051" in _ready_workers(base_url)

        timing.rejoin_s = await waited(back, 600, "the worker rejoining")
        if name == "worker_crash":
            timing.rejoin_s += repaired - started  # Docker's restart began at the crash
    elif name.startswith("cache_"):
        (service,) = project.containers("cache-service")
        incarnation = await asyncio.to_thread(_cache_incarnation, project)
        started = time.monotonic()
        if name == "cache_kill":
            await asyncio.to_thread(project.crash, service)
            timing.rejoin_s = await waited(lambda: _cache_incarnation(project) not in ("", incarnation), 300,
                                           "the cache service restarted")
            await held(started)
        else:
            await asyncio.to_thread(docker.run, "network", "disconnect", project.network(), service)
            await held(started)
            repaired = time.monotonic()
            await asyncio.to_thread(docker.run, "network", "connect", project.network(), service)
            await waited(lambda: bool(_cache_incarnation(project)), 60, "the cache service reachable")
            timing.rejoin_s = time.monotonic() - repaired
    elif name == "redis_restart":
        (redis,) = project.containers("redis")
        started = time.monotonic()
        await asyncio.to_thread(docker.run, "restart", redis)
        await held(started)
    elif name == "gateway_restart":
        (gateway,) = project.containers("gateway")
        started = time.monotonic()
        await asyncio.to_thread(docker.run, "restart", "--time", "30", gateway)
        timing.detect_s = None
        timing.rejoin_s = await waited(lambda: len(_ready_workers(base_url)) == WORKERS, 120,
                                       "the gateway routing to every worker")
        await held(started)
    else:
        raise ValueError(f"unknown fault {name}")
    return timing


def _summary(replies: list[Reply], phase: str) -> dict[str, Any]:
    chosen = [r for r in replies if r.phase == phase]
    ttfts = [r.ttft for r in chosen if r.ttft is not None and r.error is None]
    errors = [r.error for r in chosen if r.error]
    return {"sent": len(chosen), "lost": len(errors), "errors": sorted(set(errors))[:5],
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99)}


async def _run_fault(name: str, project: ComposeProject, args: argparse.Namespace) -> dict[str, Any]:
    load = Load(project.base_url, args.rate, args.seed)
    runner = asyncio.create_task(load.run())
    await asyncio.sleep(args.window)
    load.phase = "during"
    timing = await _fault(name, project, args.hold)
    # Every part is back (a worker routed to again): the fleet's own view, checked before "after" starts.
    await asyncio.to_thread(wait_for, lambda: len(_ready_workers(project.base_url)) == WORKERS, 600, "all workers")
    load.phase = "after"
    await asyncio.sleep(args.window)
    load.stop()
    await runner
    row = {"fault": name, "detect_s": timing.detect_s, "rejoin_s": timing.rejoin_s,
           **{phase: _summary(load.replies, phase) for phase in ("before", "during", "after")}}
    print(f"{name}: lost {sum(row[p]['lost'] for p in ('before', 'during', 'after'))} of "  # type: ignore[index]
          f"{len(load.replies)}, detect {timing.detect_s}, rejoin {timing.rejoin_s}, "
          f"TTFT p50/p99 during {row['during']['ttft_p50_s']}/{row['during']['ttft_p99_s']}", flush=True)
    return row


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="compose-faults-"))
    docker = ensure_docker(work, print)
    report: dict[str, Any] = {"workers": WORKERS, "rate_per_s": args.rate, "window_s": args.window,
                              "hold_s": args.hold, "output_tokens": OUTPUT_TOKENS, "rows": []}
    project: ComposeProject | None = None
    try:
        images = ensure_base_images(docker, work, print)
        if args.cold_build:
            report["cold_build_s"] = build_image(docker, images.python, print, cached=False)
            save_report(args.out, report)
        report["build_s"] = build_image(docker, images.python, print)
        report["image_bytes"] = image_size_bytes(docker)
        project = ComposeProject(docker, "tacollmbench", images)
        started = time.monotonic()
        project.up(WORKERS)
        wait_for(lambda: len(_ready_workers(project.base_url)) == WORKERS, 900, "the workers ready", 0.5)
        report["up_to_workers_ready_s"] = time.monotonic() - started
        print(f"stack up: both workers routed to {report['up_to_workers_ready_s']:.1f}s after `up`", flush=True)
        save_report(args.out, report)
        for name in args.faults:
            report["rows"].append(await _run_fault(name, project, args))
            save_report(args.out, report)
    finally:
        if project is not None:
            project.down()
        docker.stop_daemon()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (default 2)")
    parser.add_argument("--window", type=float, default=20, help="seconds of traffic before and after each fault")
    parser.add_argument("--hold", type=float, default=20, help="seconds each fault lasts before its repair")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        type=lambda text: [f for f in text.split(",") if f],
                        help=f"which, in order (default: all: {','.join(FAULTS)})")
    parser.add_argument("--cold-build", action="store_true", help="time a build without Docker's cache first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compose_faults.json")
    args = parser.parse_args()
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        parser.error(f"--faults: unknown {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    with contextlib.suppress(KeyboardInterrupt):
        report = asyncio.run(_main(args))
        save_report(args.out, report)
        print(f"report: {args.out}")


if __name__ == "__main__":
    main()
