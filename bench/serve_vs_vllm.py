"""taco-llm's stack against vLLM's own OpenAI server: same model, same flags, same workload, one run.

    python bench/serve_vs_vllm.py [--requests 24] [--max-tokens 128] [--out bench/results/serve_vs_vllm.json]

Each server is started, warmed up, driven with streaming chat at concurrency 1 and 8, and stopped,
one after the other. Written: output tok/s, TTFT p50/p99 and inter-token latency p50 for each, and
our/vLLM ratios. A script, not a test: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
from servers import free_port, stop, wait_healthy, write_report

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "Explain how a refrigerator works.", "Write a short poem about autumn leaves.",
    "What are the main causes of the French Revolution?", "Describe the water cycle for a child.",
    "Give three tips for learning a new language.", "How do vaccines train the immune system?",
    "Summarize the plot of a detective story you invent.", "Why do cats purr?",
]


async def _one(client: openai.AsyncOpenAI, question: str, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"ttft": arrivals[0] - start if arrivals else float("nan"), "gaps": gaps, "tokens": tokens}


async def _drive(url: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    queue = [QUESTIONS[i % len(QUESTIONS)] for i in range(requests)]
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        while queue:
            results.append(await _one(client, queue.pop(), max_tokens))

    await asyncio.gather(*(_one(client, q, 16) for q in QUESTIONS[:2]))  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    await client.close()
    return {
        "requests": len(results),
        "output_tokens": sum(r["tokens"] for r in results),
        "output_tok_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
    }


def _model_dir() -> str:
    sys.path.insert(0, str(ROOT))
    from taco_llm.engine_worker.frontend.default_model import ensure_default_model

    return str(ensure_default_model())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_vs_vllm.json")
    args = parser.parse_args()

    model = _model_dir()
    engine_flags = ["--dtype", args.dtype, "--enforce-eager", "--max-model-len", "2048",
                    "--kv-cache-memory-bytes", str(2 << 30), "--served-model-name", MODEL_NAME]
    servers = {
        "vllm": lambda port: [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                              "--port", str(port), "--disable-log-stats",
                              *engine_flags],
        "taco_llm": lambda port: [sys.executable, "-m", "taco_llm.cli", "serve", model, "--port", str(port),
                                  "--grpc-port", str(free_port()), "--disable-log-stats", *engine_flags],
    }
    report: dict[str, Any] = {"model": MODEL_NAME, "dtype": args.dtype, "max_tokens": args.max_tokens,
                              "requests_per_level": args.requests, "results": {}}
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    for name, command in servers.items():
        port = free_port()
        log = open(ROOT / "bench" / "results" / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the server
        process = subprocess.Popen(command(port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=ROOT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(f"{url}/health", [process])
            report["results"][name] = {
                f"c{c}": asyncio.run(_drive(url, c, args.requests, args.max_tokens)) for c in args.concurrency
            }
            print(name, json.dumps(report["results"][name], indent=1), flush=True)
        finally:
            stop(process)
            log.close()
    ours, theirs = report["results"]["taco_llm"], report["results"]["vllm"]
    report["ratios"] = {
        level: {
            "throughput_ratio": ours[level]["output_tok_per_s"] / theirs[level]["output_tok_per_s"],
            "ttft_p50_delta_ms": ours[level]["ttft_p50_ms"] - theirs[level]["ttft_p50_ms"],
            "itl_p50_delta_ms": ours[level]["itl_p50_ms"] - theirs[level]["itl_p50_ms"],
        }
        for level in ours
    }
    write_report(args.out, report, report["ratios"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
