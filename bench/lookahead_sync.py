"""How soon an output finished on one worker reaches the others' lookahead index, and what sharing costs on
the wire and in Redis.

    python bench/lookahead_sync.py [--workers 2,4] [--rate 20] [--seconds 20] [--out bench/results/lookahead_sync.json]

Each simulated worker is a process of its own running the worker's real sync code (IndexSync from
engine_worker/core/lookahead/sync.py) against a real cache service and a real redis-server this script starts.
Each publishes finished sequences (--prompt-tokens + --output-tokens random tokens) at Poisson arrivals of
--rate a second, and drains its inbox every millisecond, as the proposer does each engine step. Measured,
per sequence and per other worker: the time from `publish` (the request finishing) to its arrival in that
worker's inbox. A sequence in the inbox is drafted from at the worker's next engine step, so what a user
sees adds at most one step (about 30 ms on these CPUs at batch 1) to these figures.

Written: per worker count, the latency percentiles, sequences lost, and bytes per generated (output) token:
published over gRPC, received over gRPC by all other workers together, and held in Redis (MEMORY USAGE of
the stream). No engine runs: the bench isolates the sync path. A script, not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import redis
from servers import ROOT, free_port, launch, stop, wait_grpc_healthy

VOCABULARY = 49152  # the default model's
DRAIN_SECONDS = 0.001
GRACE_SECONDS = 3.0


@dataclass(frozen=True)
class Load:
    address: str
    namespace: str
    workers: int
    rate: float  # sequences a second, per worker
    seconds: float
    prompt_tokens: int
    output_tokens: int
    start_at: float  # time.time() at which every worker starts publishing


@dataclass
class WorkerReport:
    index: int
    sent: dict[int, float]  # sequence number -> time.time() of publish
    received: list[tuple[int, int, float]]  # (sender, sequence number, time.time() of arrival in the inbox)
    published_bytes: int
    output_tokens: int


def simulated_worker(load: Load, index: int, results: Queue[WorkerReport]) -> None:
    sys.path.insert(0, str(ROOT))
    from taco_llm.engine_worker.core.lookahead.sync import IndexSync
    from taco_llm.protos import lookahead_pb2

    sync = IndexSync(load.address, load.namespace, origin=f"bench-{index}")
    sync.start()
    sync.caught_up.wait(30)
    received: list[tuple[int, int, float]] = []
    stopping = threading.Event()

    def drain() -> None:
        while not stopping.is_set():
            while sync.inbox:
                sequence = sync.inbox.popleft()
                received.append((sequence.output[0], sequence.output[1], time.time()))
            time.sleep(DRAIN_SECONDS)

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    rng = random.Random(index)
    sent: dict[int, float] = {}
    published_bytes = 0
    time.sleep(max(0.0, load.start_at - time.time()))
    end = time.time() + load.seconds
    next_at = time.time()
    while next_at < end:
        time.sleep(max(0.0, next_at - time.time()))
        number = len(sent)
        prompt = [rng.randrange(VOCABULARY) for _ in range(load.prompt_tokens)]
        # The first two output tokens say whose sequence it is: its sender and its number.
        output = [index, number, *(rng.randrange(VOCABULARY) for _ in range(load.output_tokens - 2))]
        sent[number] = time.time()
        sync.publish(prompt, output)
        published_bytes += lookahead_pb2.Record(prompt=prompt, output=output, origin=sync.origin,
                                                created_unix=sent[number]).ByteSize()
        next_at += rng.expovariate(load.rate)
    time.sleep(GRACE_SECONDS)
    stopping.set()
    drainer.join()
    sync.stop()
    results.put(WorkerReport(index, sent, received, published_bytes, len(sent) * load.output_tokens))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(address: str, redis_client: redis.Redis, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    namespace = f"bench-sync-{workers}-{os.getpid()}"
    load = Load(address, namespace, workers, args.rate, args.seconds, args.prompt_tokens, args.output_tokens,
                start_at=time.time() + 5.0)
    context = multiprocessing.get_context("spawn")
    results: Queue[WorkerReport] = context.Queue()
    processes = [context.Process(target=simulated_worker, args=(load, i, results)) for i in range(workers)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=load.seconds + 120) for _ in processes]
    for process in processes:
        process.join(30)
    sent = {report.index: report.sent for report in reports}
    latencies: list[float] = []
    for report in reports:
        for sender, number, arrived in report.received:
            latencies.append(arrived - sent[sender][number])
    expected = sum(len(report.sent) for report in reports) * (workers - 1)
    output_tokens = sum(report.output_tokens for report in reports)
    published = sum(report.published_bytes for report in reports)
    redis_bytes = int(redis_client.memory_usage(f"taco_llm:lookahead:{namespace}", samples=0) or 0)
    redis_client.delete(f"taco_llm:lookahead:{namespace}")
    row = {
        "workers": workers,
        "sequences": sum(len(report.sent) for report in reports),
        "output_tokens_per_second": round(output_tokens / args.seconds),
        "deliveries": len(latencies),
        "lost": expected - len(latencies),
        "latency_ms": {name: round(1000 * percentile(latencies, q), 2)
                       for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))} if latencies else {},
        "bytes_per_output_token": {
            "grpc_published": round(published / output_tokens, 2),
            # Every other worker receives each record once (plus its stream id, about 20 bytes).
            "grpc_received_by_all_others": round(published * (workers - 1) / output_tokens, 2),
            "redis_held": round(redis_bytes / output_tokens, 2),
        },
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts to measure, comma-separated")
    parser.add_argument("--rate", type=float, default=20.0, help="finished sequences a second, per worker")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lookahead_sync.json")
    args = parser.parse_args()
    counts = [int(count) for count in args.workers.split(",")]
    if any(count < 2 for count in counts):
        parser.error("--workers: sharing needs at least 2 workers")
    if args.output_tokens < 2:
        parser.error("--output-tokens: at least 2 (the first two mark the sequence)")
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        parser.error("redis-server is not on PATH")
    workdir = Path(tempfile.mkdtemp(prefix="bench_lookahead_sync_"))
    redis_port, cache_port = free_port(), free_port()
    redis_process = launch([redis_server, "--port", str(redis_port), "--save", "", "--appendonly", "no",
                            "--dir", str(workdir)], workdir / "redis.log")
    cache = launch([sys.executable, "-m", "taco_llm.cache_service", "--grpc-port", str(cache_port), "--redis-url",
                    f"redis://127.0.0.1:{redis_port}/0"], workdir / "cache_service.log")
    rows = []
    try:
        wait_grpc_healthy(f"127.0.0.1:{cache_port}", [cache, redis_process])
        client = redis.Redis(port=redis_port)
        for count in counts:
            rows.append(run(f"127.0.0.1:{cache_port}", client, count, args))
    finally:
        stop(cache)
        stop(redis_process)
        shutil.rmtree(workdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    args.out.write_text(json.dumps({"settings": settings, "rows": rows, "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
