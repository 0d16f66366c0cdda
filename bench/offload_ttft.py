"""TTFT of a long shared prefix re-sent after vLLM's own prefix cache evicted it, three ways, one run.

    python bench/offload_ttft.py [--prefix-tokens 1500] [--rounds 3] [--out bench/results/offload_ttft.json]

- offload: `taco_llm serve --enable-prefix-cache-offload --cache-service ...` (a cache service this
  script starts, so that it outlives the serve restart below);
- recompute: `taco_llm serve` with offload off;
- vllm: vLLM's own server (`python -m vllm.entrypoints.openai.api_server`), prefix caching on.

All three get the same model, dtype and small KV cache, so two long unrelated prompts evict the
prefix. Each round sends prefix + question (cold), evicts, then prefix + another question and times the
first streamed token. Then each server is restarted and the first request's TTFT is timed again (only
offload can hit: its blocks live in the cache service). Last, put/get MB/s of the cache service over
gRPC. Servers run one after another; these machines are shared and noisy, so this is a script, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protos import kv_cache_pb2, kv_cache_pb2_grpc  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"
BLOCK = 128
MiB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tokens(seed: int, count: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729 + i * i * 31) % 40000 for i in range(count)]


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready in time")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class Server:
    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path):
        self.name, self.argv, self.port, self.log_dir = name, argv, port, log_dir
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = (self.log_dir / f"{self.name}-{self.starts}.log").open("wb")
        self.process = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        _wait_healthy(self.url, self.process)

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)

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


def _put_chunks(blocks: list[tuple[bytes, bytes]], segments: int) -> Iterator[kv_cache_pb2.PutBlocksChunk]:
    for key, data in blocks:
        header = kv_cache_pb2.BlockHeader(key=key, size=len(data), num_segments=segments, checksum=zlib.crc32(data))
        yield kv_cache_pb2.PutBlocksChunk(header=header, data=data[:MiB])
        for start in range(MiB, len(data), MiB):
            yield kv_cache_pb2.PutBlocksChunk(data=data[start:start + MiB])


def _grpc_throughput(address: str, block_bytes: int, count: int) -> dict[str, float]:
    stub = kv_cache_pb2_grpc.KVBlockStoreStub(grpc.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 4 * MiB), ("grpc.max_send_message_length", 4 * MiB)]))
    blocks = [(os.urandom(32), os.urandom(block_bytes)) for _ in range(count)]
    total = block_bytes * count / MiB
    started = time.perf_counter()
    stub.PutBlocks(_put_chunks(blocks, 30), timeout=600)
    put_seconds = time.perf_counter() - started
    started = time.perf_counter()
    received = 0
    for chunk in stub.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=[k for k, _ in blocks], segment_major=True),
                                timeout=600):
        received += len(chunk.data)
    get_seconds = time.perf_counter() - started
    assert received == block_bytes * count
    return {"block_bytes": block_bytes, "blocks": count, "put_MBps": total / put_seconds,
            "get_MBps": total / get_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory-bytes", default="60000000",
                        help="small enough that two long prompts evict the prefix (~20 bfloat16 blocks)")
    parser.add_argument("--only", default="offload,recompute,vllm", help="which servers to measure")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "offload_ttft.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / "offload_ttft_logs"
    log_dir.mkdir(exist_ok=True)
    python = sys.executable
    from engine_worker.default_model import ensure_default_model

    model = str(ensure_default_model())
    engine = ["--dtype", args.dtype, "--max-model-len", "2048", "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
              "--seed", "0"]
    cache_port = _free_port()
    cache_log = (log_dir / "cache-service.log").open("wb")
    cache = subprocess.Popen([python, "-m", "cache_service", "--grpc-port", str(cache_port), "--memory", "4G"],
                             cwd=ROOT, stdout=cache_log, stderr=subprocess.STDOUT, start_new_session=True)
    results: dict[str, Any] = {"prefix_tokens": args.prefix_tokens, "dtype": args.dtype,
                               "kv_cache_memory_bytes": int(args.kv_cache_memory_bytes)}
    try:
        servers = {}
        offload_flags = ["--enable-prefix-cache-offload", "--cache-service", f"127.0.0.1:{cache_port}"]
        for name, extra in (("offload", offload_flags), ("recompute", [])):
            port = _free_port()
            servers[name] = Server(name, [python, "-m", "taco_llm.cli", "serve", "--port", str(port), "--grpc-port",
                                          str(_free_port()), *engine, *extra], port, log_dir)
        port = _free_port()
        servers["vllm"] = Server("vllm", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                          "--served-model-name", MODEL_NAME, "--port", str(port), *engine,
                                          "--enforce-eager", "--enable-prefix-caching"], port, log_dir)
        block_bytes = 2 * 3 * 64 * BLOCK * 30 * (2 if args.dtype in ("bfloat16", "float16") else 4)
        results["cache_service_grpc"] = _grpc_throughput(f"127.0.0.1:{cache_port}", block_bytes, 64)
        print(json.dumps(results["cache_service_grpc"]), flush=True)
        for name in args.only.split(","):
            print(f"measuring {name} ...", flush=True)
            results[name] = _measure(servers[name], args.prefix_tokens, args.rounds)
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
        results["cache_service_shared_memory"] = "not built"
    finally:
        _stop(cache)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
