"""A fleet of two workers behind one gateway: how each routing policy copes with shared prefixes, with
the prefix-KV offload off and on, and what a client sees when a worker is killed mid-run.

    python bench/fleet.py [--requests 200] [--rate 1.0] [--seed 0] [--rows cache_aware_off,...]
                          [--no-kill-run | --kill-run] [--gateways 1,2,3] [--out bench/results/fleet.json]

Workload: 8 pseudo-documents (deterministic, distinct from their first token), each the system prompt
of a chat whose shared prefix (chat template + document) is --prefix-tokens long (512 by default: four
whole 128-token KV blocks of vLLM's CPU backend), followed by a short question drawn per request.
Requests arrive as a seeded Poisson process (--rate per second), each on a document drawn uniformly,
streamed with the openai SDK (max_tokens 16, temperature 0, ignore_eos so every reply is 16 tokens).

Fleet: `taco_llm serve --num-workers 2 --routing POLICY` on the bundled model, float32, max-model-len
2048, max-num-seqs 8. Each worker's KV cache holds about half the documents: --kv-cache-memory-bytes is
(4 documents' prefix blocks + --headroom-tokens for running requests' own blocks) x the model's KV bytes
per token (layers x K/V x kv heads x head dim x 4 bytes = 46,080 for SmolLM2-135M in float32), so
round_robin makes each worker cycle through all 8 and evict, while a cache-aware router can keep each
document on one worker. Offload on adds --enable-prefix-cache-offload and a cache service sized for
all documents, shared by both workers.

Rows (a fresh serve each, one after another): round_robin, least_load and cache_aware, each with
offload off and on (`<policy>_off`, `<policy>_on`). Each row: one warm-up pass over the documents (not
counted), then --requests timed requests. Reported per row:
- TTFT p50/p90 (send to the first streamed content token), output tokens per second (all output tokens
  over the wall time from the first send to the last reply), client-visible errors;
- prefix_hit_rate_cached_tokens: the replies' usage cached_tokens over their prompt tokens (vLLM's
  prefix cache hits, which with offload on include blocks loaded back from the cache service);
- prefix_hit_rate_offloaded: the share of prompt tokens loaded from the cache service, from the workers'
  `vllm:external_prefix_cache_hits_total` (the KV connector's hits, read at each worker's --metrics-port,
  found through GetModelInfo); when no worker serves metrics, the gateway's
  `taco_llm_router_prefix_hit_chunks_total{where="shared_cache"}` over its lookup chunks instead;
  `prefix_hit_rate_offloaded_source` says which. prefix_hit_rate_engine_local is the first minus the
  second where the workers' figure is known;
- routing_prefix_hit_rate: the gateway's prefix hit chunks (worker and shared cache) over its lookup
  chunks (cache_aware only), and its routing decisions, retries and migrations over the timed part.

Kill run (on by default, after the rows): cache_aware, offload off, --requests requests of
--kill-max-tokens (64) tokens each; once half are sent, the worker with the most streams by the
gateway's taco_llm_worker_load{kind="gateway_streams"} (waiting up to 15 s for one that has any) is
killed with SIGKILL together with its vLLM engine process, as a crash would; serve restarts it.
Workers are found as descendants of the serve process whose command line runs
`taco_llm.engine_worker`; the gRPC port is that command line's --grpc-port (its metrics port comes from
GetModelInfo). Reported: client-visible errors (target 0), the gateway's retries and migrations, and
the worker pids afterwards (the restart).

Several gateways (--gateways 1,2,3, instead of the rows and the kill run above): cache_aware, offload
off, the workers registered in a Redis the script starts (serve --registry-url), and N gateways in all:
serve's own and N - 1 `taco_llm gateway --registry-url` processes on the same workers, behind a
round-robin front (request i, and warm-up request i, go to gateway i mod N). Two rows per N:
`gateways<N>_approximate` (--no-shared-prefix-view: each gateway matches what it alone sent) and
`gateways<N>_shared` (what the workers publish their caches hold, from vLLM's KV cache events). The
gateways' metrics are summed. `comparisons` gives each row's hit rate against the one-gateway row of
its view.

Written to --out after every row, so that a long run's finished rows survive. The machine is shared
and noisy: this is a script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam
from servers import ROOT, launch, stop, wait_grpc_healthy, wait_healthy

MODEL_NAME = "SmolLM2-135M-Instruct"
POLICIES = ("round_robin", "least_load", "cache_aware")
ROWS = {f"{policy}_{'on' if offload else 'off'}": (policy, offload)
        for offload in (False, True) for policy in POLICIES}
KV_BLOCK_TOKENS = 128  # vLLM's CPU backend block size
DOCUMENTS = 8
WORKERS = 2
GATEWAY_VIEWS = ("approximate", "shared")
# cache_aware with offload on counts as no worse than the best other row within this share of TTFT p50.
NOISE_MARGIN = 0.10
WARM_UP_QUESTION = "Which words does this document use most?"

# ------------------------------------------------------------------------------------------ workload

_SYLLABLES = ("ka", "lo", "ven", "tra", "mi", "sol", "dar", "en", "qui", "ro", "bel", "tas", "nor", "ux",
              "fen", "gal", "ior", "pe", "zan", "cor", "lum", "bri", "osk", "ath")
_GLUE = ("the", "of", "and", "a", "in", "with", "to", "for", "by", "under", "near", "after", "each", "every")
_VERBS = ("holds", "measures", "describes", "replaces", "follows", "records", "limits", "joins", "carries")
_QUESTIONS = (
    "What does the document say about {word}?", "Summarize paragraph {n} in one sentence.",
    "Who or what is {word}, according to the text?", "List two facts about {word}.",
    "How is {word} related to {other}?", "Why does paragraph {n} mention {word}?",
    "Give a title for paragraph {n}.", "Is {word} described before {other}?",
    "Explain {word} to a child.", "What happens after {word} in paragraph {n}?",
)


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def _sentence(rng: random.Random, names: list[str]) -> str:
    words = [rng.choice(names).capitalize(), rng.choice(_VERBS)]
    for _ in range(rng.randint(4, 9)):
        words.append(rng.choice(_GLUE) if rng.random() < 0.4 else rng.choice(names))
    return " ".join(words) + "."


def document_names(index: int, seed: int) -> list[str]:
    """The made-up nouns document `index` is about: its own, so documents share no prefix beyond the header."""
    rng = random.Random(f"names-{seed}-{index}")
    return [_pseudo_word(rng) for _ in range(12)]


def document_text(index: int, seed: int, words: int) -> str:
    """Deterministic, distinct pseudo-prose of at least `words` words, in numbered paragraphs."""
    rng = random.Random(f"document-{seed}-{index}")
    names = document_names(index, seed)
    parts = [f"Record {index + 1}: the {names[0]} {names[1]} archive."]
    count, paragraph = len(parts[0].split()), 1
    while count < words:
        sentences = [_sentence(rng, names) for _ in range(rng.randint(3, 5))]
        parts.append(f"Paragraph {paragraph}. " + " ".join(sentences))
        count += len(parts[-1].split())
        paragraph += 1
    return "\n".join(parts)


def chat(document: str, question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": document}, {"role": "user", "content": question}]


def shared_prefix_tokens(tokenizer: Any, document: str) -> int:
    """Tokens two chats on `document` with different questions share: the template and the document."""
    first, second = (tokenizer.apply_chat_template(chat(document, q), tokenize=False, add_generation_prompt=True)
                     for q in ("Alpha?", "Zulu?"))
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (first, second)]
    shared = 0
    for a, b in zip(*ids, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def make_documents(tokenizer: Any, count: int, prefix_tokens: int, seed: int) -> list[str]:
    """Documents cut so that each chat's shared prefix is `prefix_tokens` long (give or take a token that
    the cut's decode and re-encode may move)."""
    documents = []
    for index in range(count):
        text = document_text(index, seed, words=prefix_tokens)  # words tokenize into more than one token each
        overhead = shared_prefix_tokens(tokenizer, text) - len(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prefix_tokens - overhead]
        documents.append(tokenizer.decode(ids).rstrip())
    return documents


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the timed part starts
    document: int
    question: str


