"""What the gateway costs per relayed token, against a synthetic engine that costs next to nothing.

    python bench/gateway_relay.py [--concurrency 64 256] [--max-tokens 256] [--rounds 2]
                                  [--modes saturated paced] [--token-interval 0.02] [--out FILE]

For each pacing mode a synthetic engine (bench/synthetic_engine.py) runs in its own process:
`saturated` streams tokens as fast as they are read, `paced` one every --token-interval seconds, as a
decode step would. At each concurrency C, C clients each stream --rounds requests of --max-tokens
tokens, first straight from the engine over gRPC (`direct`: the peer, no gateway), then through one
gateway process (`python -m taco_llm.gateway`), and through N of them on one port where the gateway
takes --api-server-count (--api-server-counts N ...). Saturated clients all start at once (a closed
loop, as the issue measured); paced ones start spread over one request's length (--burst: at once),
so that the paced rows see requests arrive at a steady rate.

Per row: tokens relayed (counted from the text: every synthetic token is TOKEN_WIDTH characters),
the gateway's CPU seconds (/proc utime+stime of its whole process session) and so tokens per gateway
CPU-second, the engine's and this client's CPU seconds, time to first byte (request sent -> first SSE
data event, or first gRPC message), time to first token, and the gap between token-carrying events,
each at p50 and p99. A gateway row's `added` is its latency minus the direct row's of the same mode
and concurrency; `other_processes_cpu_share` says how much of the machine something else took
meanwhile (a crowded row is no baseline). The HTTP client is raw HTTP/1.1 over asyncio streams with
one json.loads per event, so that it takes little of the CPUs it shares with what it measures.

--profile-gateway FILE runs the (single) gateway under cProfile (CPU-timed) and writes FILE.<mode>.prof.
A script, not a test: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from servers import free_port, launch, stop, wait_grpc_healthy, wait_healthy
from synthetic_engine import TOKEN_WIDTH

from taco_llm.protos import engine_pb2, engine_pb2_grpc
from taco_llm.protos.engine_limits import GRPC_MESSAGE_LIMIT

ROOT = Path(__file__).resolve().parent.parent
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROMPT = "Tell me a long story about a lighthouse keeper."
# The gateway under cProfile, timed by its main thread's CPU clock: on a 2-core machine shared with the
# engine and the client, a wall-clock profile would charge to whatever call the gateway was in when
# the scheduler preempted it (its socket writes, which wake the client, most of all).
PROFILED_GATEWAY = """
import cProfile, runpy, sys, time
out = sys.argv[1]
sys.argv = ["taco_llm.gateway", *sys.argv[2:]]
profile = cProfile.Profile(time.thread_time)
try:
    profile.runcall(runpy.run_module, "taco_llm.gateway", run_name="__main__", alter_sys=True)
except (SystemExit, KeyboardInterrupt):
    pass
finally:
    profile.dump_stats(out)
"""


@dataclass
class Samples:
    """What the streams of one row saw; times in seconds."""

    tokens: int = 0
    events: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


def session_cpu_seconds(session: int) -> float:
    """User+system CPU of every live process of a session, plus what its leader's reaped children used.
    Servers are started in their own session, so this covers a gateway's worker processes too."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Field 2 (the command name) may hold spaces and parentheses: count fields after its last ')'.
        rest = stat[stat.rindex(")") + 2:].split()
        if int(rest[3]) != session:
            continue
        ticks += int(rest[11]) + int(rest[12])
        if int(entry.name) == session:
            ticks += int(rest[13]) + int(rest[14])
    return ticks / CLOCK_TICKS


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    # user nice system idle iowait irq softirq steal; the guest times after them are within user's.
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 3)


# --- through the gateway: HTTP/1.1 and server-sent events, parsed by hand ---------------------------

