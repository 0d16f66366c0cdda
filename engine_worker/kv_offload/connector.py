"""Auto Prefix Cache CPU Offload as a vLLM V1 KV connector, backed by the cache service.

vLLM loads this class by path (kv_transfer_config.kv_connector_module_path), once in the scheduler
role and once per model worker; nothing in vLLM is patched.

Scheduler role: a new request's full prompt blocks get chain keys (hashing.py). On a miss in vLLM's
own prefix cache, one Lookup (tight deadline; any failure counts as 0) says how many leading blocks
the service holds; the ones beyond the local hit are loaded instead of computed. Each step's
metadata lists the blocks to load and the full prompt blocks to save: those computed this step, and
local hits the service lacks (so a restarted service, or a raised access count, refills it).

Worker role: loads stream in segment-major order (segment = layer), so layer 0 of every block lands
first and the forward pass waits per layer ("lazy", the default), or for all of it before the pass
with --apc-offload-not-lazy. Saves copy the blocks out of the KV cache after the pass (a memcpy)
and a background thread sends them. A failed or corrupt load reports its blocks to vLLM, which
throws that step's output away and recomputes them (kv_load_failure_policy "recompute").
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .client import BlockPayload, KVBlockClient
from .hashing import chain_keys, engine_salt, rank_key, request_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("taco_llm.kv_offload")


def _ensure_logging() -> None:
    """vLLM's engine-core process configures only vLLM's own loggers; give ours a handler there too."""
    parent = logging.getLogger("taco_llm")
    if not parent.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        parent.addHandler(handler)
        parent.setLevel(logging.INFO)

DEFAULT_LOOKUP_TIMEOUT = 0.25  # seconds the scheduler waits for a Lookup before recomputing
LOAD_TIMEOUT_SECONDS = 30.0   # base deadline of one step's GetBlocks
LOAD_SECONDS_PER_GIB = 10.0   # plus this much per GiB loaded (far below what the service delivers)
SAVE_TIMEOUT_SECONDS = 30.0
# Blocks copied out for saving but not yet sent are capped; beyond it new saves are dropped (they
# are only a future cache miss), so a slow service cannot grow the worker's memory.
MAX_PENDING_SAVE_BYTES = 512 * 1024**2


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
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
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
        self._client = KVBlockClient(address, float(settings.get("lookup_timeout", DEFAULT_LOOKUP_TIMEOUT)))
        # Scheduler role.
        self._requests: dict[str, _RequestState] = {}
        # Worker role.
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._block_dim = 0
        self._load: _LayerwiseLoad | None = None
        self._failed_block_ids: set[int] = set()
        self._sender: _Sender | None = None
        if role == KVConnectorRole.WORKER:
            self._sender = _Sender(self._client)
        logger.info("prefix-KV offload: %s role, cache service %s, %s loading", role.name.lower(), address,
                    "lazy (layer by layer)" if self._lazy else "not lazy (before the forward pass)")

    # ---------------------------------------------------------------- scheduler role

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
        num_blocks = self._kv_cache_config.num_blocks
        self._layers = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        dims = [d for d, size in enumerate(self._layers[0].shape) if size == num_blocks]
        if not dims or any(t.shape != self._layers[0].shape for t in self._layers):
            raise ValueError(f"prefix-KV offload: cannot find the block dimension of KV caches shaped "
                             f"{tuple(self._layers[0].shape)} with {num_blocks} blocks")
        self._block_dim = dims[0]
        logger.info("prefix-KV offload: %d layers of KV shaped %s (blocks on dim %d), %d bytes per block",
                    len(self._layers), tuple(self._layers[0].shape), self._block_dim, self._block_bytes())

    def _segment_bytes(self) -> int:
        layer = self._layers[0]
        return layer.select(self._block_dim, 0).numel() * layer.element_size()

    def _block_bytes(self) -> int:
        return self._segment_bytes() * len(self._layers)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        if not meta.loads or not self._layers:
            return
        keys = [rank_key(k, self._tp_rank) for spec in meta.loads for k in spec.keys]
        block_ids = [b for spec in meta.loads for b in spec.block_ids]
        self._load = _LayerwiseLoad(self, keys, block_ids)
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
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        if not meta.saves or not self._layers or self._sender is None:
            return
        keys = [rank_key(k, self._tp_rank) for spec in meta.saves for k in spec.keys]
        parents = [rank_key(k, self._tp_rank) if k else b"" for spec in meta.saves for k in spec.parent_keys]
        ids = torch.tensor([b for spec in meta.saves for b in spec.block_ids], dtype=torch.long)
        # One gather per layer, blocks first: row b of layer l is segment l of block b.
        per_layer = [layer.index_select(self._block_dim, ids).movedim(self._block_dim, 0).contiguous()
                     for layer in self._layers]
        stacked = torch.stack(per_layer, dim=1).reshape(len(keys), -1).view(torch.uint8)
        payloads = [BlockPayload(key, parent, stacked[i].numpy().tobytes(), len(self._layers))
                    for i, (key, parent) in enumerate(zip(keys, parents, strict=True))]
        self._sender.submit(payloads)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.stop()
        self._client.close()

    # Used by _LayerwiseLoad, on its thread.
    def _write_segment(self, layer_index: int, block_ids: Sequence[int], buffers: Sequence[bytearray]) -> None:
        layer = self._layers[layer_index]
        seg = self._segment_bytes()
        shape = layer.select(self._block_dim, 0).shape
        for block_id, buffer in zip(block_ids, buffers, strict=True):
            source = torch.frombuffer(buffer, dtype=torch.uint8, count=seg, offset=layer_index * seg)
            layer.select(self._block_dim, block_id).copy_(source.view(layer.dtype).view(shape))


class _LayerwiseLoad:
    """One step's GetBlocks, written into the KV cache layer by layer as the bytes arrive."""

    def __init__(self, connector: TacoOffloadConnector, keys: list[bytes], block_ids: list[int]):
        self.connector = connector
        self.keys = keys
        self.block_ids = block_ids
        self.num_layers = len(connector._layers)
        self.events = [threading.Event() for _ in range(self.num_layers)]
        self.ok = False
        size = connector._block_bytes() * len(keys)
        self.timeout = LOAD_TIMEOUT_SECONDS + LOAD_SECONDS_PER_GIB * size / 1024**3
        self.thread = threading.Thread(target=self._run, name="kv-offload-load", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wait_layer(self, index: int) -> None:
        self.events[index].wait(self.timeout)

    def join(self) -> bool:
        self.thread.join(self.timeout)
        return self.ok and not self.thread.is_alive()

    def _run(self) -> None:
        client = self.connector._client
        try:
            self.ok = self._receive()
            client.backoff.succeeded()
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:  # evicted since the Lookup: the service is fine
                logger.warning("prefix-KV offload: %s; recomputing %d blocks", error.details(), len(self.keys))
            else:  # a load in flight always gets its line: it is a request's blocks being recomputed
                logger.warning("prefix-KV offload: loading %d blocks failed (%s); recomputing them",
                               len(self.keys), error.code().name)
                client.backoff.failed("GetBlocks", error, logged=True)
        except Exception as error:  # any other fault: the blocks are recomputed, never a failed request
            logger.warning("prefix-KV offload: loading %d blocks failed (%s); recomputing them",
                           len(self.keys), error)
        finally:
            for event in self.events:
                event.set()

    def _receive(self) -> bool:
        connector = self.connector
        seg = connector._segment_bytes()
        block_bytes = seg * self.num_layers
        stream = connector._client.get_stream(self.keys, self.timeout)
        first = next(stream)
        if len(first.headers) != len(self.keys) or any(
                h.size != block_bytes or h.num_segments != self.num_layers for h in first.headers):
            raise ValueError("a block's size or segment count does not match this engine's KV layout")
        buffers = [bytearray(block_bytes) for _ in self.keys]
        per_segment = seg * len(self.keys)
        received = 0
        done_layers = 0
        for chunk in stream:
            end = chunk.offset + len(chunk.data)
            if chunk.block_index >= len(buffers) or end > block_bytes:
                raise ValueError("a chunk lies outside its block")
            buffers[chunk.block_index][chunk.offset:end] = chunk.data
            received += len(chunk.data)
            while done_layers < self.num_layers and received >= (done_layers + 1) * per_segment:
                connector._write_segment(done_layers, self.block_ids, buffers)
                self.events[done_layers].set()
                done_layers += 1
        if received != per_segment * self.num_layers:
            raise ValueError(f"the stream ended after {received} of {per_segment * self.num_layers} bytes")
        for header, buffer in zip(first.headers, buffers, strict=True):
            if zlib.crc32(buffer) != header.checksum:
                raise ValueError(f"block {header.key.hex()[:16]}... failed its checksum")
        return True


class _Sender:
    """Sends saved blocks to the service on its own thread, off the engine's critical path."""

    def __init__(self, client: KVBlockClient):
        self.client = client
        self.queue: queue.Queue[list[BlockPayload] | None] = queue.Queue()
        self.pending_bytes = 0
        self.lock = threading.Lock()
        self.dropped_logged = False
        self.thread = threading.Thread(target=self._run, name="kv-offload-save", daemon=True)
        self.thread.start()

    def submit(self, payloads: list[BlockPayload]) -> None:
        size = sum(len(p.data) for p in payloads)
        with self.lock:
            if self.pending_bytes + size > MAX_PENDING_SAVE_BYTES or not self.client.backoff.ready():
                if not self.dropped_logged:
                    logger.warning("prefix-KV offload: the cache service is behind or down; dropping saves "
                                   "(those blocks will be recomputed when needed)")
                    self.dropped_logged = True
                return
            self.pending_bytes += size
        self.queue.put(payloads)

    def _run(self) -> None:
        while True:
            payloads = self.queue.get()
            if payloads is None:
                return
            try:
                if self.client.put(payloads, SAVE_TIMEOUT_SECONDS) is not None:
                    self.dropped_logged = False
            finally:
                with self.lock:
                    self.pending_bytes -= sum(len(p.data) for p in payloads)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(5.0)


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

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
