"""Sustained load: many concurrent streaming clients for a long while, and how latency and each process's
memory and file descriptors move over time (tests/test_soak_e2e.py is the short, asserted version).

    python bench/soak.py [--duration 180 | --requests N] [--concurrency 64] [--max-tokens 32]
                         [--window 30] [--sample-every 5] [--url URL --pid PID [--model NAME]]
                         [--out bench/results/soak.json]

Server: `taco_llm serve` on the bundled model (float32, --max-num-seqs 16, a 1 GiB KV cache, eager),
started here, unless --url names a running one (then --pid, its serve process, finds the processes to
watch). Load: --concurrency clients, each sending streamed chats (the openai SDK, temperature 0.7, a
seed per request, max_tokens --max-tokens) back to back until --duration seconds have passed or
--requests were sent. First a warm-up round (--warm-up requests, not counted) of the same shape; the
processes' warm levels are taken after it.

Reported, per --window seconds of completions: requests, errors, TTFT p50/p99 (send to the first
content token) and end-to-end p50/p99 (send to the stream's end), output tokens per second. Per
process (serve, the gateway, the worker, vLLM's engine core: every process under serve), every
--sample-every seconds: RSS (MiB) and open file descriptors, plus the gateway's TCP connections to the
worker; and at the end each process's RSS change from its warm level. Written as JSON to --out.
The machine is shared and noisy: this is a script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psutil
from servers import ROOT, free_port, launch, stop, wait_healthy

MODEL = "SmolLM2-135M-Instruct"
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
               "--kv-cache-memory-bytes", "1G", "--seed", "0"]


@dataclass
class Outcome:
    sent: float  # seconds since the run began
    ttft: float | None
    latency: float
    tokens: int
    error: str | None


async def one_request(client: openai.AsyncOpenAI, model: str, index: int, max_tokens: int, began: float) -> Outcome:
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write a line about the number {index}."}],
            max_tokens=max_tokens, temperature=0.7, seed=index, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        error = None if tokens else "no usage"
    except openai.OpenAIError as failure:
        error = repr(failure)
    end = time.perf_counter()
    return Outcome(sent - began, None if first is None else first - sent, end - sent, tokens, error)


async def drive(url: str, model: str, *, concurrency: int, max_tokens: int, requests: int | None,
                duration: float | None, first_index: int = 0) -> tuple[list[Outcome], float]:
    """Clients sending back to back until `requests` were sent or `duration` passed; the outcomes and the
    wall time."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    began = time.perf_counter()
    outcomes: list[Outcome] = []
    counter = iter(range(first_index, sys.maxsize))

    def more() -> int | None:
        index = next(counter)
        if requests is not None and index - first_index >= requests:
            return None
        if duration is not None and time.perf_counter() - began >= duration:
            return None
        return index

    async def client_loop() -> None:
        while (index := more()) is not None:
            outcomes.append(await one_request(client, model, index, max_tokens, began))

    try:
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    finally:
        await client.close()
    return outcomes, time.perf_counter() - began


