"""The Lookahead Cache against vLLM's own speculative methods and no speculation, in one run.

    python bench/lookahead.py [--dtype float32] [--max-tokens 128] [--requests 6] [--concurrency 1,4]
                              [--methods none,ngram,suffix,lookahead] [--workloads copy,rag,template,stories]
                              [--out bench/results/lookahead.json]

Every method runs in the same taco_llm worker behind the same gateway; only the speculative method
differs (vLLM's `ngram` and `suffix` through --speculative-config, ours through
--lookahead-cache-config-dir). All methods' workers start first and stay up; then each workload and
concurrency level (1 and 4) runs on every method in turn, in a rotating order, so that the machine's
load drifting over the run falls on all of them alike. The servers not being measured are frozen
(SIGSTOP), so that their background threads (health checks, stat loggers, the engine's own polling
after a burst) take nothing from the two cores. Each level has its own requests, the same for every
method:
  copy      repeat a given code file (the answer is in the prompt)
  rag       answer by quoting one of a few shared documents (the documents repeat across requests)
  template  fill the same report template for different items (the form repeats across requests)
  stories   open-ended stories on different topics (nothing repeats)
  repeat    questions asked again by later requests, answers not in the prompt (an FAQ bot's traffic)
Methods: none, ngram, suffix, lookahead (TACO-LLM's default config: drafts of up to 7 tokens, matches
of at least 2) and lookahead-tuned (docs/lookahead.md's setting for these CPUs: drafts of up to 24
tokens, suffix decoding's depth, and single-token matches).
Written: output tok/s per method, workload and concurrency, each method's ratio to no speculation and
to the better of ngram and suffix, draft acceptance (vLLM's own spec-decode counters), the lookahead
proposer's time per step, and whether the outputs equal no speculation's. `suffix` needs the
arctic-inference package; without it that row is skipped and says so. A script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port, pause, resume, stop, wait_healthy, write_report

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
CONCURRENCY = (1, 4)
SPECULATIVE: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
}
DOCUMENTS = [
    "The Halden ferry leaves the north pier every forty minutes from six in the morning. Tickets cost four "
    "euros for adults and two euros for children. Bicycles travel free, but dogs must be kept on a lead. "
    "In winter storms the ferry may be cancelled, and notices are posted at the ticket office.",
    "The Orrin community library opens at nine on weekdays and at ten on Saturdays. Members may borrow "
    "eight books at a time for three weeks. Late returns cost ten cents a day. The reading room on the "
    "second floor is quiet, and the children's corner hosts story time on Wednesday afternoons.",
    "Brightvale's recycling service collects paper on Mondays and plastic on Thursdays. Glass goes to the "
    "bottle banks by the town hall. Batteries and electronics are taken at the depot on Mill Road, which "
    "is open from eight to four. Bins must be at the kerb by seven in the morning.",
]
QUESTIONS = ["When does it open or run?", "What does it cost?", "What are the rules?", "What happens in bad cases?",
             "Where is it?", "Summarize it in one sentence.", "What should a newcomer know?",
             "What is free?", "What is the schedule?", "What is on the second point?", "Quote the first sentence.",
             "Quote the last sentence."]
ITEMS = ["a solar lantern", "a steel water bottle", "a folding chair", "a wool scarf", "a desk lamp",
         "a hiking backpack", "a ceramic mug", "a bicycle bell", "a kitchen timer", "a garden hose", "a rain coat",
         "a chess set"]
TOPICS = ["a lighthouse keeper", "a lost robot", "a dragon who bakes", "a time-travelling cat", "a river spirit",
          "a chess prodigy", "a desert caravan", "a haunted violin", "a moon miner", "a gardener's secret",
          "a runaway train", "a talking fox"]
FAQ = ["How do I reset my password?", "What is the refund policy for damaged items?",
       "How long does international shipping take?", "Can I change my order after paying?",
       "How do I contact customer support at night?", "What payment methods do you accept?"]
TEMPLATE = ("Write a product card for {item}. Use exactly this form, filling in each line:\n"
            "Name: ...\nMaterial: ...\nBest for: ...\nCare: ...\nWarranty: two years, parts and labour.\n"
            "Shipping: free within the country, three to five working days.")


def _code_files() -> list[str]:
    # The gateway's and the worker's modules, not the worker's lookahead/ and kv_offload/ subpackages.
    worker = [path for folder in ("", "frontend", "core") for path in (ROOT / "engine_worker" / folder).glob("*.py")]
    files = sorted((ROOT / "gateway").glob("*.py")) + sorted(worker)
    return [path.read_text()[:900] for path in files if len(path.read_text()) > 900]


def workloads(requests: int) -> dict[str, list[list[list[dict[str, str]]]]]:
    """For each workload, one list of chats per concurrency level (disjoint, so no run replays another)."""
    code = _code_files()

    def copy(i: int) -> str:
        return f"Repeat the following code exactly, then stop:\n```python\n{code[i % len(code)]}\n```"

    def rag(i: int) -> str:
        doc = DOCUMENTS[i % len(DOCUMENTS)]
        return f"Answer by quoting the document.\nDocument: {doc}\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}"

    def repeat(i: int) -> str:
        # Each level asks its own questions, each twice: the second asking can only draft from the first.
        level, position = divmod(i, requests)
        pool = FAQ[level * 3:(level + 1) * 3]
        return f"As our shop's support assistant, answer: {pool[position % len(pool)]}"

    makers = {"copy": copy, "rag": rag, "template": lambda i: TEMPLATE.format(item=ITEMS[i % len(ITEMS)]),
              "stories": lambda i: f"Write a short story about {TOPICS[i % len(TOPICS)]}.", "repeat": repeat}
    return {name: [[[{"role": "user", "content": make(level * requests + i)}] for i in range(requests)]
                   for level in range(len(CONCURRENCY))] for name, make in makers.items()}


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def run_chats(base_url: str, chats: list[list[dict[str, str]]], concurrency: int,
                    max_tokens: int) -> tuple[float, list[str]]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=900)
    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(messages: list[dict[str, str]]) -> str:
        nonlocal tokens
        async with gate:
            reply = await client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                         max_tokens=max_tokens, temperature=0)
            tokens += reply.usage.completion_tokens if reply.usage else 0
            return reply.choices[0].message.content or ""

    start = time.perf_counter()
    texts = await asyncio.gather(*(one(m) for m in chats))
    elapsed = time.perf_counter() - start
    await client.close()
    return tokens / elapsed, list(texts)


LOOKAHEAD_CONFIGS = {
    "lookahead": {},
    "lookahead-tuned": {"copy_length": 24, "match_length": 1, "min_match_length": 1, "threshold": 0},
}


def method_flags(method: str, config_root: Path) -> list[str]:
    if method in LOOKAHEAD_CONFIGS:
        folder = config_root / method
        folder.mkdir(exist_ok=True)
        (folder / "lookahead_cache_config.json").write_text(json.dumps(LOOKAHEAD_CONFIGS[method]))
        return ["--lookahead-cache-config-dir", str(folder)]
    if method in SPECULATIVE:
        return ["--speculative-config", json.dumps(SPECULATIVE[method])]
    return []


@dataclass
class Server:
    """One method's worker and gateway."""

    method: str
    worker: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    base_url: str
    metrics_port: int


