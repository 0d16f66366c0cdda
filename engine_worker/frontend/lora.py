"""LoRA adapters served by name (--lora-modules): each name is a model a request may ask for."""

from __future__ import annotations

import json
from pathlib import Path

from vllm.lora.request import LoRARequest

from taco_llm.protos import engine_pb2

from ..vllm_internals import LoRAModulePath


class LoraProblem(ValueError):
    """An adapter folder vLLM could not load."""


def check_adapter(path: Path, max_lora_rank: int | None) -> None:
    """Checks what vLLM would otherwise only find on the first request for the adapter."""
    if not path.is_dir():
        raise LoraProblem(f"{path} is not a folder" if path.exists() else f"{path} does not exist")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoraProblem(f"{path} has no adapter_config.json (not a PEFT LoRA adapter)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as error:
        raise LoraProblem(f"{config_file} is not valid JSON: {error}") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or rank < 1:
        raise LoraProblem(f"{config_file} has no LoRA rank 'r'")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise LoraProblem(f"the adapter's rank is {rank}, above --max-lora-rank {max_lora_rank}")
    if not any((path / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise LoraProblem(f"{path} has no adapter_model.safetensors or adapter_model.bin")


class LoraRegistry:
    """The adapters by model name, as vLLM LoRARequests (ids from 1: vLLM reserves 0 for 'none')."""

    def __init__(self, modules: list[LoRAModulePath], base_model_name: str):
        self.requests: dict[str, LoRARequest] = {}
        self.adapters: list[engine_pb2.LoraAdapter] = []
        for lora_id, module in enumerate(modules, start=1):
            self.requests[module.name] = LoRARequest(module.name, lora_id, str(Path(module.path).resolve()))
            self.adapters.append(engine_pb2.LoraAdapter(
                name=module.name, path=module.path, base_model_name=module.base_model_name or base_model_name,
            ))

    @property
    def names(self) -> list[str]:
        return list(self.requests)

    def get(self, model: str) -> LoRARequest | None:
        return self.requests.get(model)
