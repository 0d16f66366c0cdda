"""What speculation costs where it drafts little or nothing: open-ended stories, at concurrency 1 and 16.

    python bench/speculation_overhead.py [--rounds 2] [--methods none,lookahead-idle,lookahead-tuned,suffix]
                                         [--out bench/results/speculation_overhead.json]

The Lookahead Cache stops drafting when its drafts would not pay, and while more than target_parallelism
(8) requests decode; the issue's bar is 0.97x no speculation on such traffic. This script measures what
is left of the cost when it does so:
  none             no speculation
  lookahead-idle   ours, with matches of 32 tokens from the request's own text only: it almost never
                   drafts, so what it costs is speculation being on (vLLM's verify path and our propose)
  lookahead-tuned  ours, as docs/lookahead.md tunes it for these CPUs (no drafts at concurrency 16)
  suffix           vLLM's suffix decoding (arctic-inference), which drafts at any batch size
Servers are bench/lookahead.py's (same worker flags, the others frozen while one is measured); each
round runs every method at each level, in a rotating order, on stories of its own. Written: tok/s per method, level and
round, the ratio to no speculation of the same round, and whether the outputs equal no speculation's.
A script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import lookahead as bench
from servers import stop, wait_healthy, write_report

LEVELS = (1, 16)
IDLE_CONFIG = {"match_length": 32, "turbo_match_length": 32, "min_match_length": 32, "global_cache_switch": False}
EXTRA_TOPICS = ["a sleepy volcano", "a glass city", "an honest thief", "a singing well"]
# Every round and level sets its stories somewhere else, so that no story is asked twice (the characters recur).
SETTINGS = ["in a mountain village", "on a night train", "under the sea", "in a desert town", "on a frozen lake",
            "in a busy market", "on a distant moon", "in an old castle"]


def stories(setting: str, count: int) -> list[list[dict[str, str]]]:
    topics = (bench.TOPICS + EXTRA_TOPICS)[:count]
    return [[{"role": "user", "content": f"Write a short story about {topic} {setting}."}] for topic in topics]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", default="none,lookahead-idle,lookahead-tuned,suffix")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=bench.ROOT / "bench" / "results" / "speculation_overhead.json")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if "none" not in methods:
        parser.error("--methods: the ratios need `none` among the methods")
    if not 1 <= args.rounds <= len(SETTINGS) // len(LEVELS):
        parser.error(f"--rounds: from 1 to {len(SETTINGS) // len(LEVELS)}")
    bench.LOOKAHEAD_CONFIGS["lookahead-idle"] = IDLE_CONFIG  # where bench.start_server finds configs
    known = {"none", *bench.LOOKAHEAD_CONFIGS, *bench.SPECULATIVE}
    if unknown := [m for m in methods if m not in known]:
        parser.error(f"--methods: unknown {unknown}; choose from {sorted(known)}")
    skipped: dict[str, str] = {}
    if "suffix" in methods and importlib.util.find_spec("arctic_inference") is None:
        methods.remove("suffix")
        skipped["suffix"] = "arctic-inference is not installed"
    (bench.ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {f"@{c}": [] for c in LEVELS} for m in methods}
    with tempfile.TemporaryDirectory() as config_dir:
        servers = [bench.start_server(method, args, Path(config_dir)) for method in methods]
        try:
            for server in servers:
                wait_healthy(f"{server.base_url}/health", [server.worker, server.gateway])
            for server in servers:
                bench.only_this_one(server, servers)
                asyncio.run(bench.run_chats(server.base_url, [[{"role": "user", "content": "Hello!"}]], 1, 8))
            turn = 0
            for round_number in range(args.rounds):
                for position, concurrency in enumerate(LEVELS):
                    # Half as many stories at concurrency 1, where they take longest, to keep the run short.
                    load = stories(SETTINGS[round_number * len(LEVELS) + position], 16 if concurrency > 1 else 8)
                    for server in servers[turn:] + servers[:turn]:
                        bench.only_this_one(server, servers)
                        row = bench.measure(server, load, concurrency, args.max_tokens)
                        runs[server.method][f"@{concurrency}"].append(row)
                        print(f"round {round_number} {server.method:16s} c={concurrency:2d}: {row['tok_s']:7.2f} "
                              f"tok/s, acceptance {row['acceptance']}", flush=True)
                    turn = (turn + 1) % len(servers)
        finally:
            for server in servers:
                stop(server.gateway)
                stop(server.worker)
    summary: dict[str, Any] = {}
    for method, levels in runs.items():
        summary[method] = {}
        for level, rows in levels.items():
            base = runs["none"][level]
            summary[method][level] = {
                "tok_s": [row["tok_s"] for row in rows],
                "vs_none": [round(row["tok_s"] / b["tok_s"], 3) for row, b in zip(rows, base, strict=True)],
                "acceptance": [row["acceptance"] for row in rows],
                "propose_us_per_step": [row.get("propose_us_per_step") for row in rows],
                "outputs_equal_none": all(row["texts"] == b["texts"] for row, b in zip(rows, base, strict=True)),
            }
    results = {"dtype": args.dtype, "max_tokens": args.max_tokens, "rounds": args.rounds, "skipped": skipped,
               "summary": summary, "runs": runs}
    write_report(args.out, results, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