def poisson_schedule(count: int, rate: float, documents: int, seed: int) -> list[Arrival]:
    """`count` arrivals of a Poisson process of `rate` per second, each on a uniformly drawn document."""
    rng = random.Random(f"schedule-{seed}")
    arrivals, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        document = rng.randrange(documents)
        names = document_names(document, seed)
        template = rng.choice(_QUESTIONS)
        question = template.format(word=rng.choice(names), other=rng.choice(names), n=rng.randint(1, 6))
        arrivals.append(Arrival(now, document, question))
    return arrivals


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes)


def kv_cache_bytes(per_token: int, prefix_tokens: int, *, prefixes: float, headroom_tokens: int) -> int:
    """Room for `prefixes` documents' whole prefix blocks and `headroom_tokens` more, in whole blocks."""
    prefix_blocks = prefix_tokens // KV_BLOCK_TOKENS
    blocks = math.ceil(prefixes * prefix_blocks) + math.ceil(headroom_tokens / KV_BLOCK_TOKENS)
    return blocks * KV_BLOCK_TOKENS * per_token


# ------------------------------------------------------------------------------------------ metrics

Labels = tuple[tuple[str, str], ...]
Snapshot = dict[tuple[str, Labels], float]


def parse_metrics(text: str) -> Snapshot:
    """Every sample of a Prometheus text page, by name and sorted labels."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def scrape(url: str) -> Snapshot:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_metrics(reply.read().decode())


def difference(after: Snapshot, before: Snapshot) -> Snapshot:
    """What each sample gained (counters); a sample absent before counts from 0."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(snapshot: Snapshot, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in snapshot.items()
               if sample == name and wanted <= set(sample_labels))


