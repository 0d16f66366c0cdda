"""Sustained load on the suite's shared `stack`: 64 concurrent streaming clients (the openai SDK) for a
fixed number of short replies. Zero errors; afterwards every process of the stack (serve, the gateway,
the worker, vLLM's engine core) is within 10% of its warm resident memory and a few file descriptors
of its warm count, and the gateway holds no more connections to the worker than when warm. Warm: after
a warm-up round of the same shape. bench/soak.py runs the same load for longer and reports latency.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from .support import Stack
from .test_faults_e2e import MODEL, assert_back_to, idle, levels, wait_for

pytestmark = pytest.mark.e2e

CONCURRENCY = 64
WARM_UP_REQUESTS = 64
REQUESTS = 128  # two rounds of 64
MAX_TOKENS = 16


async def soak(base_url: str, requests: int) -> list[str]:
    """`requests` streamed chats, CONCURRENCY at a time; the errors, as text (none expected)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(CONCURRENCY)
    errors: list[str] = []

    async def one(i: int) -> None:
        async with gate:
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Write a line about the number {i}."}],
                    max_tokens=MAX_TOKENS, temperature=0.7, seed=i, stream=True,
                    stream_options={"include_usage": True})
                tokens = 0
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                if not 0 < tokens <= MAX_TOKENS:
                    errors.append(f"request {i}: {tokens} completion tokens")
            except openai.OpenAIError as error:
                errors.append(f"request {i}: {error!r}")

    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        await client.close()
    return errors


def test_64_concurrent_streams_soak_without_errors_or_growth(stack: Stack) -> None:
    assert asyncio.run(soak(stack.base_url, WARM_UP_REQUESTS)) == []
    wait_for(lambda: idle(stack.grpc_address), "the warm-up to end in the engine")
    time.sleep(1.0)
    warm = levels(stack)
    errors = asyncio.run(soak(stack.base_url, REQUESTS))
    assert errors == [], f"{len(errors)} of {REQUESTS} requests failed: {errors[:5]}"
    wait_for(lambda: idle(stack.grpc_address), "the soak's requests to end in the engine")
    time.sleep(1.0)
    assert_back_to(warm, levels(stack))
