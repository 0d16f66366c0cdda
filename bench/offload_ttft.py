"""TTFT of a long shared prefix re-sent after vLLM's own prefix cache evicted it, three ways, one run;
and the cache service's put/get throughput over gRPC bytes and over shared memory, side by side.

    python bench/offload_ttft.py [--prefix-tokens 1500] [--rounds 3] [--out bench/results/offload_ttft.json]
    python bench/offload_ttft.py --only throughput      # the throughput part alone (no engine)

- offload: `taco_llm serve --enable-prefix-cache-offload --cache-service ...` (a cache service this
  script starts, so that it outlives the serve restart below);
- recompute: `taco_llm serve` with offload off;
- vllm: vLLM's own server (`python -m vllm.entrypoints.openai.api_server`), prefix caching on.

All three get the same model, dtype and small KV cache, so two long unrelated prompts evict the
prefix. Each round sends prefix + question (cold), evicts, then prefix + another question and times the
first streamed token. Then each server is restarted and the first request's TTFT is timed again (only
offload can hit: its blocks live in the cache service). `offload_grpc` (not in the default list) is
offload with `--apc-offload-transport grpc`.

Throughput (first, before any engine): the worker's own transfer code (engine_worker/core/kv_offload)
against the cache service, on a stand-in KV cache shaped like the real one (bf16 SmolLM2-135M: 30
layers x K/V x 3 heads x 128 tokens x 64 dims = 2.95 MB a block). A put is the worker's save: one
gather out of the KV cache (into the shared-memory ring, or a private buffer), CRC-32, PutBlocks. A get
is the worker's load: GetBlocks, each layer copied into the KV cache as it lands, CRC-32 per block.
Both transports take turns on fresh keys, round after round, so drift falls on both alike. Meanwhile a
thread sends a Lookup every 10 ms, as the scheduler does for each new request, and times the answers:
the scheduler waits on them (0.25 s at most, then it recomputes), so they must not queue behind copies.
Servers run one after another; these machines are shared and noisy, so this is a script, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
from servers import ROOT, free_port, launch, stop, wait_grpc_healthy, wait_healthy

sys.path.insert(0, str(ROOT))

MODEL_NAME = "SmolLM2-135M-Instruct"
BLOCK = 128
MiB = 1024 * 1024
# bf16 SmolLM2-135M-Instruct's KV cache: per layer [K/V, blocks, kv heads, block tokens, head dim].
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def _tokens(seed: int, count: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729 + i * i * 31) % 40000 for i in range(count)]


class Server:
    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path):
        self.name, self.argv, self.port, self.log_dir = name, argv, port, log_dir
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.process = launch(self.argv, self.log_dir / f"{self.name}-{self.starts}.log")
        wait_healthy(f"{self.url}/health", [self.process])

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)

    def ttft(self, prompt: list[int], max_tokens: int = 8) -> tuple[float, int]:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=600)
        started = time.perf_counter()
        first = None
        cached = -1
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - started
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        return (first if first is not None else time.perf_counter() - started), cached

    def evict(self, seed: int) -> None:
        for i in range(2):
            self.ttft(_tokens(50_000 + seed * 10 + i, 15 * BLOCK + 5), max_tokens=1)


def _measure(server: Server, prefix_tokens: int, rounds: int) -> dict[str, Any]:
    server.start()
    try:
        server.ttft(_tokens(999, 64))  # warm-up
        cold, hit = [], []
        cached = []
        for r in range(rounds):
            prefix = _tokens(r + 1, prefix_tokens)
            cold.append(server.ttft([*prefix, *_tokens(100 + r, 8)])[0])
            server.evict(r)
            seconds, tokens = server.ttft([*prefix, *_tokens(200 + r, 8)])
            hit.append(seconds)
            cached.append(tokens)
        # A last prefix, sent once, then the server restarts: is it still a hit?
        last = _tokens(77, prefix_tokens)
        server.ttft([*last, *_tokens(300, 8)])
        time.sleep(2)  # offload saves are asynchronous
    finally:
        server.stop()
    server.start()
    try:
        after_restart, restart_cached = server.ttft([*last, *_tokens(301, 8)])
    finally:
        server.stop()
    return {
        "ttft_cold_s": cold, "ttft_after_eviction_s": hit, "cached_tokens_after_eviction": cached,
        "ttft_cold_p50_s": statistics.median(cold), "ttft_after_eviction_p50_s": statistics.median(hit),
        "ttft_first_request_after_restart_s": after_restart, "cached_tokens_after_restart": restart_cached,
    }


def _throughput(address: str, rounds: int, blocks_per_round: int, put_batch: int,
                get_batch: int) -> dict[str, Any]:
    """put and get MB/s through the worker's transfer code, gRPC bytes and shared memory taking turns."""
    import torch

    from taco_llm.engine_worker.core.kv_offload.client import BlockPayload, KVBlockClient
    from taco_llm.engine_worker.core.kv_offload.transfer import SAVE_RING_BYTES, KVLayout, LayerwiseLoad, byte_view
    from taco_llm.engine_worker.core.kv_offload.window import SaveRing

    # One intra-op thread: with two on these 2-core machines, an OpenMP barrier waiting on a core the
    # service (or anything else) holds turned a 2 ms gather into hundreds of ms, at random.
    torch.set_num_threads(1)
    cache_blocks = max(put_batch, get_batch)
    layers = [torch.randn(2, cache_blocks, KV_HEADS, BLOCK, HEAD_DIM).to(torch.bfloat16) for _ in range(LAYERS)]
    layout = KVLayout(layers, block_dim=1)
    size = layout.block_bytes
    clients = {"grpc": KVBlockClient(address, 1.0, "grpc"), "shm": KVBlockClient(address, 1.0, "auto")}
    ring_window = clients["shm"].attach(SAVE_RING_BYTES)
    if ring_window is None:
        raise RuntimeError("the shared-memory path is not available here (AttachWindow failed; see the log)")
    ring = SaveRing(ring_window)

    def put(name: str, keys: list[bytes]) -> None:
        """One step's save as the worker makes it: gather out of the KV cache, then PutBlocks."""
        start = 0
        if name == "shm":
            found = ring.allocate(size * len(keys))
            if found is None:
                raise RuntimeError("the save ring is full")
            start = found
            buffer = ring.window.tensor[start:start + size * len(keys)]
        else:
            buffer = torch.empty(size * len(keys), dtype=torch.uint8)
        layout.gather(range(len(keys)), buffer.view(len(keys), LAYERS, layout.segment_bytes))
        view = byte_view(buffer)
        payloads = [BlockPayload(key, b"", view[i * size:(i + 1) * size], LAYERS,
                                 start + i * size if name == "shm" else None) for i, key in enumerate(keys)]
        reply = clients[name].put(payloads, 600, ring.window if name == "shm" else None)
        if name == "shm":
            ring.free(start)
        if reply is None or reply.num_stored != len(keys):
            raise RuntimeError(f"{name}: a put failed or stored fewer blocks than it sent: {reply}")

    def get(name: str, keys: list[bytes]) -> None:
        """One step's load as the worker makes it: each layer into the KV cache as it lands, then CRCs."""
        load = LayerwiseLoad(layout, clients[name], keys, list(range(len(keys))))
        load.start()
        if not load.join():
            raise RuntimeError(f"{name}: a load failed")

    seconds = {name: {"put": 0.0, "get": 0.0} for name in clients}
    streaming = threading.Event()
    latencies: list[float] = []
    lookups = threading.Thread(target=_time_lookups, args=(address, streaming, latencies), daemon=True)
    lookups.start()
    try:
        for round_index in range(rounds):
            for name in ("grpc", "shm") if round_index % 2 == 0 else ("shm", "grpc"):
                keys = [hashlib.sha256(f"{name}-{round_index}-{i}".encode()).digest() for i in range(blocks_per_round)]
                for what, batch, step in (("put", put_batch, put), ("get", get_batch, get)):
                    started = time.perf_counter()
                    for first in range(0, len(keys), batch):
                        step(name, keys[first:first + batch])
                    seconds[name][what] += time.perf_counter() - started
        served_shm = clients["shm"].shared_memory
    finally:
        streaming.set()
        lookups.join()
        clients["shm"].detach(ring_window)
        for client in clients.values():
            client.close()
    if not served_shm:
        raise RuntimeError("the shm client fell back to gRPC bytes during the run")
    total = size * blocks_per_round * rounds / 1e6
    result: dict[str, Any] = {"block_bytes": size, "blocks_per_put": put_batch, "blocks_per_get": get_batch,
                              "MB_each_way_per_transport": total}
    for name in clients:
        result[name] = {"put_MBps": total / seconds[name]["put"], "get_MBps": total / seconds[name]["get"]}
    result["shm_vs_grpc_put"] = result["shm"]["put_MBps"] / result["grpc"]["put_MBps"]
    result["shm_vs_grpc_get"] = result["shm"]["get_MBps"] / result["grpc"]["get_MBps"]
    latencies.sort()
    result["lookup_ms_while_streaming"] = {
        "count": len(latencies), "p50": 1e3 * latencies[len(latencies) // 2],
        "p99": 1e3 * latencies[int(len(latencies) * 0.99)], "max": 1e3 * latencies[-1]}
    return result


def _time_lookups(address: str, done: threading.Event, latencies: list[float]) -> None:
    """Lookup round trips, every 10 ms until `done`, of an 8-block chain the service does not hold."""
    import grpc

    from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc

    keys = [hashlib.sha256(f"never-stored-{i}".encode()).digest() for i in range(8)]
    with grpc.insecure_channel(address) as channel:
        stub = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        while not done.wait(0.01):
            started = time.perf_counter()
            stub.Lookup(kv_cache_pb2.LookupRequest(keys=keys), timeout=30)
            latencies.append(time.perf_counter() - started)


def _servers(python: str, engine: list[str], cache_address: str, log_dir: Path,
             names: list[str]) -> dict[str, Server]:
    if not names:
        return {}
    from taco_llm.engine_worker.frontend.default_model import ensure_default_model

    model = str(ensure_default_model())
    offload = ["--enable-prefix-cache-offload", "--cache-service", cache_address]
    extra = {"offload": offload, "offload_grpc": [*offload, "--apc-offload-transport", "grpc"], "recompute": []}
    servers = {}
    for name in names:
        port = free_port()
        if name == "vllm":
            argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
                    MODEL_NAME, "--port", str(port), *engine, "--enforce-eager", "--enable-prefix-caching"]
        else:
            argv = [python, "-m", "taco_llm.cli", "serve", "--port", str(port), "--grpc-port", str(free_port()),
                    *engine, *extra[name]]
        servers[name] = Server(name, argv, port, log_dir)
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory-bytes", default="60000000",
                        help="small enough that two long prompts evict the prefix (~20 bfloat16 blocks)")
    parser.add_argument("--only", default="throughput,offload,recompute,vllm",
                        help="what to measure, in order: throughput (the cache service's MB/s, no engine) and "
                        "any of the servers offload, offload_grpc, recompute, vllm")
    parser.add_argument("--throughput-rounds", type=int, default=4)
    parser.add_argument("--throughput-blocks", type=int, default=64, help="blocks put and got per round and transport")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "offload_ttft.json")
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = set(chosen) - {"throughput", "offload", "offload_grpc", "recompute", "vllm"}
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / "offload_ttft_logs"
    log_dir.mkdir(exist_ok=True)
    python = sys.executable
    engine = ["--dtype", args.dtype, "--max-model-len", "2048", "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
              "--seed", "0"]
    cache_port = free_port()
    cache_address = f"127.0.0.1:{cache_port}"
    cache = launch([python, "-m", "taco_llm.cache_service", "--grpc-port", str(cache_port), "--memory", "4G"],
                   log_dir / "cache-service.log")
    results: dict[str, Any] = {"prefix_tokens": args.prefix_tokens, "dtype": args.dtype,
                               "kv_cache_memory_bytes": int(args.kv_cache_memory_bytes)}
    try:
        wait_grpc_healthy(cache_address, [cache])
        if "throughput" in chosen:
            print("measuring the cache service's throughput, gRPC bytes and shared memory ...", flush=True)
            results["cache_service_throughput"] = _throughput(cache_address, args.throughput_rounds,
                                                              args.throughput_blocks, put_batch=8, get_batch=12)
            print(json.dumps(results["cache_service_throughput"], indent=1), flush=True)
            args.out.write_text(json.dumps(results, indent=2))
        servers = _servers(python, engine, cache_address, log_dir, [n for n in chosen if n != "throughput"])
        for name, server in servers.items():
            print(f"measuring {name} ...", flush=True)
            results[name] = _measure(server, args.prefix_tokens, args.rounds)
            print(json.dumps(results[name], indent=1), flush=True)
            args.out.write_text(json.dumps(results, indent=2))  # what is measured so far survives
        if {"offload", "recompute", "vllm"} <= results.keys():
            offload, recompute = results["offload"], results["recompute"]
            results["speedup_after_eviction_vs_recompute"] = (
                recompute["ttft_after_eviction_p50_s"] / offload["ttft_after_eviction_p50_s"])
            results["speedup_after_eviction_vs_vllm"] = (
                results["vllm"]["ttft_after_eviction_p50_s"] / offload["ttft_after_eviction_p50_s"])
            results["speedup_after_restart_vs_recompute"] = (
                recompute["ttft_first_request_after_restart_s"] / offload["ttft_first_request_after_restart_s"])
    finally:
        stop(cache)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