def by_label(snapshot: Snapshot, name: str, *labels: str) -> dict[str, float]:
    """`name`'s samples summed by the given labels' values (joined with '/'), zeros left out."""
    sums: dict[str, float] = {}
    for (sample, sample_labels), value in snapshot.items():
        if sample == name and value:
            found = dict(sample_labels)
            key = "/".join(found.get(label, "") for label in labels)
            sums[key] = sums.get(key, 0.0) + value
    return sums


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


# ------------------------------------------------------------------------------------------ requests

@dataclass
class Outcome:
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


async def one_request(client: openai.AsyncOpenAI, document: str, question: str, max_tokens: int) -> Outcome:
    outcome = Outcome()
    started = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=chat(document, question),
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if outcome.ttft is None and chunk.choices and chunk.choices[0].delta.content:
                outcome.ttft = time.perf_counter() - started
            if chunk.usage is not None:
                outcome.prompt_tokens = chunk.usage.prompt_tokens
                outcome.output_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                outcome.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    except Exception as error:  # every failure a client sees counts, whatever it is
        status = getattr(error, "status_code", None)
        outcome.error = f"{type(error).__name__}{f' {status}' if status else ''}: {str(error)[:200]}"
        return outcome
    if outcome.ttft is None or outcome.output_tokens == 0:
        outcome.error = "a reply with no content or no usage"
    return outcome


def _clients(urls: list[str]) -> list[openai.AsyncOpenAI]:
    return [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600) for url in urls]


async def drive(urls: list[str], documents: list[str], schedule: list[Arrival], max_tokens: int, label: str,
                at_half: Callable[[Callable[[], int]], Coroutine[Any, Any, None]] | None = None,
                ) -> tuple[list[Outcome], float]:
    """Sends each request at its arrival time, request i to gateway i mod len(urls) (a round-robin
    front); once half are sent, `at_half` runs beside the rest with a function that counts the requests
    in flight. Returns the outcomes in arrival order and the wall time."""
    clients = _clients(urls)
    outcomes: list[Outcome | None] = [None] * len(schedule)
    done = 0

    async def send(index: int, arrival: Arrival) -> None:
        nonlocal done
        outcomes[index] = await one_request(clients[index % len(clients)], documents[arrival.document],
                                            arrival.question, max_tokens)
        done += 1
        if done % 20 == 0 or done == len(schedule):
            errors = sum(1 for o in outcomes if o is not None and o.error)
            print(f"  {label}: {done}/{len(schedule)} replied, {errors} errors", flush=True)

    tasks: list[asyncio.Task[None]] = []
    side: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    for index, arrival in enumerate(schedule):
        await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(index, arrival)))
        if at_half is not None and index + 1 == len(schedule) // 2:
            side.append(asyncio.create_task(at_half(lambda: len(tasks) - done)))
    await asyncio.gather(*tasks, *side)
    wall = time.perf_counter() - start
    for client in clients:
        await client.close()
    return [o for o in outcomes if o is not None], wall


