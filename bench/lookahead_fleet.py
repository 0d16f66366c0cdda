"""The Lookahead Cache on a fleet: two workers behind the gateway, against vLLM's `ngram` and `suffix` and no
speculation, before and after a rolling restart.

    python bench/lookahead_fleet.py [--methods none,ngram,suffix,lookahead] [--routing round_robin,cache_aware]
                                    [--workloads template,rag,repeat,stories] [--requests 8] [--concurrency 4]
                                    [--max-tokens 96] [--out bench/results/lookahead_fleet.json]

Each method and routing policy gets its own `taco_llm serve --num-workers 2` (float32), started, measured and
stopped before the next one starts (two fleets do not fit these 2 cores side by side). On each fleet, every
workload runs once ("first"), then every worker is restarted in turn (SIGTERM; serve starts it again; the next
once the gateway routes to it), then every workload runs again ("after_restart"): requests seen before the
restart, which only a shared index kept outside the workers can draft from. Ours runs with TACO-LLM's default
config, so its workers share one index through the Redis serve starts for them. Workloads are
bench/lookahead.py's: template and rag repeat across requests, repeat asks each question twice, stories is
the control where nothing repeats.

Written: output tok/s per method, routing, workload and pass; each method's ratio to no speculation and
ours to the better of ngram and suffix; draft acceptance (vLLM's own counters, summed over the workers); and
how many outputs differ from no speculation's (float32: none should). `suffix` needs arctic-inference;
without it that row is skipped and says so. The fleets run one after another, so the machine's drift falls
between rows: compare ratios across runs with care. A script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fleet as fleet_bench
import lookahead as lookahead_bench
from servers import ROOT, free_port, save_report, wait_grpc_healthy, write_report

PEERS = ("ngram", "suffix")
OURS = "lookahead"


def serve_argv(method: str, routing: str, config_dir: Path) -> tuple[list[str], str]:
    port = free_port()
    grpc_base, metrics_base = fleet_bench.free_port_run(fleet_bench.WORKERS), fleet_bench.free_port_run(
        fleet_bench.WORKERS)
    argv = [sys.executable, "-m", "taco_llm.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_base),
            "--metrics-port", str(metrics_base), "--num-workers", str(fleet_bench.WORKERS), "--routing", routing,
            "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "16", "--kv-cache-memory-bytes", "1G",
            "--seed", "0", "--cache-service-port", str(free_port()), "--shutdown-timeout", "30",
            *lookahead_bench.method_flags(method, config_dir)]
    return argv, f"http://127.0.0.1:{port}"


def rolling_restart(fleet: fleet_bench.Fleet) -> float:
    """SIGTERM to each worker in turn; the next once serve has started it again and the gateway routes to it.
    The seconds the whole restart took."""
    assert fleet.process is not None
    started = time.monotonic()
    for position, worker in enumerate(list(fleet.workers)):
        os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + 900
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker on port {worker.grpc_port} did not come back; see {fleet.log}")
            found = dict((port, pid) for pid, port in fleet_bench.worker_processes(fleet.process.pid))
            if found.get(worker.grpc_port, worker.pid) != worker.pid:
                break
            time.sleep(0.5)
        wait_grpc_healthy(f"127.0.0.1:{worker.grpc_port}", [fleet.process], timeout=900)
        fleet.workers[position] = fleet_bench.WorkerProcess(found[worker.grpc_port], worker.grpc_port,
                                                            worker.metrics_port)
        fleet.wait_gateway_sees_workers()
    return time.monotonic() - started


def spec_counters(fleet: fleet_bench.Fleet) -> tuple[float, float]:
    """Drafted and accepted tokens so far, summed over the workers (vLLM's spec-decode counters)."""
    snapshot = fleet.worker_metrics() or {}
    return (fleet_bench.total(snapshot, "vllm:spec_decode_num_draft_tokens_total"),
            fleet_bench.total(snapshot, "vllm:spec_decode_num_accepted_tokens_total"))


def measure(fleet: fleet_bench.Fleet, chats: list[list[dict[str, str]]], concurrency: int,
            max_tokens: int) -> dict[str, Any]:
    drafted, accepted = spec_counters(fleet)
    tok_s, texts = asyncio.run(lookahead_bench.run_chats(fleet.url, chats, concurrency, max_tokens))
    drafted_after, accepted_after = spec_counters(fleet)
    drafted_now = drafted_after - drafted
    return {"tok_s": round(tok_s, 2), "texts": texts, "drafted": drafted_now,
            "acceptance": round((accepted_after - accepted) / drafted_now, 3) if drafted_now else None}


def run_fleet(method: str, routing: str, loads: dict[str, list[list[dict[str, str]]]], args: argparse.Namespace,
              config_dir: Path) -> dict[str, Any]:
    argv, url = serve_argv(method, routing, config_dir)
    fleet = fleet_bench.Fleet(argv, url, args.log_dir / f"lookahead_fleet-{method}-{routing}.log")
    print(f"starting {method} / {routing}", flush=True)
    fleet.start()
    rows: dict[str, Any] = {}
    try:
        asyncio.run(lookahead_bench.run_chats(url, [[{"role": "user", "content": "Hello!"}]] * 2, 2, 8))  # warm-up
        for phase in ("first", "after_restart"):
            if phase == "after_restart":
                rows["restart_seconds"] = round(rolling_restart(fleet), 1)
            for name, chats in loads.items():
                row = measure(fleet, chats, args.concurrency, args.max_tokens)
                rows[f"{name}/{phase}"] = row
                print(f"{method:9s} {routing:11s} {name:8s} {phase:13s}: {row['tok_s']:7.2f} tok/s  acceptance "
                      f"{row['acceptance']}", flush=True)
    finally:
        fleet.stop()
    return rows


def summarize(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per routing and cell: each method's ratio to none, ours to the better peer, outputs unlike none's."""
    summary: dict[str, Any] = {}
    for routing, methods in results.items():
        base = methods.get("none", {})
        for cell, base_row in base.items():
            if not isinstance(base_row, dict):
                continue
            entry: dict[str, Any] = {}
            for method, rows in methods.items():
                row = rows[cell]
                entry[method] = {"tok_s": row["tok_s"], "vs_none": round(row["tok_s"] / base_row["tok_s"], 3),
                                 "acceptance": row["acceptance"],
                                 "outputs_unlike_none": sum(a != b for a, b in zip(row["texts"], base_row["texts"],
                                                                                   strict=True))}
            peers = [methods[m][cell]["tok_s"] for m in PEERS if m in methods]
            if peers and OURS in methods:
                entry[f"{OURS}_vs_best_peer"] = round(methods[OURS][cell]["tok_s"] / max(peers), 3)
            summary[f"{routing}/{cell}"] = entry
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="none,ngram,suffix,lookahead")
    parser.add_argument("--routing", default="round_robin,cache_aware")
    parser.add_argument("--workloads", default="template,rag,repeat,stories")
    parser.add_argument("--requests", type=int, default=8, help="requests per workload and pass")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lookahead_fleet.json")
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in ("none", *PEERS, OURS)]
    if unknown or "none" not in methods:
        parser.error(f"--methods: of none, ngram, suffix and lookahead, with none among them (got {args.methods})")
    every_load = lookahead_bench.workloads(args.requests)
    chosen = args.workloads.split(",")
    if any(name not in every_load for name in chosen):
        parser.error(f"--workloads: of {', '.join(every_load)}")
    # Level 0's chats of each workload (bench/lookahead.py keeps one list per concurrency level).
    loads = {name: every_load[name][0] for name in chosen}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "skipped": {},
                              "results": {}, "cpus": os.cpu_count()}
    if "suffix" in methods and importlib.util.find_spec("arctic_inference") is None:
        methods.remove("suffix")
        report["skipped"]["suffix"] = "arctic-inference is not installed"
        print("suffix skipped: arctic-inference is not installed", flush=True)
    with tempfile.TemporaryDirectory() as config_dir:
        for routing in args.routing.split(","):
            report["results"][routing] = {}
            for method in methods:
                report["results"][routing][method] = run_fleet(method, routing, loads, args, Path(config_dir))
                save_report(args.out, report)  # a run stopped partway keeps the fleets it measured
    report["summary"] = summarize(report["results"])
    write_report(args.out, report, report["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
