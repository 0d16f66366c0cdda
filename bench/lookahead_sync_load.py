"""How soon an answer finished on one worker is draftable on the others, with the engines under load.

    python bench/lookahead_sync_load.py [--workers 2,4] [--concurrency 8] [--seconds 60] [--max-tokens 64]
                                        [--out bench/results/lookahead_sync_load.json]

bench/lookahead_sync.py times the sync path alone. This times it where users meet it. For each worker count
there is one `taco_llm serve --num-workers K --routing round_robin` (float32, TACO-LLM's default lookahead
config), so the workers share one index through the Redis serve starts for them. Clients keep --concurrency
chats running for --seconds, and every answer is new to the index: a story or a product card, numbered.

Every worker times each sequence another worker finished: from that finish to the engine step that indexes
it, where it becomes draftable. The histogram is taco_llm_lookahead_sync_delivery_seconds, and this reads
its gain over the timed part from the workers' own metrics. What arrives while a worker has no step to run
waits for its next request; under steady load that gap is small.

Written, per worker count:
- output tok/s, requests finished, and each worker's mean engine step;
- deliveries timed, beside the (K-1) per finished request that full delivery would give (the last few are
  still in flight when the clients stop);
- p50, p90 and p99, interpolated within the histogram's buckets as Prometheus's histogram_quantile does,
  of delivery and of arrival in the inbox (taco_llm_lookahead_sync_arrival_seconds), which leaves out the
  wait for the next step;
- the share of deliveries within 100 ms.

A script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fleet as fleet_bench
import lookahead as lookahead_bench
import openai
from servers import ROOT, free_port, write_report

DELIVERY = "taco_llm_lookahead_sync_delivery_seconds"
ARRIVAL = "taco_llm_lookahead_sync_arrival_seconds"
STEPS = "taco_llm_lookahead_steps_total"
TARGET_SECONDS = 0.1


def serve_argv(workers: int, config_dir: Path) -> tuple[list[str], str]:
    port = free_port()
    grpc_base, metrics_base = fleet_bench.free_port_run(workers), fleet_bench.free_port_run(workers)
    argv = [sys.executable, "-m", "taco_llm.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_base),
            "--metrics-port", str(metrics_base), "--num-workers", str(workers), "--routing", "round_robin",
            "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16", "--kv-cache-memory-bytes",
            "512M", "--seed", "0", "--cache-service-port", str(free_port()),
            *lookahead_bench.method_flags("lookahead", config_dir)]
    return argv, f"http://127.0.0.1:{port}"


def chat(number: int) -> list[dict[str, str]]:
    """A request whose answer no earlier one gave: the topic or item cycles, the number does not."""
    if number % 2:
        item = lookahead_bench.ITEMS[number % len(lookahead_bench.ITEMS)]
        return [{"role": "user", "content": f"Product card number {number}:\n"
                 + lookahead_bench.TEMPLATE.format(item=item)}]
    topic = lookahead_bench.TOPICS[number % len(lookahead_bench.TOPICS)]
    return [{"role": "user", "content": f"Write story number {number}, a short one about {topic}."}]


async def keep_busy(base_url: str, concurrency: int, seconds: float, max_tokens: int) -> tuple[int, int, float]:
    """`concurrency` clients, each sending its next chat when the last is answered, until `seconds` have
    passed. Requests finished, output tokens, and the seconds it took."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=900)
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9))
    finished = tokens = 0

    async def client_loop() -> None:
        nonlocal finished, tokens
        while time.monotonic() < deadline:
            reply = await client.chat.completions.create(
                model=lookahead_bench.MODEL, messages=chat(next(counter)),  # type: ignore[arg-type]
                max_tokens=max_tokens, temperature=0)
            finished += 1
            tokens += reply.usage.completion_tokens if reply.usage else 0

    started = time.monotonic()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    await client.close()
    return finished, tokens, elapsed


def cumulative_buckets(snapshot: fleet_bench.Snapshot, histogram: str) -> list[tuple[float, float]]:
    """A histogram's buckets summed over the workers, as (upper bound, count so far), sorted."""
    sums: dict[float, float] = {}
    for (name, labels), value in snapshot.items():
        if name == f"{histogram}_bucket":
            bound = float(dict(labels)["le"])
            sums[bound] = sums.get(bound, 0.0) + value
    return sorted(sums.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile, interpolated linearly within its bucket (as Prometheus does); None with no counts.
    A quantile in the +Inf bucket reads as the highest finite bound."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def within(buckets: list[tuple[float, float]], bound: float) -> float | None:
    counts = dict(buckets)
    total = buckets[-1][1] if buckets else 0.0
    return counts[bound] / total if total and bound in counts else None


def run(workers: int, args: argparse.Namespace, config_dir: Path) -> dict[str, Any]:
    argv, url = serve_argv(workers, config_dir)
    fleet = fleet_bench.Fleet(argv, url, args.log_dir / f"lookahead_sync_load-{workers}.log", num_workers=workers)
    print(f"starting serve --num-workers {workers}", flush=True)
    fleet.start()
    try:
        asyncio.run(keep_busy(url, workers, 1.0, 8))  # warm-up: every worker has run a step
        before = fleet.worker_metrics() or {}
        finished, tokens, elapsed = asyncio.run(keep_busy(url, args.concurrency, args.seconds, args.max_tokens))
        after = fleet.worker_metrics() or {}
    finally:
        fleet.stop()
    gained = fleet_bench.difference(after, before)
    buckets = cumulative_buckets(gained, DELIVERY)
    timed = buckets[-1][1] if buckets else 0.0
    steps = fleet_bench.total(gained, STEPS)
    row: dict[str, Any] = {
        "workers": workers, "requests_finished": finished, "output_tok_s": round(tokens / elapsed, 1),
        # The engine steps of each worker, on average: a delivered sequence waits for the next one.
        "mean_step_ms": round(elapsed * workers / steps * 1000, 1) if steps else None,
        "deliveries_timed": timed, "deliveries_at_full_delivery": finished * (workers - 1),
        "within_100ms": within(buckets, TARGET_SECONDS)}
    for what, histogram in (("delivery", DELIVERY), ("arrival", ARRIVAL)):
        found = cumulative_buckets(gained, histogram)
        for q in (0.5, 0.9, 0.99):
            value = quantile(found, q)
            row[f"{what}_p{round(q * 100)}_ms"] = None if value is None else round(value * 1000, 1)
        row[f"{what}_buckets"] = {("+Inf" if bound == float("inf") else f"{bound:g}"): count
                                  for bound, count in found}
    print(f"{workers} workers: {row['output_tok_s']} tok/s, {finished} requests, step {row['mean_step_ms']} ms, "
          f"{timed:.0f} deliveries timed; delivery p50/p90/p99 {row['delivery_p50_ms']}/{row['delivery_p90_ms']}/"
          f"{row['delivery_p99_ms']} ms (within 100 ms: {row['within_100ms']}); arrival p50/p90/p99 "
          f"{row['arrival_p50_ms']}/{row['arrival_p90_ms']}/{row['arrival_p99_ms']} ms", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts, one fleet each")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lookahead_sync_load.json")
    args = parser.parse_args()
    try:
        counts = [int(k) for k in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers: worker counts separated by commas, such as 2,4 (got {args.workers})")
    if any(k < 2 for k in counts):
        parser.error(f"--workers: each count at least 2, as sharing needs another worker (got {args.workers})")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as config_dir:
        rows = [run(k, args, Path(config_dir)) for k in counts]
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(), "results": rows}
    write_report(args.out, report, [{k: v for k, v in row.items() if not k.endswith("_buckets")} for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