class HttpStream:
    """One kept-alive connection to the gateway, used by one client for its requests in turn."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self.host, self.port, self.path = host, port, path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def run(self, body: bytes, samples: Samples, text_of: Callable[[dict[str, Any]], str]) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.reader, self.writer
        assert reader is not None
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        sent = time.perf_counter()
        writer.write(head + body)
        status_line, _, headers = (await reader.readuntil(b"\r\n\r\n")).partition(b"\r\n")
        if b" 200 " not in status_line + b" ":
            samples.errors.append(status_line.decode(errors="replace"))
            await self.close()
            return
        if b"chunked" not in headers.lower():
            samples.errors.append("the response is not chunked")
            await self.close()
            return
        samples.requests += 1
        events = _events(reader)
        first_event = first_token = last_token = None
        async for now, event in events:
            samples.events += 1
            if first_event is None:
                first_event = now
                samples.ttfb.append(now - sent)
            if event == b"[DONE]":
                continue
            message = json.loads(event)
            if "error" in message:
                samples.errors.append(str(message["error"].get("message")))
                continue
            text = "".join(text_of(choice) for choice in message.get("choices") or ())
            if not text:
                continue
            samples.tokens += len(text) // TOKEN_WIDTH
            if first_token is None:
                first_token = now
                samples.ttft.append(now - sent)
            else:
                samples.gaps.append(now - last_token)  # type: ignore[operator]
            last_token = now


async def _events(reader: asyncio.StreamReader) -> AsyncIterator[tuple[float, bytes]]:
    """The SSE `data:` payloads of one chunked response, each with the time its bytes arrived. Reads
    whatever is there and unframes it by hand: one await per read, not two per chunk."""
    raw = sse = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise asyncio.IncompleteReadError(raw, None)
        now = time.perf_counter()
        raw += data
        ended = False
        while (line_end := raw.find(b"\r\n")) >= 0:
            size = int(raw[:line_end].split(b";")[0], 16)
            chunk_end = line_end + 2 + size + 2
            if len(raw) < chunk_end:
                break
            sse += raw[line_end + 2:chunk_end - 2]
            raw = raw[chunk_end:]
            if size == 0:
                ended = True
                break
        *events, sse = sse.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: "):
                yield now, event[6:]
        if ended:
            return


def _chat_text(choice: dict[str, Any]) -> str:
    return choice.get("delta", {}).get("content") or ""


def _completion_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or ""


async def drive_gateway(port: int, *, endpoint: str, concurrency: int, rounds: int, max_tokens: int,
                        stagger: float = 0.0) -> Samples:
    if endpoint == "chat":
        path, text_of = "/v1/chat/completions", _chat_text
        request: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT}]}
    else:
        path, text_of = "/v1/completions", _completion_text
        request = {"prompt": PROMPT}
    body = json.dumps({**request, "model": "synthetic", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    samples = Samples()

    async def client(delay: float) -> None:
        await asyncio.sleep(delay)
        stream = HttpStream("127.0.0.1", port, path)
        try:
            for _ in range(rounds):
                await stream.run(body, samples, text_of)
        except (OSError, asyncio.IncompleteReadError, ValueError) as error:
            samples.errors.append(f"{type(error).__name__}: {error}")
        finally:
            await stream.close()

    await asyncio.gather(*(client(i * stagger / concurrency) for i in range(concurrency)))
    return samples


# --- straight to the engine over gRPC -----------------------------------------------------------------

async def drive_direct(address: str, *, concurrency: int, rounds: int, max_tokens: int,
                       stagger: float = 0.0) -> Samples:
    samples = Samples()
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT)])
    stub = engine_pb2_grpc.EngineStub(channel)
    request = engine_pb2.GenerateRequest(text=PROMPT, sampling=engine_pb2.SamplingParams(max_tokens=max_tokens))

    async def one() -> None:
        sent = time.perf_counter()
        call = stub.Generate(request)
        first_message = first_token = last_token = None
        samples.requests += 1
        while (message := await call.read()) is not grpc.aio.EOF:
            now = time.perf_counter()
            samples.events += 1
            if first_message is None:
                first_message = now
                samples.ttfb.append(now - sent)
            if message.WhichOneof("phase") != "delta":
                continue
            samples.tokens += sum(len(c.token_ids) for c in message.delta.choices)
            if first_token is None:
                first_token = now
                samples.ttft.append(now - sent)
            else:
                samples.gaps.append(now - last_token)  # type: ignore[operator]
            last_token = now

    async def client(delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            for _ in range(rounds):
                await one()
        except grpc.aio.AioRpcError as error:
            samples.errors.append(f"{error.code().name}: {error.details()}")

    try:
        await asyncio.gather(*(client(i * stagger / concurrency) for i in range(concurrency)))
    finally:
        await channel.close()
    return samples


# --- rows ---------------------------------------------------------------------------------------------

def measure(drive: Callable[[], Awaitable[Samples]], sessions: dict[str, int]) -> dict[str, Any]:
    """Runs one load and reads every process's CPU around it."""
    before = {name: session_cpu_seconds(sid) for name, sid in sessions.items()}
    machine_before = machine_cpu()
    client_before, start = time.process_time(), time.perf_counter()
    samples = asyncio.run(drive())
    wall = time.perf_counter() - start
    client_cpu = time.process_time() - client_before
    cpu = {name: session_cpu_seconds(sid) - before[name] for name, sid in sessions.items()}
    busy, total = (after - earlier for after, earlier in zip(machine_cpu(), machine_before, strict=True))
    cpus = len(os.sched_getaffinity(0))
    # What other processes took of the machine meanwhile: a row they crowded is no baseline.
    others = busy / CLOCK_TICKS - sum(cpu.values()) - client_cpu
    row: dict[str, Any] = {
        "requests": samples.requests, "tokens": samples.tokens, "events": samples.events,
        "errors": len(samples.errors), "first_errors": samples.errors[:3],
        "wall_s": round(wall, 3), "tokens_per_s": round(samples.tokens / wall, 1),
        "engine_cpu_s": round(cpu["engine"], 2), "client_cpu_s": round(client_cpu, 2),
        "client_cpu_per_1k_tokens_ms": round(1e6 * client_cpu / samples.tokens, 2) if samples.tokens else None,
        "machine_busy_share": round(busy / total, 2) if total else None,
        "other_processes_cpu_share": round(max(0.0, others) / (wall * cpus), 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if "gateway" in cpu:
        row["gateway_cpu_s"] = round(cpu["gateway"], 2)
        row["tokens_per_gateway_cpu_s"] = round(samples.tokens / cpu["gateway"], 1) if cpu["gateway"] else None
        row["gateway_cpu_share"] = round(cpu["gateway"] / wall, 2)
    for name, values in (("ttfb", samples.ttfb), ("ttft", samples.ttft), ("gap", samples.gaps)):
        row[f"{name}_p50_ms"] = _ms(percentile(values, 0.5))
        row[f"{name}_p99_ms"] = _ms(percentile(values, 0.99))
    return row


def added(gateway: dict[str, Any], direct: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("ttfb_p50_ms", "ttfb_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms"):
        a, b = gateway.get(key), direct.get(key)
        out[key] = None if a is None or b is None else round(a - b, 3)
    return out


def gateway_takes_api_server_count() -> bool:
    run = subprocess.run([PYTHON, "-m", "taco_llm.gateway", "-h"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    return "--api-server-count" in run.stdout


def progress(row: dict[str, Any]) -> None:
    servers_text = f" x{row['api_server_count']}" if row.get("api_server_count") else ""
    per_cpu = row.get("tokens_per_gateway_cpu_s")
    print(f"{row['mode']:>9} {row['target']}{servers_text:<4} c={row['concurrency']:<4} "
          f"tokens={row['tokens']:<7} {row['tokens_per_s']:>9.0f} tok/s"
          + (f"  {per_cpu:>8.0f} tok/gateway-cpu-s" if per_cpu else "")
          + f"  ttfb p50/p99 {row['ttfb_p50_ms']}/{row['ttfb_p99_ms']} ms"
          + f"  gap p50/p99 {row['gap_p50_ms']}/{row['gap_p99_ms']} ms"
          + (f"  errors={row['errors']}" if row["errors"] else ""), file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class Plan:
    concurrency: list[int]
    max_tokens: int
    rounds: int
    endpoint: str
    log_dir: Path
    api_server_counts: list[int]
    profile: Path | None
    burst: bool


def run_mode(mode: str, interval: float, plan: Plan) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    engine_port = free_port()
    address = f"127.0.0.1:{engine_port}"
    engine = launch([PYTHON, str(ROOT / "bench" / "synthetic_engine.py"), "--port", str(engine_port),
                     "--token-interval", str(interval)], plan.log_dir / f"synthetic_engine_{mode}.log")
    try:
        wait_grpc_healthy(address, [engine])
        sessions = {"engine": engine.pid}
        # Paced clients start spread over one request's length, so that requests arrive at a steady rate
        # (as they would at a server under load) rather than all in the same millisecond.
        stagger = 0.0 if plan.burst else plan.max_tokens * interval
        base = {"mode": mode, "token_interval_s": interval, "max_tokens": plan.max_tokens, "rounds": plan.rounds,
                "stagger_s": stagger}
        direct: dict[int, dict[str, Any]] = {}
        asyncio.run(drive_direct(address, concurrency=4, rounds=1, max_tokens=16))  # warm-up
        for c in plan.concurrency:
            row = {**base, "target": "direct", "api_server_count": None, "concurrency": c,
                   **measure(partial(drive_direct, address, concurrency=c, rounds=plan.rounds,
                                     max_tokens=plan.max_tokens, stagger=stagger), sessions)}
            direct[c] = row
            rows.append(row)
            progress(row)
        for count in [1, *plan.api_server_counts]:
            port = free_port()
            command = [PYTHON, "-m", "taco_llm.gateway", "--engine", address, "--port", str(port)]
            if count > 1:
                command += ["--api-server-count", str(count)]
            if plan.profile is not None and count == 1:
                command[1:3] = ["-c", PROFILED_GATEWAY, str(plan.profile.with_suffix(f".{mode}.prof"))]
            gateway = launch(command, plan.log_dir / f"gateway_{mode}_x{count}.log")
            try:
                wait_healthy(f"http://127.0.0.1:{port}/health", [gateway, engine], timeout=120)
                asyncio.run(drive_gateway(port, endpoint=plan.endpoint, concurrency=4, rounds=1, max_tokens=16))
                for c in plan.concurrency:
                    row = {**base, "target": "gateway", "endpoint": plan.endpoint, "api_server_count": count,
                           "concurrency": c,
                           **measure(partial(drive_gateway, port, endpoint=plan.endpoint, concurrency=c,
                                             rounds=plan.rounds, max_tokens=plan.max_tokens, stagger=stagger),
                                     {**sessions, "gateway": gateway.pid})}
                    row["added"] = added(row, direct[c])
                    rows.append(row)
                    progress(row)
            finally:
                if plan.profile is not None and count == 1:
                    # uvicorn re-raises the signal it stopped on; SIGINT then ends the process as a
                    # KeyboardInterrupt, which the profiler outlives to write its file (SIGTERM would not).
                    gateway.send_signal(signal.SIGINT)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        gateway.wait(60)
                stop(gateway)
    finally:
        stop(engine)
    return rows


def source_state() -> dict[str, Any]:
    """Which gateway was measured: the commit, and whether gateway/ had uncommitted changes."""
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return run.stdout.strip() if run.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "gateway_changed": bool(git("status", "--porcelain", "gateway"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per request (default 256)")
    parser.add_argument("--rounds", type=int, default=2, help="requests each client streams in turn (default 2)")
    parser.add_argument("--modes", nargs="+", choices=["saturated", "paced"], default=["saturated", "paced"])
    parser.add_argument("--token-interval", type=float, default=0.02,
                        help="seconds between a stream's tokens in the paced mode (default 0.02)")
    parser.add_argument("--burst", action="store_true",
                        help="start every paced client at once (default: spread over one request's length)")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--api-server-counts", type=int, nargs="*", default=[2],
                        help="gateway process counts to run besides 1, where the gateway takes "
                             "--api-server-count (default: 2)")
    parser.add_argument("--profile-gateway", type=Path, default=None, metavar="FILE",
                        help="run the single gateway under cProfile; FILE.<mode>.prof per mode")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "results" / "gateway_relay_logs")
    parser.add_argument("--out", type=Path, default=None, help="the JSON report (default: stdout)")
    args = parser.parse_args()
    for flag, values in (("--concurrency", args.concurrency), ("--max-tokens", [args.max_tokens]),
                         ("--rounds", [args.rounds]), ("--api-server-counts", args.api_server_counts or [1])):
        if min(values) < 1:
            parser.error(f"{flag} must be at least 1")
    if args.token_interval <= 0:
        parser.error("--token-interval must be positive")
    args.log_dir.mkdir(parents=True, exist_ok=True)

    notes: list[str] = []
    counts = sorted({n for n in args.api_server_counts if n > 1})
    if counts and not gateway_takes_api_server_count():
        notes.append(f"the gateway has no --api-server-count yet: rows for {counts} gateway processes skipped")
        counts = []
    plan = Plan(concurrency=args.concurrency, max_tokens=args.max_tokens, rounds=args.rounds, endpoint=args.endpoint,
                log_dir=args.log_dir, api_server_counts=counts, profile=args.profile_gateway,
                burst=args.burst)
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        rows += run_mode(mode, 0.0 if mode == "saturated" else args.token_interval, plan)
    report = {
        "machine": {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                    "python": platform.python_version(), "platform": platform.platform()},
        "source": source_state(),
        "config": {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "modes": args.modes, "token_interval_s": args.token_interval, "endpoint": args.endpoint,
                   "burst": args.burst,
                   "api_server_counts": [1, *counts]},
        "targets": {"tokens_per_gateway_cpu_s": 25_000, "added_p99_ms_paced": 5},
        "notes": notes,
        "rows": rows,
    }
    text = json.dumps(report, indent=2)
    if args.out is None:
        print(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