def start_server(method: str, args: argparse.Namespace, config_dir: Path) -> Server:
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    log = open(ROOT / "bench" / "results" / f"lookahead-{method}.log", "wb")  # noqa: SIM115
    common = {"cwd": ROOT, "stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
    worker = subprocess.Popen([sys.executable, "-m", "taco_llm.cli", "worker", "--dtype", args.dtype,
                               "--max-model-len", "4096", "--max-num-seqs", "16", "--seed", "0",
                               "--kv-cache-memory-bytes", "1G", "--grpc-port", str(grpc_port),
                               "--metrics-port", str(metrics_port),
                               *method_flags(method, config_dir)], **common)  # type: ignore[call-overload]
    gateway = subprocess.Popen([sys.executable, "-m", "taco_llm.cli", "gateway", "--engine",
                                f"127.0.0.1:{grpc_port}", "--port", str(http_port)], **common)  # type: ignore[call-overload]
    return Server(method, worker, gateway, f"http://127.0.0.1:{http_port}", metrics_port)


def measure(server: Server, chats: list[list[dict[str, str]]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    before = _metrics(server.metrics_port)
    tok_s, texts = asyncio.run(run_chats(server.base_url, chats, concurrency, max_tokens))
    after = _metrics(server.metrics_port)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafted = delta("vllm:spec_decode_num_draft_tokens_total")
    row: dict[str, Any] = {"tok_s": round(tok_s, 2), "texts": texts,
                           "acceptance": round(delta("vllm:spec_decode_num_accepted_tokens_total") / drafted, 3)
                           if drafted else None}
    steps = delta("taco_llm_lookahead_steps_total")
    if steps:
        row["propose_us_per_step"] = round(1e6 * delta("taco_llm_lookahead_propose_seconds_total") / steps, 1)
    return row


def only_this_one(server: Server, servers: list[Server]) -> None:
    """Freezes every other server (idle engines still poll), and waits for this one to answer."""
    for other in servers:
        if other is not server:
            pause(other.gateway)
            pause(other.worker)
    resume(server.worker)
    resume(server.gateway)
    wait_healthy(f"{server.base_url}/health", [server.worker, server.gateway])


def bench(servers: list[Server], loads: dict[str, list[list[list[dict[str, str]]]]],
          max_tokens: int, levels: tuple[int, ...] = CONCURRENCY) -> dict[str, dict[str, Any]]:
    """Every method runs each workload and level before the next one starts, in a rotating order, so
    that the machine's load drifting over the run falls on all methods alike."""
    rows: dict[str, dict[str, Any]] = {s.method: {} for s in servers}
    turn = 0
    for name, chats_by_level in loads.items():
        for concurrency, chats in zip(CONCURRENCY, chats_by_level, strict=True):
            if concurrency not in levels:
                continue
            for server in servers[turn:] + servers[:turn]:
                only_this_one(server, servers)
                row = measure(server, chats, concurrency, max_tokens)
                rows[server.method][f"{name}@{concurrency}"] = row
                print(f"{server.method:9s} {name:8s} c={concurrency}: {row['tok_s']:7.2f} tok/s  acceptance "
                      f"{row['acceptance']}", flush=True)
            turn = (turn + 1) % len(servers)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=6, help="requests per workload and concurrency level")
    parser.add_argument("--methods", default="none,ngram,suffix,lookahead,lookahead-tuned")
    parser.add_argument("--workloads", default="copy,rag,template,stories,repeat")
    parser.add_argument("--concurrency", default="1,4",
                        help="levels to run, of 1 and 4 (each keeps its own requests): with 4 alone, every "
                        "workload's @4 cell runs on servers that have not seen its @1 cell")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lookahead.json")
    args = parser.parse_args()
    parts = args.concurrency.split(",")
    if not all(part.isdigit() and int(part) in CONCURRENCY for part in parts):
        parser.error(f"--concurrency: {args.concurrency!r} is not a comma-separated list of {CONCURRENCY}")
    levels = tuple(int(part) for part in parts)
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    chosen = args.workloads.split(",")
    loads = {name: chats_by_level for name, chats_by_level in workloads(args.requests).items() if name in chosen}
    results: dict[str, Any] = {"dtype": args.dtype, "max_tokens": args.max_tokens, "requests": args.requests,
                               "methods": {}, "skipped": {}}
    chosen_methods: list[str] = []
    for method in args.methods.split(","):
        if method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            results["skipped"]["suffix"] = "arctic-inference is not installed"
            print("suffix skipped: arctic-inference is not installed", flush=True)
            continue
        chosen_methods.append(method)
    with tempfile.TemporaryDirectory() as config_dir:
        servers = [start_server(method, args, Path(config_dir)) for method in chosen_methods]
        try:
            for server in servers:
                wait_healthy(f"{server.base_url}/health", [server.worker, server.gateway])
            for server in servers:
                only_this_one(server, servers)
                asyncio.run(run_chats(server.base_url, [[{"role": "user", "content": "Hello!"}]], 1, 8))  # warm-up
            results["methods"] = bench(servers, loads, args.max_tokens, levels)
        finally:
            for server in servers:
                stop(server.gateway)
                stop(server.worker)
    methods = results["methods"]
    summary: dict[str, Any] = {}
    for key in methods.get("none", {}):
        base = methods["none"][key]
        peers = [methods[m][key]["tok_s"] for m in ("ngram", "suffix") if m in methods]
        entry: dict[str, Any] = {}
        for method, rows in methods.items():
            diverged = sum(a != b for a, b in zip(rows[key]["texts"], base["texts"], strict=True))
            entry[method] = {"tok_s": rows[key]["tok_s"], "vs_none": round(rows[key]["tok_s"] / base["tok_s"], 3),
                             "acceptance": rows[key]["acceptance"], "requests_unlike_none": diverged}
        for method in LOOKAHEAD_CONFIGS:
            if peers and method in methods:
                entry[f"{method}_vs_best_peer"] = round(methods[method][key]["tok_s"] / max(peers), 3)
        summary[key] = entry
    results["summary"] = summary
    # How many requests' outputs differed from no speculation's, per method (in float32 none should;
    # in bfloat16 the verify step's other shapes round differently, for every method alike).
    results["requests_unlike_none"] = {
        method: sum(entry[method]["requests_unlike_none"] for entry in summary.values()) for method in methods}
    results["requests_per_method"] = sum(len(rows["texts"]) for rows in methods.get("none", {}).values())
    write_report(args.out, results, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
