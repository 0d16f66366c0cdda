"""Session fixtures: each engine configuration starts once and is shared by every test that needs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from taco_llm.protos import engine_pb2_grpc

from .support import RedisServer, Stack, free_port, start_stack


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The compose group runs first: its containers (several engines) are gone before the session's own
    engines start, so the two never share this machine's memory and cores."""
    items.sort(key=lambda item: item.get_closest_marker("compose") is None)


# float32: greedy output is then the same whatever the batch shape (bf16 rounding differs by shape).
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
                "--kv-cache-memory-bytes", "1G", "--seed", "0"]


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from taco_llm.engine_worker.frontend.default_model import ensure_default_model

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


# Tool calling, LoRA and a server-wide chat template share one more engine: a worker with all of them.
LORA_NAME = "tiny-lora"
# Passes the start-up checks (a PEFT config, a weights file) but its weights are not safetensors.
BROKEN_LORA_NAME = "broken-lora"
TEMPLATE_MARKER = "[taco-template]"
# Visibly not the model's own template (the marker), and it shows the tools to the model, Hermes style.
FRONTEND_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions, each as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>:\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n" + TEMPLATE_MARKER
    + " {{ m.content or '' }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def build_tiny_lora(model_dir: Path, out: Path) -> Path:
    """A rank-8 LoRA adapter for the default model, made with peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # init_lora_weights=False: B is random, not zero as in training, so the adapter changes the output.
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def frontend_stack(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("frontend")
    adapter = build_tiny_lora(model_dir, work / LORA_NAME)
    broken = work / BROKEN_LORA_NAME
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"these are not tensors")
    template = work / "template.jinja"
    template.write_text(FRONTEND_TEMPLATE)
    running = start_stack("serve-frontend", [
        *ENGINE_FLAGS, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
        "--lora-modules", f"{LORA_NAME}={adapter}", f"{BROKEN_LORA_NAME}={broken}",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--chat-template", str(template), "--trust-request-chat-template",
    ], log_dir)
    yield running
    code = running.process.stop()
    assert code == 0, f"taco_llm serve exited with {code} on SIGTERM:\n{running.process.tail()}"


@pytest.fixture(scope="session")
def frontend_client(frontend_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of the module's own, on a free port, without persistence (a module that restarts
    its Redis and wants the data back defines its own)."""
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"), persist=False)
    server.start()
    yield server
    server.stop()
