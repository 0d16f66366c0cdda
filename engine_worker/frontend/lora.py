"""LoRA adapters served by name (--lora-modules, and LoadLoraAdapter at runtime): each name is a model a
request may ask for."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from taco_llm.protos import engine_pb2
from taco_llm.protos.rich_status import Reason

from ..vllm_internals import LoRAModulePath, runtime_lora_updating_allowed


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
    """The adapters by model name, as vLLM LoRARequests. Ids start at 1 (vLLM reserves 0 for 'none') and are
    never given twice, not even after an unload: vLLM caches an adapter's weights by id, so a reused id
    could serve the weights of the adapter that had it before."""

    def __init__(self, modules: list[LoRAModulePath], base_model_name: str):
        self.base_model_name = base_model_name
        self.requests: dict[str, LoRARequest] = {}
        self._adapters: dict[str, engine_pb2.LoraAdapter] = {}
        self._next_id = 1
        for module in modules:
            self.add(module.name, module.path, base_model_name=module.base_model_name or base_model_name)

    def add(self, name: str, path: str, *, base_model_name: str | None = None,
            at_runtime: bool = False) -> LoRARequest:
        """Registers (or replaces) the adapter `name`; the caller loads it into the engine."""
        request = LoRARequest(name, self._next_id, str(Path(path).resolve()))
        self._next_id += 1
        self.requests[name] = request
        self._adapters[name] = engine_pb2.LoraAdapter(
            name=name, path=path, base_model_name=base_model_name or self.base_model_name,
            loaded_at_runtime=at_runtime)
        return request

    def entry(self, name: str) -> tuple[LoRARequest, engine_pb2.LoraAdapter] | None:
        """What `restore` takes back: the adapter's request and description, or None."""
        request = self.requests.get(name)
        return None if request is None else (request, self._adapters[name])

    def restore(self, name: str, entry: tuple[LoRARequest, engine_pb2.LoraAdapter] | None) -> None:
        """Puts back what `entry` read before a replacement that failed (None: there was nothing)."""
        self.remove(name)
        if entry is not None:
            self.requests[name], self._adapters[name] = entry

    def remove(self, name: str) -> LoRARequest | None:
        self._adapters.pop(name, None)
        return self.requests.pop(name, None)

    @property
    def adapters(self) -> list[engine_pb2.LoraAdapter]:
        return list(self._adapters.values())

    @property
    def names(self) -> list[str]:
        return list(self.requests)

    def get(self, model: str) -> LoRARequest | None:
        return self.requests.get(model)

    def path_of(self, name: str) -> str | None:
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.path


class LoraRefusal(Exception):
    """A LoadLoraAdapter or UnloadLoraAdapter call refused: its gRPC code, reason and field."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: int, field: str):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.field = field


class RuntimeAdapters:
    """Adapters loaded and unloaded while the worker runs (vLLM's /v1/load_lora_adapter and
    /v1/unload_lora_adapter, here as Engine rpcs), under the same conditions as in vLLM: --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING. An adapter is loaded into the engine before the call answers, so
    a bad folder is refused here, not on the first request that names it."""

    def __init__(self, engine: AsyncLLM, registry: LoraRegistry, loaded: set[str], base_names: list[str]):
        self.engine = engine
        self.registry = registry
        # The adapters the engine holds (the service loads --lora-modules ones on their first request).
        self.loaded = loaded
        self.base_names = base_names
        lora_config = engine.vllm_config.lora_config
        self.max_lora_rank = None if lora_config is None else lora_config.max_lora_rank
        self.why_off = ("this worker runs without --enable-lora" if lora_config is None else
                        "this worker runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment"
                        if not runtime_lora_updating_allowed() else None)

    async def load(self, name: str, path: str, *, inplace: bool) -> bool:
        """Loads `name` from `path`; False where it was loaded from that path already."""
        self._check_on()
        if not name:
            raise LoraRefusal(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is required", Reason.FIELD_REQUIRED,
                              "lora_name")
        if not path:
            raise LoraRefusal(grpc.StatusCode.INVALID_ARGUMENT, "lora_path is required", Reason.FIELD_REQUIRED,
                              "lora_path")
        if name in self.base_names:
            raise LoraRefusal(grpc.StatusCode.ALREADY_EXISTS, f"`{name}` is the base model's name",
                              Reason.FIELD_INVALID, "lora_name")
        known = self.registry.path_of(name)
        if known is not None and not inplace:
            if Path(known).resolve() == Path(path).resolve():
                return False
            raise LoraRefusal(grpc.StatusCode.ALREADY_EXISTS, f"the LoRA adapter `{name}` is loaded from {known}; "
                              "unload it first, or load with load_inplace", Reason.FIELD_INVALID, "lora_name")
        try:
            check_adapter(Path(path), self.max_lora_rank)
        except LoraProblem as problem:
            raise LoraRefusal(grpc.StatusCode.INVALID_ARGUMENT, str(problem), Reason.LORA_LOAD_FAILED,
                              "lora_path") from None
        previous = self.registry.entry(name)
        request = self.registry.add(name, path, at_runtime=True)
        try:
            await self.engine.add_lora(request)
        except EngineDeadError:
            raise
        except Exception as error:
            self.registry.restore(name, previous)  # an adapter replaced in place keeps serving as it was
            raise LoraRefusal(grpc.StatusCode.INVALID_ARGUMENT, f"the LoRA adapter `{name}` ({path}) failed to "
                              f"load: {error}", Reason.LORA_LOAD_FAILED, "lora_path") from None
        if previous is not None and name in self.loaded:
            await self.engine.remove_lora(previous[0].lora_int_id)
        self.loaded.add(name)
        return True

    async def unload(self, name: str) -> None:
        self._check_on()
        request = self.registry.remove(name)
        if request is None:
            raise LoraRefusal(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter `{name}` is loaded on this worker",
                              Reason.MODEL_NOT_FOUND, "lora_name")
        if name in self.loaded:
            self.loaded.discard(name)
            await self.engine.remove_lora(request.lora_int_id)

    def _check_on(self) -> None:
        if self.why_off is not None:
            raise LoraRefusal(grpc.StatusCode.FAILED_PRECONDITION, f"LoRA adapters cannot be loaded or unloaded "
                              f"at runtime: {self.why_off}", Reason.RUNTIME_LORA_OFF, "lora_name")
