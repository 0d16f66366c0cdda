"""Session fixtures: each engine configuration starts once and is shared by every test that needs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from protos import engine_pb2_grpc

from .support import Stack, start_stack

# float32: greedy output is then the same whatever the batch shape (bf16 rounding differs by shape).
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
                "--kv-cache-memory-bytes", "1G", "--seed", "0"]


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from engine_worker.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    """`taco_llm serve` on the default model, shared by all end-to-end tests."""
    running = start_stack("serve", ENGINE_FLAGS, log_dir)
    yield running
    code = running.process.stop()
    assert code == 0, f"taco_llm serve exited with {code} on SIGTERM:\n{running.process.tail()}"


@pytest.fixture(scope="session")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def async_client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def engine(stack: Stack) -> Iterator[engine_pb2_grpc.EngineStub]:
    """A gRPC stub straight to the worker, bypassing the gateway (a fresh channel per test)."""
    channel = grpc.insecure_channel(stack.grpc_address)
    yield engine_pb2_grpc.EngineStub(channel)
    channel.close()
