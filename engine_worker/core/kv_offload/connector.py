"""Auto Prefix Cache CPU Offload as a vLLM V1 KV connector, backed by the cache service.

vLLM loads this class by path (kv_transfer_config.kv_connector_module_path), once in the scheduler
role and once per model worker; nothing in vLLM is patched.

Scheduler role: a new request's full prompt blocks get chain keys (hashing.py). On a miss in vLLM's
own prefix cache, one Lookup (tight deadline; any failure counts as 0) says how many leading blocks
the service holds; the ones beyond the local hit are loaded instead of computed. Each step's
metadata lists the blocks to load and the full prompt blocks to save: those computed this step, and
local hits the service lacks (so a restarted service, or a raised access count, refills it).

Worker role (transfer.py): loads arrive in segment-major order (segment = layer), so layer 0 of
every block lands first and the forward pass waits per layer ("lazy", the default), or for all of it
before the pass with --apc-offload-not-lazy. Saves copy the blocks out of the KV cache after the pass
(one gather per layer, straight into a shared-memory ring or a private buffer) and a background
thread sends them. A failed or corrupt load reports its blocks to vLLM, which throws that step's
output away and recomputes them (kv_load_failure_policy "recompute").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from taco_llm.protos.kv_cache_limits import SHM_DIR

from ...handoff import DEFAULT_LOOKUP_TIMEOUT
from ...vllm_internals import CacheHitSource, connector_metadata
from .client import BlockPayload, KVBlockClient
from .hashing import chain_keys, engine_salt, rank_key, request_salt
from .transfer import KVLayout, LayerwiseLoad, SaveBatch, Sender, byte_view

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ...vllm_internals import (
        AttentionMetadata,
        ForwardContext,
        KVCacheBlocks,
        KVCacheConfig,
        Request,
        SchedulerOutput,
    )

logger = logging.getLogger("taco_llm.kv_offload")


def _ensure_logging() -> None:
    """vLLM's engine-core process configures only vLLM's own loggers; give ours a handler there too."""
    parent = logging.getLogger("taco_llm")
    if not parent.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        parent.addHandler(handler)
        parent.setLevel(logging.INFO)


@dataclass
class LoadSpec:
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class SaveSpec:
    keys: list[bytes]
    parent_keys: list[bytes]
    block_ids: list[int]


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _RequestState:
    """The scheduler's view of one request."""

    keys: list[bytes]       # chain keys of the full prompt blocks
    held: int               # leading blocks the service said it holds
    load_start: int = 0     # first block loaded from the service
    load_count: int = 0
    load_pending: bool = False
    saved_upto: int = 0     # blocks [0, saved_upto) are held by the service or already sent
    block_ids: list[int] = field(default_factory=list)


def _settings(vllm_config: VllmConfig) -> dict[str, Any]:
    config = vllm_config.kv_transfer_config
    return dict(config.kv_connector_extra_config) if config is not None else {}


class TacoOffloadConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._kv_config = kv_cache_config
        _ensure_logging()
        settings = _settings(vllm_config)
        address = settings.get("cache_service")
        if not address:
            raise ValueError("TacoOffloadConnector needs kv_connector_extra_config.cache_service (HOST:PORT)")
        self._block_size = vllm_config.cache_config.block_size
        self._lazy = bool(settings.get("lazy", True))
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._tp_rank = _tensor_parallel_rank() if role == KVConnectorRole.WORKER else 0
        self._engine_salt = engine_salt(_salt_factors(vllm_config, kv_cache_config))
        transport = str(settings.get("transport", "auto"))
        self._client = KVBlockClient(address, float(settings.get("lookup_timeout", DEFAULT_LOOKUP_TIMEOUT)),
                                     transport, shm_dir=str(settings.get("shm_dir", SHM_DIR)))
        # Scheduler role.
        self._requests: dict[str, _RequestState] = {}
        # Worker role.
        self._layout: KVLayout | None = None
        self._layer_index: dict[str, int] = {}
        self._load: LayerwiseLoad | None = None
        self._failed_block_ids: set[int] = set()
        self._sender: Sender | None = None  # made with the KV caches (register_kv_caches): it copies out of them
        logger.info("prefix-KV offload: %s role, cache service %s, %s loading, transport %s", role.name.lower(),
                    address, "lazy (layer by layer)" if self._lazy else "not lazy (before the forward pass)",
                    "auto (shared memory when the service can reach it)" if transport == "auto" else transport)

    # ---------------------------------------------------------------- scheduler role

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        # Every token this connector supplies comes from host memory (vLLM's cache-hit metrics by tier).
        return {CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._new_state(request)
            self._requests[request.request_id] = state
        local = num_computed_tokens // self._block_size
        # At least one prompt token must be computed, to sample from.
        loadable = min(state.held, (request.num_prompt_tokens - 1) // self._block_size)
        state.load_start, state.load_count = local, max(0, loadable - local)
        state.load_pending = False
        return state.load_count * self._block_size, False

    def _new_state(self, request: Request) -> _RequestState:
        if request.prompt_token_ids is None or request.mm_features:
            return _RequestState(keys=[], held=0)  # prompt embeddings or media: not addressed by tokens
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        seed = request_salt(self._engine_salt, lora, request.cache_salt)
        keys = chain_keys(seed, request.prompt_token_ids, self._block_size)
        # One Lookup per request, over the whole chain: it counts one use of every block (the access
        # threshold) and refreshes the held ones, even those vLLM's own cache will serve.
        held = self._client.lookup(keys)
        return _RequestState(keys=keys, held=held, saved_upto=held)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None and num_external_tokens > 0:
            state.load_pending = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OffloadMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.load_pending:
                end = state.load_start + state.load_count
                meta.loads.append(LoadSpec(state.keys[state.load_start:end], state.block_ids[state.load_start:end]))
                state.load_pending = False
            self._plan_save(state, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            if state.load_pending:  # resumed after preemption, with blocks to load again
                end = state.load_start + state.load_count
                meta.loads.append(LoadSpec(state.keys[state.load_start:end], state.block_ids[state.load_start:end]))
                state.load_pending = False
            self._plan_save(state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        return meta

    def _plan_save(self, state: _RequestState, computed_after_step: int, meta: OffloadMetadata) -> None:
        full = min(len(state.keys), computed_after_step // self._block_size, len(state.block_ids))
        if full <= state.saved_upto:
            return
        first = state.saved_upto
        parents = [state.keys[i - 1] if i > 0 else b"" for i in range(first, full)]
        meta.saves.append(SaveSpec(state.keys[first:full], parents, state.block_ids[first:full]))
        state.saved_upto = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves were copied out of the KV cache during the step that computed them: nothing holds
        # the blocks now.
        self._requests.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_config.num_blocks
        layers = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        dims = [d for d, size in enumerate(layers[0].shape) if size == num_blocks]
        if not dims or any(t.shape != layers[0].shape or t.dtype != layers[0].dtype for t in layers):
            raise ValueError(f"prefix-KV offload: cannot find the block dimension of KV caches shaped "
                             f"{tuple(layers[0].shape)} with {num_blocks} blocks")
        self._layout = KVLayout(layers, dims[0])
        if self._sender is None:
            self._sender = Sender(self._client, copier=self._layout.copier)
        logger.info("prefix-KV offload: %d layers of KV shaped %s (blocks on dim %d), %d bytes per block",
                    len(layers), tuple(layers[0].shape), dims[0], self._layout.block_bytes)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = connector_metadata(self)
        assert isinstance(meta, OffloadMetadata)
        if not meta.loads or self._layout is None:
            return
        keys = [rank_key(k, self._tp_rank) for spec in meta.loads for k in spec.keys]
        block_ids = [b for spec in meta.loads for b in spec.block_ids]
        self._load = LayerwiseLoad(self._layout, self._client, keys, block_ids)
        self._load.start()
        if not self._lazy:
            self._finish_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load is not None:
            index = self._layer_index.get(layer_name)
            if index is not None:
                self._load.wait_layer(index)

    def _finish_load(self) -> None:
        load, self._load = self._load, None
        if load is not None and not load.join():
            self._failed_block_ids.update(load.block_ids)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # blocks are copied whole, after the pass (wait_for_save)

    def wait_for_save(self) -> None:
        self._finish_load()
        meta = connector_metadata(self)
        assert isinstance(meta, OffloadMetadata)
        layout = self._layout
        if not meta.saves or layout is None or self._sender is None:
            return
        keys = [rank_key(k, self._tp_rank) for spec in meta.saves for k in spec.keys]
        parents = [rank_key(k, self._tp_rank) if k else b"" for spec in meta.saves for k in spec.parent_keys]
        block_ids = [b for spec in meta.saves for b in spec.block_ids]
        block_bytes = layout.block_bytes
        room = self._sender.reserve(block_bytes * len(keys))
        if room is None:
            return
        buffer, ring, start = room
        # The one copy on the critical path (the blocks may be reused after this step): straight from the
        # KV cache into the bytes the service will read; on a CUDA device a gather in the compute stream's
        # order, and the device-to-host copy on the side stream, which the sender thread waits for.
        copied = layout.save(block_ids, buffer.view(len(keys), layout.num_layers, layout.segment_bytes))
        view = byte_view(buffer)
        payloads = [BlockPayload(key, parent, view[i * block_bytes:(i + 1) * block_bytes], layout.num_layers,
                                 None if ring is None else start + i * block_bytes)
                    for i, (key, parent) in enumerate(zip(keys, parents, strict=True))]
        self._sender.submit(SaveBatch(payloads, len(buffer), ring, start, copied))

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.stop()
        if self._layout is not None:
            self._layout.copier.synchronize()  # nothing may still copy through the load window it unmaps
        self._client.close()


def _tensor_parallel_rank() -> int:
    from ...vllm_internals import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError):  # the parallel groups are not set up (single process)
        return 0


def _salt_factors(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> dict[str, Any]:
    model = vllm_config.model_config
    from vllm.platforms import current_platform

    return {
        "model": model.model,
        "revision": model.revision,
        "dtype": str(model.dtype),
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype,
        "block_size": vllm_config.cache_config.block_size,
        "kv_cache_groups": [repr(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups],
        "num_layers": sum(len(group.layer_names) for group in kv_cache_config.kv_cache_groups),
        "kv_cache_layout": kv_cache_config.kv_cache_layout,
        "platform": current_platform.device_name,
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "pipeline_parallel_size": vllm_config.parallel_config.pipeline_parallel_size,
    }