def percentile(values: Iterable[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def windows(outcomes: list[Outcome], width: float) -> list[dict[str, Any]]:
    """Latency figures per `width` seconds, by when each request finished."""
    if not outcomes:
        return []
    last = max(o.sent + o.latency for o in outcomes)
    rows = []
    for start in range(0, math.ceil(last / width)):
        low, high = start * width, (start + 1) * width
        inside = [o for o in outcomes if low <= o.sent + o.latency < high]
        done = [o for o in inside if o.error is None]
        rows.append({
            "from_s": low, "to_s": high, "requests": len(inside), "errors": len(inside) - len(done),
            "ttft_p50_ms": _ms(percentile((o.ttft for o in done if o.ttft is not None), 50)),
            "ttft_p99_ms": _ms(percentile((o.ttft for o in done if o.ttft is not None), 99)),
            "e2e_p50_ms": _ms(percentile((o.latency for o in done), 50)),
            "e2e_p99_ms": _ms(percentile((o.latency for o in done), 99)),
            "output_tok_per_s": round(sum(o.tokens for o in done) / width, 1),
        })
    return rows


def _module(process: psutil.Process) -> str:
    argv = process.cmdline()
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else process.name()


def footprints(serve_pid: int) -> dict[str, dict[str, float]]:
    """RSS (MiB) and open fds of serve and every process under it, named as tests/support.py names them."""
    root = psutil.Process(serve_pid)
    found: dict[str, dict[str, float]] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = _module(process)
            figures = {"rss_mib": round(process.memory_info().rss / 2**20, 1), "fds": process.num_fds()}
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        key, n = name, 1
        while key in found:
            n += 1
            key = f"{name}#{n}"
        found[key] = figures
    return found


def gateway_channels(serve_pid: int) -> int | None:
    """The gateway's TCP connections to the worker's gRPC port (both found under serve)."""
    gateway = worker_port = None
    for process in psutil.Process(serve_pid).children(recursive=True):
        try:
            argv = process.cmdline()
            module = _module(process)
        except psutil.NoSuchProcess:
            continue
        if module == "taco_llm.gateway":
            gateway = process
        elif module == "taco_llm.engine_worker" and "--grpc-port" in argv:
            worker_port = int(argv[argv.index("--grpc-port") + 1])
    if gateway is None or worker_port is None:
        return None
    return sum(1 for c in gateway.net_connections(kind="tcp")
               if c.raddr and c.raddr.port == worker_port and c.status == psutil.CONN_ESTABLISHED)


async def sample(serve_pid: int, every: float, began: float, into: list[dict[str, Any]],
                 stop_event: asyncio.Event) -> None:
    while not stop_event.is_set():
        into.append({"t_s": round(time.perf_counter() - began, 1), "processes": footprints(serve_pid),
                     "gateway_channels": gateway_channels(serve_pid)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), every)


async def soak(url: str, serve_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    # Warm-up indices far from the timed ones: each request's prompt and seed differ from every other's.
    await drive(url, args.model, concurrency=args.concurrency, max_tokens=args.max_tokens, requests=args.warm_up,
                duration=None, first_index=10**9)
    await asyncio.sleep(2)
    warm = footprints(serve_pid)
    warm_channels = gateway_channels(serve_pid)
    samples: list[dict[str, Any]] = []
    stop_event = asyncio.Event()
    began = time.perf_counter()
    sampler = asyncio.create_task(sample(serve_pid, args.sample_every, began, samples, stop_event))
    outcomes, wall = await drive(url, args.model, concurrency=args.concurrency, max_tokens=args.max_tokens,
                                 requests=args.requests, duration=args.duration)
    await asyncio.sleep(2)
    stop_event.set()
    await sampler
    end = footprints(serve_pid)
    done = [o for o in outcomes if o.error is None]
    return {
        "requests": len(outcomes), "errors": len(outcomes) - len(done), "wall_s": round(wall, 1),
        "error_examples": [o.error for o in outcomes if o.error][:5],
        "overall": windows([*outcomes], wall + 1)[0] if outcomes else None,
        "windows": windows(outcomes, args.window),
        "warm": {"processes": warm, "gateway_channels": warm_channels},
        "end": {"processes": end, "gateway_channels": gateway_channels(serve_pid)},
        "rss_change_from_warm_pct": {
            name: round(100 * (end[name]["rss_mib"] / figures["rss_mib"] - 1), 1)
            for name, figures in warm.items() if name in end and figures["rss_mib"]},
        "fds_change_from_warm": {name: end[name]["fds"] - figures["fds"] for name, figures in warm.items()
                                 if name in end},
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--duration", type=float, default=None, help="seconds of load (default 180 unless --requests)")
    amount.add_argument("--requests", type=int, default=None, help="requests to send instead of a duration")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent streaming clients (default 64)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each reply (default 32)")
    parser.add_argument("--warm-up", type=int, default=None, help="warm-up requests (default 2 x --concurrency)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds per latency window (default 30)")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between process samples (default 5)")
    parser.add_argument("--model", default=MODEL, help=f"the model to ask for (default {MODEL}, the bundled one)")
    parser.add_argument("--url", default=None, help="a running gateway instead of starting `taco_llm serve`")
    parser.add_argument("--pid", type=int, default=None, help="with --url: the serve process to watch")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args()
    if args.requests is None and args.duration is None:
        args.duration = 180.0
    if args.warm_up is None:
        args.warm_up = 2 * args.concurrency
    if (args.url is None) != (args.pid is None):
        parser.error("--url and --pid go together")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = None
    url, pid = args.url, args.pid
    if url is None:
        port = free_port()
        log = args.out.with_suffix(".serve.log")
        server = launch([sys.executable, "-m", "taco_llm.cli", "serve", "--port", str(port), "--grpc-port",
                         str(free_port()), *SERVE_FLAGS], log)
        url, pid = f"http://127.0.0.1:{port}", server.pid
        wait_healthy(f"{url}/health", [server])
    try:
        report = asyncio.run(soak(url, pid, args))
    finally:
        if server is not None:
            stop(server)
    report["setup"] = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "duration_s": args.duration,
                       "requests": args.requests, "warm_up": args.warm_up, "window_s": args.window,
                       "serve_flags": SERVE_FLAGS if server is not None else None, "model": args.model}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{report['requests']} requests, {report['errors']} errors, {report['wall_s']} s")
    print(f"{'window':>12} {'reqs':>5} {'err':>4} {'ttft p50':>9} {'ttft p99':>9} {'e2e p50':>8} {'e2e p99':>8} "
          f"{'tok/s':>7}")
    for row in report["windows"]:
        print(f"{row['from_s']:>5.0f}-{row['to_s']:<5.0f}s {row['requests']:>5} {row['errors']:>4} "
              f"{row['ttft_p50_ms']!s:>9} {row['ttft_p99_ms']!s:>9} {row['e2e_p50_ms']!s:>8} "
              f"{row['e2e_p99_ms']!s:>8} {row['output_tok_per_s']:>7}")
    for name, figures in report["warm"]["processes"].items():
        end = report["end"]["processes"].get(name, {})
        print(f"{name:>28}: RSS {figures['rss_mib']} -> {end.get('rss_mib')} MiB "
              f"({report['rss_change_from_warm_pct'].get(name)}%), fds {figures['fds']} -> {end.get('fds')}")
    print(f"gateway->worker connections: {report['warm']['gateway_channels']} -> {report['end']['gateway_channels']}")
    print(f"written to {args.out}")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