async def warm_up(urls: list[str], documents: list[str], max_tokens: int) -> None:
    """One pass over the documents, one at a time (document i through gateway i mod len(urls)), so each
    worker starts the timed part with some warm."""
    clients = _clients(urls)
    for index, document in enumerate(documents):
        outcome = await one_request(clients[index % len(clients)], document, WARM_UP_QUESTION, max_tokens)
        if outcome.error:
            raise RuntimeError(f"warm-up request failed: {outcome.error}")
    for client in clients:
        await client.close()


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear interpolation between closest ranks, as numpy's default; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    errors = [o.error for o in outcomes if o.error is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    output = sum(o.output_tokens for o in outcomes)
    return {
        "requests": len(outcomes), "errors": len(errors), "error_examples": sorted(set(errors))[:5],
        "wall_s": wall, "output_tokens": output, "output_tok_per_s": output / wall if wall else None,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
        "prompt_tokens": prompt, "cached_tokens": cached, "prefix_hit_rate_cached_tokens": ratio(cached, prompt),
    }


# ------------------------------------------------------------------------------------------ the fleet

@dataclass(frozen=True)
class WorkerProcess:
    pid: int
    grpc_port: int
    metrics_port: int | None


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def worker_processes(serve_pid: int) -> list[tuple[int, int]]:
    """serve's engine workers, as (pid, gRPC port): descendants running `-m taco_llm.engine_worker`,
    with the --grpc-port of their command line."""
    import psutil

    found = []
    for child in psutil.Process(serve_pid).children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        port = _flag_value(argv, "--grpc-port")
        if "taco_llm.engine_worker" in argv and port is not None:
            found.append((child.pid, int(port)))
    return sorted(found)


def metrics_port(grpc_port: int) -> int | None:
    """The worker's --metrics-port, as its GetModelInfo says; None when it serves no metrics."""
    import grpc

    from taco_llm.protos import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
    return int(info.metrics_port) or None


def kill_worker(worker: WorkerProcess) -> list[int]:
    """SIGKILL to the worker and every process under it (its vLLM engine core), as a crash would."""
    import psutil

    try:
        process = psutil.Process(worker.pid)
        victims = [*process.children(recursive=True), process]
    except psutil.NoSuchProcess:
        return []
    killed = []
    for victim in victims:
        try:
            victim.send_signal(signal.SIGKILL)
            killed.append(victim.pid)
        except psutil.NoSuchProcess:
            pass
    return killed


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports outside the ephemeral range (serve numbers its
    workers' ports up from the one it is given)."""
    import socket

    rng = random.Random()
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(1000):
        base = rng.randrange(15000, 65535 - count)
        if any(low <= port <= high for port in (base, base + count - 1)):
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports found")


@dataclass
class Fleet:
    """One `taco_llm serve --num-workers K` (`num_workers`, as its argv says), its log and the processes
    it started."""

    argv: list[str]
    url: str
    log: Path
    process: subprocess.Popen[bytes] | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    num_workers: int = WORKERS
    # More gateways on the same workers (`taco_llm gateway --registry-url`): their argv and URLs.
    more_gateways: list[tuple[list[str], str]] = field(default_factory=list)
    gateway_processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [self.url, *(url for _, url in self.more_gateways)]

    def start(self) -> None:
        self.process = launch(self.argv, self.log)
        wait_healthy(f"{self.url}/health", [self.process])
        for n, (argv, url) in enumerate(self.more_gateways, start=2):
            self.gateway_processes.append(launch(argv, self.log.with_suffix(f".gateway{n}.log")))
            wait_healthy(f"{url}/health", [self.process, self.gateway_processes[-1]])
        deadline = time.monotonic() + 900
        found = worker_processes(self.process.pid)
        while len(found) < self.num_workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve started {len(found)} workers, not {self.num_workers}; see {self.log}")
            time.sleep(1)
            found = worker_processes(self.process.pid)
        for _, port in found:
            wait_grpc_healthy(f"127.0.0.1:{port}", [self.process], timeout=900)
        self.workers = [WorkerProcess(pid, port, metrics_port(port)) for pid, port in found]
        self.wait_gateway_sees_workers()

    def wait_gateway_sees_workers(self) -> None:
        """Until every gateway counts every worker ready, where it says (taco_llm_worker_ready)."""
        deadline = time.monotonic() + 120
        for url in self.urls:
            while time.monotonic() < deadline:
                ready = by_label(scrape(f"{url}/metrics"), "taco_llm_worker_ready", "worker")
                if not ready or sum(ready.values()) >= self.num_workers:
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"the gateway at {url} did not see {self.num_workers} ready workers within "
                                   f"120s; see {self.log}")

    def stop(self) -> None:
        for process in self.gateway_processes:
            stop(process)
        if self.process is not None:
            stop(self.process)

    def gateway_metrics(self) -> Snapshot:
        """Every gateway's metrics, summed."""
        merged: Snapshot = {}
        for url in self.urls:
            for key, value in scrape(f"{url}/metrics").items():
                merged[key] = merged.get(key, 0.0) + value
        return merged

    def worker_metrics(self) -> Snapshot | None:
        """The workers' metrics summed (their label sets kept apart by a `bench_worker` label); None
        when any worker serves none."""
        merged: Snapshot = {}
        for worker in self.workers:
            if worker.metrics_port is None:
                return None
            for (name, labels), value in scrape(f"http://127.0.0.1:{worker.metrics_port}/metrics").items():
                merged[(name, (*labels, ("bench_worker", str(worker.pid))))] = value
        return merged


