"""Greedy output through gateway → gRPC → worker equals vLLM's own offline LLM, token for token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> dict[str, list[list[int]]]:
    job = {"model": str(model_dir), "prompts": PROMPTS, "chats": CHATS, "max_tokens": MAX_TOKENS}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_generate.py"))],
                         input=json.dumps(job), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))  # type: ignore[no-any-return]


def test_completions_match_offline(client: openai.OpenAI, offline: dict[str, list[list[int]]]) -> None:
    for prompt, expected in zip(PROMPTS, offline["completions"], strict=True):
        reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                          extra_body={"return_token_ids": True})
        assert reply.choices[0].model_extra["token_ids"] == expected, prompt


def test_chats_match_offline(client: openai.OpenAI, offline: dict[str, list[list[int]]]) -> None:
    for messages, expected in zip(CHATS, offline["chats"], strict=True):
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                               extra_body={"return_token_ids": True})
        assert reply.choices[0].model_extra["token_ids"] == expected, messages
