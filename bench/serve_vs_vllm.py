"""taco-llm's stack against vLLM's own OpenAI server: same model, same flags, same workload, one run.

    python bench/serve_vs_vllm.py [--requests 24] [--max-tokens 128] [--apis chat responses messages]
                                  [--out bench/results/serve_vs_vllm.json]

Each server is started, warmed up, driven with streaming requests of each API (chat completions,
OpenAI's Responses API through the openai SDK, Anthropic's Messages API through Anthropic's SDK) at
concurrency 1 and 8, and stopped, one after the other. Written: output tok/s, TTFT p50/p99 and
inter-token latency p50 for each, and our/vLLM ratios. A script, not a test: these machines are shared
and noisy.
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

import anthropic
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


class Clients:
    """One streaming request of each API, timed the same way: when each piece of text arrives, and the
    output tokens its usage reports."""

    def __init__(self, url: str) -> None:
        self.openai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
        self.anthropic = anthropic.AsyncAnthropic(base_url=url, api_key="bench", max_retries=0, timeout=600)

    async def chat(self, question: str, max_tokens: int, arrivals: list[float]) -> int:
        tokens = 0
        stream = await self.openai.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    async def responses(self, question: str, max_tokens: int, arrivals: list[float]) -> int:
        tokens = 0
        stream = await self.openai.responses.create(
            model=MODEL_NAME, input=question, max_output_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        async for event in stream:
            if event.type == "response.output_text.delta" and event.delta:
                arrivals.append(time.perf_counter())
            elif event.type in ("response.completed", "response.incomplete") and event.response.usage:
                tokens = event.response.usage.output_tokens
        return tokens

    async def messages(self, question: str, max_tokens: int, arrivals: list[float]) -> int:
        tokens = 0
        stream = await self.anthropic.messages.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            stream=True, extra_body={"temperature": 0, "ignore_eos": True})
        async for event in stream:
            if event.type == "content_block_delta" and getattr(event.delta, "text", ""):
                arrivals.append(time.perf_counter())
            elif event.type == "message_delta":
                tokens = event.usage.output_tokens
        return tokens

    async def close(self) -> None:
        await self.openai.close()
        await self.anthropic.close()


async def _one(clients: Clients, api: str, question: str, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = await getattr(clients, api)(question, max_tokens, arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"ttft": arrivals[0] - start if arrivals else float("nan"), "gaps": gaps, "tokens": tokens}


async def _drive(url: str, api: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    clients = Clients(url)
    queue = [QUESTIONS[i % len(QUESTIONS)] for i in range(requests)]
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        while queue:
            results.append(await _one(clients, api, queue.pop(), max_tokens))

    await asyncio.gather(*(_one(clients, api, q, 16) for q in QUESTIONS[:2]))  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    await clients.close()
    return {
        "requests": len(results),
        "output_tokens": sum(r["tokens"] for r in results),
        "output_tok_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
    }


# Each API's rows are keyed `API/cN`: chat completions, the Responses API, Anthropic's Messages API.
APIS = ("chat", "responses", "messages")


def _model_dir() -> str:
    sys.path.insert(0, str(ROOT))
    from taco_llm.engine_worker.frontend.default_model import ensure_default_model

    return str(ensure_default_model())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--apis", nargs="+", choices=list(APIS), default=list(APIS),
                        help="which APIs to drive, each streamed (default: all)")
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
                f"{api}/c{c}": asyncio.run(_drive(url, api, c, args.requests, args.max_tokens))
                for api in args.apis for c in args.concurrency
            }
            print(name, json.dumps(report["results"][name], indent=1), flush=True)
        finally:
            stop(process)
            log.close()
    ours, theirs = report["results"]["taco_llm"], report["results"]["vllm"]
    report["ratios"] = {
        level: {
            "throughput_ratio": ours[level]["output_tok_per_s"] / theirs[level]["output_tok_per_s"],
            "ttft_p50_ratio": ours[level]["ttft_p50_ms"] / theirs[level]["ttft_p50_ms"],
            "ttft_p50_delta_ms": ours[level]["ttft_p50_ms"] - theirs[level]["ttft_p50_ms"],
            "itl_p50_delta_ms": ours[level]["itl_p50_ms"] - theirs[level]["itl_p50_ms"],
        }
        for level in ours
    }
    write_report(args.out, report, report["ratios"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