def view_flags(view: str | None) -> list[str]:
    """The gateway flags of a row's prefix view (None: a row without a registry)."""
    return ["--no-shared-prefix-view"] if view == "approximate" else []


def serve_argv(python: str, port: int, policy: str, *, offload: bool, kv_bytes: int,
               registry_url: str | None = None, view: str | None = None) -> list[str]:
    grpc_base, metrics_base = free_port_run(WORKERS), free_port_run(WORKERS)
    argv = [python, "-m", "taco_llm.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_base),
            "--metrics-port", str(metrics_base), "--num-workers", str(WORKERS), "--routing", policy,
            "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8",
            "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0"]
    if registry_url is not None:
        argv += ["--registry-url", registry_url, *view_flags(view)]
    if offload:
        argv += ["--enable-prefix-cache-offload", "--cache-service-port", str(free_port_run(1)),
                 # ~480 MiB of a 24 GiB host: every document's blocks, several times over.
                 "--cpu-prefill-memory-utilization", "0.02"]
    return argv


def fleet_figures(gateway: Snapshot, workers: Snapshot | None, outcomes: dict[str, Any],
                  *, why_no_workers: str = "no worker served metrics") -> dict[str, Any]:
    """The row's cache and routing figures from the metrics gained over its timed part; `workers`, the
    workers' own, None where they were not read (`why_no_workers`)."""
    lookups = total(gateway, "taco_llm_router_prefix_lookup_chunks_total")
    hits = by_label(gateway, "taco_llm_router_prefix_hit_chunks_total", "where")
    figures: dict[str, Any] = {
        "routing_prefix_hit_rate": ratio(sum(hits.values()), lookups),
        "routing_prefix_lookup_chunks": lookups, "routing_prefix_hit_chunks": hits,
        "routing_decisions": by_label(gateway, "taco_llm_router_decisions_total", "policy", "reason"),
        "retries": by_label(gateway, "taco_llm_router_retries_total", "code"),
        "migrations": by_label(gateway, "taco_llm_router_migrations_total", "outcome"),
    }
    if workers is not None:
        external = total(workers, "vllm:external_prefix_cache_hits_total")
        queried = total(workers, "vllm:prefix_cache_queries_total")
        figures["workers_prefix_cache_tokens"] = {
            "queries": queried, "hits": total(workers, "vllm:prefix_cache_hits_total"),
            "external_queries": total(workers, "vllm:external_prefix_cache_queries_total"),
            "external_hits": external}
        prompt = outcomes["prompt_tokens"]
        figures["prefix_hit_rate_offloaded"] = ratio(external, prompt)
        figures["prefix_hit_rate_offloaded_source"] = (
            "workers: vllm:external_prefix_cache_hits_total / the replies' prompt tokens")
        figures["prefix_hit_rate_engine_local"] = ratio(outcomes["cached_tokens"] - external, prompt)
    else:
        figures["prefix_hit_rate_offloaded"] = ratio(hits.get("shared_cache", 0.0), lookups)
        figures["prefix_hit_rate_offloaded_source"] = (
            "gateway: taco_llm_router_prefix_hit_chunks_total{where=shared_cache} / lookup chunks "
            f"({why_no_workers})")
        figures["prefix_hit_rate_engine_local"] = None
    return figures


# ------------------------------------------------------------------------------------------ runs

@dataclass(frozen=True)
class Setup:
    python: str
    documents: list[str]
    schedule: list[Arrival]
    kv_bytes: int
    max_tokens: int
    log_dir: Path


async def _busiest_worker(fleet: Fleet, in_flight: Callable[[], int],
                          patience: float = 15.0) -> tuple[WorkerProcess, float]:
    """The worker with the most streams by the gateway's taco_llm_worker_load{kind="gateway_streams"}
    (refreshed with each health check), waiting up to `patience` seconds for one that has any while the
    client has requests in flight, so that the kill cuts streams; else the first worker."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        load = await asyncio.to_thread(fleet.gateway_metrics)
        streams = {worker: total(load, "taco_llm_worker_load", worker=f"127.0.0.1:{worker.grpc_port}",
                                 kind="gateway_streams") for worker in fleet.workers}
        busiest = max(fleet.workers, key=lambda worker: streams[worker])
        if streams[busiest] >= 1 and in_flight() >= 1:
            return busiest, streams[busiest]
        await asyncio.sleep(0.05)
    return fleet.workers[0], 0.0


@contextlib.contextmanager
def redis_server(log_dir: Path) -> Iterator[str]:
    """A redis-server of this run's own, on a free port, without persistence: its URL."""
    from servers import free_port

    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(log_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(20)


def run_row(setup: Setup, name: str, policy: str, *, offload: bool, kill: bool = False,
            gateways: int = 1, view: str | None = None) -> dict[str, Any]:
    """One row; with `view` ("approximate" or "shared"), its workers register in a Redis of the row's
    own, and `gateways` gateways in all serve them."""
    if view is None:
        return _run_row(setup, name, policy, offload=offload, kill=kill)
    with redis_server(setup.log_dir) as registry_url:
        return _run_row(setup, name, policy, offload=offload, kill=kill, gateways=gateways, view=view,
                        registry_url=registry_url)


def _run_row(setup: Setup, name: str, policy: str, *, offload: bool, kill: bool, gateways: int = 1,
             view: str | None = None, registry_url: str | None = None) -> dict[str, Any]:
    from servers import free_port

    port = free_port()
    fleet = Fleet(serve_argv(setup.python, port, policy, offload=offload, kv_bytes=setup.kv_bytes,
                             registry_url=registry_url, view=view),
                  f"http://127.0.0.1:{port}", setup.log_dir / f"{name}.log")
    for _ in range(gateways - 1):
        more = free_port()
        fleet.more_gateways.append(([setup.python, "-m", "taco_llm.cli", "gateway", "--port", str(more),
                                     "--registry-url", str(registry_url), "--routing", policy, *view_flags(view)],
                                    f"http://127.0.0.1:{more}"))
    started = time.perf_counter()
    print(f"{name}: starting serve --num-workers {WORKERS} --routing {policy}"
          f"{' --enable-prefix-cache-offload' if offload else ''}"
          f"{f' with {gateways} gateways, {view} prefix view' if view else ''} (log {fleet.log})", flush=True)
    killed: dict[str, Any] = {}

    async def kill_one(in_flight: Callable[[], int]) -> None:
        victim, streams = await _busiest_worker(fleet, in_flight)
        killed.update(worker_pid=victim.pid, grpc_port=victim.grpc_port, client_in_flight=in_flight(),
                      gateway_streams_on_victim=streams, pids_killed=kill_worker(victim),
                      at_s=time.perf_counter() - timed_start)
        print(f"  {name}: killed worker pid {victim.pid} (gRPC port {victim.grpc_port}) with {streams:.0f} "
              f"streams on it by the gateway's count, {in_flight()} requests in flight", flush=True)

    try:
        fleet.start()
        print(f"  {name}: ready in {time.perf_counter() - started:.0f}s; warming up", flush=True)
        asyncio.run(warm_up(fleet.urls, setup.documents, setup.max_tokens))
        gateway_before, workers_before = fleet.gateway_metrics(), fleet.worker_metrics()
        timed_start = time.perf_counter()
        outcomes, wall = asyncio.run(drive(fleet.urls, setup.documents, setup.schedule, setup.max_tokens, name,
                                           at_half=kill_one if kill else None))
        try:
            gateway = difference(fleet.gateway_metrics(), gateway_before)
        except OSError as error:  # the kill run may have taken serve down: its errors say so already
            print(f"  {name}: the gateway's metrics could not be read after the run: {error}", flush=True)
            gateway = {}
        workers_after = None if kill else fleet.worker_metrics()
        alive = fleet.process is not None and fleet.process.poll() is None
        # A killed worker is restarted by serve on its port: the pids now say whether it was.
        after = worker_processes(fleet.process.pid) if alive and fleet.process is not None else []
    finally:
        fleet.stop()
    summary = summarize(outcomes, wall)
    workers = (difference(workers_after, workers_before)
               if workers_after is not None and workers_before is not None else None)
    row = {"policy": policy, "offload": offload, "gateways": gateways, "prefix_view": view, **summary, **fleet_figures(
        gateway, workers, summary, why_no_workers="a worker was killed" if kill else "no worker served metrics")}
    if kill:
        row.update(killed=killed, serve_alive_after=alive, worker_pids_after=[pid for pid, _ in after])
    print(f"  {name}: TTFT p50 {_ms(row['ttft_p50_s'])} p90 {_ms(row['ttft_p90_s'])}, "
          f"{row['output_tok_per_s']:.1f} tok/s, hit rate {_pct(row['prefix_hit_rate_cached_tokens'])} "
          f"(routing {_pct(row['routing_prefix_hit_rate'])}), {row['errors']} errors", flush=True)
    return row


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def gateway_comparisons(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each several-gateway row's hit rate against the one-gateway row of its view, and the issue's
    target: with 3 gateways, the shared view within 0.05 of one gateway's and at least 0.9."""
    result: dict[str, Any] = {}
    for name, row in rows.items():
        one = rows.get(f"gateways1_{row['prefix_view']}")
        if row["gateways"] > 1 and one is not None and row["prefix_hit_rate_cached_tokens"] is not None:
            result[f"{name}_hit_rate_minus_one_gateway"] = (row["prefix_hit_rate_cached_tokens"]
                                                             - one["prefix_hit_rate_cached_tokens"])
    three, one = rows.get("gateways3_shared"), rows.get("gateways1_shared")
    if three is not None and one is not None:
        result["target_met_3_gateways_shared"] = (
            three["prefix_hit_rate_cached_tokens"] >= 0.9
            and one["prefix_hit_rate_cached_tokens"] - three["prefix_hit_rate_cached_tokens"] <= 0.05)
    return result


def comparisons(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """cache_aware against round_robin (offload off), and cache_aware with offload against the rest."""
    result: dict[str, Any] = {}
    p50 = {name: row["ttft_p50_s"] for name, row in rows.items() if row.get("ttft_p50_s")}
    if {"round_robin_off", "cache_aware_off"} <= p50.keys():
        result["ttft_p50_round_robin_over_cache_aware_offload_off"] = p50["round_robin_off"] / p50["cache_aware_off"]
    others = {name: value for name, value in p50.items() if name != "cache_aware_on"}
    if "cache_aware_on" in p50 and others:
        best = min(others, key=lambda name: others[name])
        result["ttft_p50_cache_aware_on_over_best_other"] = p50["cache_aware_on"] / others[best]
        result["best_other_row"] = best
        result["cache_aware_on_no_worse_than_best_other"] = p50["cache_aware_on"] <= others[best] * (1 + NOISE_MARGIN)
        result["no_worse_margin"] = NOISE_MARGIN
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per row and in the kill run")
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests per second")
    parser.add_argument("--seed", type=int, default=0, help="seeds the documents, questions and arrivals")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=512, help="tokens of each document's shared prefix")
    parser.add_argument("--headroom-tokens", type=int, default=512,
                        help="KV cache room beyond half the documents, for running requests' own blocks")
    kill = parser.add_mutually_exclusive_group()
    kill.add_argument("--kill-run", dest="kill_run", action="store_true", default=True,
                      help="after the rows, the kill run (default)")
    kill.add_argument("--no-kill-run", dest="kill_run", action="store_false")
    parser.add_argument("--kill-max-tokens", type=int, default=64,
                        help="max_tokens in the kill run: longer replies, so that the kill cuts streams under way")
    parser.add_argument("--gateways", default="", metavar="N,...",
                        help="instead of --rows and the kill run: cache_aware rows with N gateways each, the "
                        "approximate and the shared prefix view")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fleet.json")
    args = parser.parse_args()
    try:
        gateway_counts = [int(n) for n in args.gateways.split(",") if n]
    except ValueError:
        parser.error(f"--gateways {args.gateways!r}: expected numbers separated by commas")
    if any(n < 1 for n in gateway_counts):
        parser.error(f"--gateways {args.gateways!r}: each count must be at least 1")
    chosen = [name for name in args.rows.split(",") if name]
    unknown = [name for name in chosen if name not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    if args.requests < 2:
        parser.error(f"--requests must be at least 2, got {args.requests}")
    if not args.rate > 0:
        parser.error(f"--rate must be positive, got {args.rate}")
    if args.prefix_tokens < KV_BLOCK_TOKENS or args.headroom_tokens < 0:
        parser.error(f"--prefix-tokens must be at least {KV_BLOCK_TOKENS} and --headroom-tokens at least 0")

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from taco_llm.engine_worker.frontend.default_model import ensure_default_model

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    documents = make_documents(tokenizer, DOCUMENTS, args.prefix_tokens, args.seed)
    per_token = kv_bytes_per_token(model_dir, dtype_bytes=4)
    kv_bytes = kv_cache_bytes(per_token, args.prefix_tokens, prefixes=DOCUMENTS / WORKERS,
                              headroom_tokens=args.headroom_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / "fleet_logs"
    log_dir.mkdir(exist_ok=True)
    setup = Setup(sys.executable, documents, poisson_schedule(args.requests, args.rate, DOCUMENTS, args.seed),
                  kv_bytes, args.max_tokens, log_dir)
    results: dict[str, Any] = {
        "setup": {"model": MODEL_NAME, "dtype": "float32", "workers": WORKERS, "documents": DOCUMENTS,
                  "shared_prefix_tokens": [shared_prefix_tokens(tokenizer, d) for d in documents],
                  "kv_bytes_per_token": per_token, "kv_cache_memory_bytes": kv_bytes,
                  "kv_cache_blocks": kv_bytes // (per_token * KV_BLOCK_TOKENS), "requests": args.requests,
                  "rate": args.rate, "seed": args.seed, "max_tokens": args.max_tokens,
                  "schedule_s": setup.schedule[-1].at},
        "rows": {},
    }
    print(json.dumps(results["setup"]), flush=True)
    if gateway_counts:
        for count in gateway_counts:
            for view in GATEWAY_VIEWS:
                name = f"gateways{count}_{view}"
                results["rows"][name] = run_row(setup, name, "cache_aware", offload=False, gateways=count, view=view)
                results["comparisons"] = gateway_comparisons(results["rows"])
                args.out.write_text(json.dumps(results, indent=2))
        print(json.dumps(results.get("comparisons", {}), indent=1))
        print(f"wrote {args.out}")
        return 0
    for name in chosen:
        policy, offload = ROWS[name]
        results["rows"][name] = run_row(setup, name, policy, offload=offload)
        results["comparisons"] = comparisons(results["rows"])
        args.out.write_text(json.dumps(results, indent=2))  # what is measured so far survives
    if args.kill_run:
        kill_setup = dataclasses.replace(setup, max_tokens=args.kill_max_tokens)
        results["kill_run"] = {"max_tokens": args.kill_max_tokens,
                               **run_row(kill_setup, "kill_run", "cache_aware", offload=False, kill=True)}
        args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results.get("comparisons", {}), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
