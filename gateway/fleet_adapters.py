"""LoRA adapters loaded at runtime, across the fleet: /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's routes) load or unload an adapter on every ready worker of its base model, and the fleet's
adapters are kept in a book (the registry's Redis, where every gateway replica reads the same; else
this gateway's memory) that a reconciling loop holds the workers to:
- a worker that joins (or restarts, coming back with its --lora-modules alone) is given the book's
  adapters; until its ModelInfo lists one, routing sends that adapter's requests elsewhere (routing
  reads each worker's served model names), so it takes no adapter traffic before it holds the adapter;
- an adapter unloaded through another replica is unloaded here too, and one loaded there is seen here
  (each pass that finds the book changed re-reads the workers' ModelInfo, and every fifth pass does
  anyway, which also finds a worker that lost an adapter behind the gateways' backs).

The loop unloads only what left the book (through any replica) in the last RETIRED_SECONDS: adapters a
worker was started with (--lora-modules), and ones a gRPC client loaded on a worker directly, are not
the fleet's to take (an unload request through the gateway does take them, as in vLLM).

The book is written before the workers load, so that a replica's loop never takes a half-loaded adapter
for a stray one and unloads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, TypeVar

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from taco_llm.protos import engine_pb2

from .engine_pool import EngineClient, EnginePool
from .errors import APIError, bad_request, from_grpc
from .failover import CLIENT_FAULT_CODES

logger = logging.getLogger(__name__)
T = TypeVar("T")

BOOK_KEY = "taco_llm:lora-adapters"
RECONCILE_SECONDS = 1.0
# Every this many passes the workers' ModelInfo is read again even where nothing seemed to change: a
# worker's adapters can change behind the gateways' backs (a gRPC client's unload), and a stale view
# would never be corrected.
FULL_REREAD_PASSES = 5
# How long a name that left the book is still unloaded from a worker found holding it (one that was
# unreachable when it left, say).
RETIRED_SECONDS = 600.0
# A load reads the adapter's weights from disk into the engine: seconds for a large one.
LOAD_DEADLINE_SECONDS = 120.0
CALL_DEADLINE_SECONDS = 10.0


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    # The base model it adapts; "" for the fleet's only one.
    base_model_name: str = ""


class AdapterBook(Protocol):
    async def all(self) -> dict[str, Adapter]: ...

    async def put(self, adapter: Adapter) -> None: ...

    async def remove(self, name: str) -> Adapter | None: ...

    async def close(self) -> None: ...


class MemoryAdapterBook:
    def __init__(self) -> None:
        self._adapters: dict[str, Adapter] = {}

    async def all(self) -> dict[str, Adapter]:
        return dict(self._adapters)

    async def put(self, adapter: Adapter) -> None:
        self._adapters[adapter.name] = adapter

    async def remove(self, name: str) -> Adapter | None:
        return self._adapters.pop(name, None)

    async def close(self) -> None:
        pass


class RedisAdapterBook:
    """One Redis hash: adapter name -> its JSON. Persistent like the registry's Redis (no TTL): the fleet's
    adapters outlive any one gateway."""

    def __init__(self, url: str) -> None:
        self._redis: aioredis.Redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)

    async def all(self) -> dict[str, Adapter]:
        entries = await self._redis.hgetall(BOOK_KEY)  # type: ignore[misc]
        return {(name.decode() if isinstance(name, bytes) else name): Adapter(**json.loads(value))
                for name, value in entries.items()}

    async def put(self, adapter: Adapter) -> None:
        await self._redis.hset(BOOK_KEY, adapter.name, json.dumps(asdict(adapter)))

    async def remove(self, name: str) -> Adapter | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(BOOK_KEY, name)
            pipe.hdel(BOOK_KEY, name)
            value, _ = await pipe.execute()
        return None if value is None else Adapter(**json.loads(value))

    async def close(self) -> None:
        await self._redis.aclose()


def _base(client: EngineClient) -> str:
    assert client.info is not None
    return client.info.served_model_names[0]


def _adapters(client: EngineClient) -> dict[str, engine_pb2.LoraAdapter]:
    return {} if client.info is None else {a.name: a for a in client.info.lora_adapters}


class FleetAdapters:
    """`refusal`: what load and unload answer instead, where this gateway may not change the fleet's
    adapters (app.py says when)."""

    def __init__(self, pool: EnginePool, book: AdapterBook, *, refusal: APIError | None = None) -> None:
        self.pool = pool
        self.book = book
        self.refusal = refusal
        self._last_book: dict[str, Adapter] | None = None
        # Names that left the book, and when (loop time).
        self._retired: dict[str, float] = {}
        self._passes = 0
        # (worker, adapter) -> the last error its load met, logged once.
        self._failing: dict[tuple[str, str], str] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._reconcile_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.book.close()

    async def load(self, name: str, path: str, *, base_model_name: str | None, inplace: bool) -> str:
        if self.refusal is not None:
            raise self.refusal
        if not name:
            raise bad_request("lora_name is required", "lora_name")
        if not path:
            raise bad_request("lora_path is required", "lora_path")
        targets = self._targets(base_model_name)
        self._check_name_free(name, targets)
        # The base resolved, not "": a worker of another base model that joins later never gets it.
        adapter = Adapter(name, path, _base(targets[0]))
        # Where a load in place fails, each worker goes back to the path it had.
        held_paths = {client.member_id: held.path for client in targets
                      if (held := _adapters(client).get(name)) is not None}
        before = await self._book_call(self.book.all())
        await self._book_call(self.book.put(adapter))
        request = engine_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path, load_inplace=inplace)
        outcomes = await asyncio.gather(*(
            client.stub.LoadLoraAdapter(request, timeout=LOAD_DEADLINE_SECONDS, metadata=client.metadata)
            for client in targets), return_exceptions=True)
        # A refusal (what the request asked is wrong, on any worker) undoes the load; a worker that is
        # unreachable does not, while another took it.
        refusal = next((o for o in outcomes
                        if isinstance(o, grpc.aio.AioRpcError) and o.code() in CLIENT_FAULT_CODES), None)
        if refusal is not None or all(isinstance(o, BaseException) for o in outcomes):
            # Undone everywhere it took, and the book put back as it was.
            loaded_here = [c for c, o in zip(targets, outcomes, strict=True)
                           if isinstance(o, engine_pb2.LoadLoraAdapterResponse) and o.loaded]
            previous = before.get(name)
            await self._book_call(self.book.put(previous) if previous else self.book.remove(name))
            await self._unload_from([c for c in loaded_here if c.member_id not in held_paths], name)
            await asyncio.gather(*(self._give(c, Adapter(name, held_paths[c.member_id]), inplace=True)
                                   for c in loaded_here if c.member_id in held_paths))
            await self._reread(targets)
            failure = refusal or next(o for o in outcomes if isinstance(o, BaseException))
            if isinstance(failure, grpc.aio.AioRpcError):
                raise from_grpc(failure, {"lora_name": "lora_name", "lora_path": "lora_path"})
            raise failure
        for client, outcome in zip(targets, outcomes, strict=True):
            if isinstance(outcome, BaseException):  # a worker that went away: the loop loads it on its return
                logger.warning("LoRA adapter %s not loaded on %s yet: %s", name, client.address, outcome)
        await self._reread(targets)
        logger.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(targets))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        if self.refusal is not None:
            raise self.refusal
        if not name:
            raise bad_request("lora_name is required", "lora_name")
        removed = await self._book_call(self.book.remove(name))
        holders = [c for c in self.pool.ready_clients() if name in _adapters(c)]
        if removed is None and not holders:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="lora_adapter_not_found")
        await self._unload_from(holders, name)
        await self._reread(holders)
        logger.info("LoRA adapter %s unloaded from %d workers", name, len(holders))
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_name_free(self, name: str, targets: Sequence[EngineClient]) -> None:
        """An adapter's name must not be another model's: a base model's (any of its names), or an adapter
        of another base; the pool routes by name, so it would take that model's requests."""
        for client in self.pool.ready_clients():
            assert client.info is not None
            if name not in client.info.served_model_names:
                continue
            if name not in _adapters(client):
                raise bad_request(f"`{name}` is a base model's name", "lora_name")
            if client not in targets:
                raise bad_request(f"`{name}` is an adapter of the base model `{_base(client)}`", "lora_name")

    def _targets(self, base_model_name: str | None) -> list[EngineClient]:
        ready = self.pool.ready_clients()
        if not ready:
            raise self.pool.unavailable()
        bases = {_base(client) for client in ready}
        if base_model_name is None:
            if len(bases) > 1:
                raise bad_request(f"the fleet serves several base models ({', '.join(sorted(bases))}): name the "
                                  "one the adapter adapts", "base_model_name")
            return ready
        if base_model_name not in bases:
            raise APIError(404, f"no ready worker serves the base model `{base_model_name}`",
                           param="base_model_name", code="model_not_found")
        return [client for client in ready if _base(client) == base_model_name]

    async def _unload_from(self, clients: Sequence[EngineClient], name: str) -> None:
        request = engine_pb2.UnloadLoraAdapterRequest(lora_name=name)
        outcomes = await asyncio.gather(*(
            client.stub.UnloadLoraAdapter(request, timeout=CALL_DEADLINE_SECONDS, metadata=client.metadata)
            for client in clients), return_exceptions=True)
        for client, outcome in zip(clients, outcomes, strict=True):
            if isinstance(outcome, grpc.aio.AioRpcError) and outcome.code() != grpc.StatusCode.NOT_FOUND:
                logger.warning("LoRA adapter %s not unloaded from %s: %s", name, client.address, outcome.details())

    async def _reread(self, clients: Sequence[EngineClient]) -> None:
        """The workers' ModelInfo again, so that routing and /v1/models see their adapters now."""
        await asyncio.gather(*(client.read_info(CALL_DEADLINE_SECONDS) for client in clients),
                             return_exceptions=True)

    @staticmethod
    async def _book_call(call: Awaitable[T]) -> T:
        try:
            return await call
        except (RedisError, OSError) as error:
            logger.warning("the LoRA adapter book (Redis) did not answer: %s", error)
            raise APIError(503, "the fleet's LoRA adapter book (Redis) did not answer; retry",
                           headers={"Retry-After": "1"}) from None

    async def _reconcile_forever(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as error:
                logger.debug("LoRA adapter book unreadable for now: %s", error)
            except Exception:  # the loop must outlive any one failure
                logger.exception("reconciling the workers' LoRA adapters failed")
            await asyncio.sleep(RECONCILE_SECONDS)

    async def reconcile(self) -> None:
        """One pass: each ready worker given the book's adapters it lacks, and rid of the ones that left the
        book; ModelInfo read again where anything changed."""
        book = await self.book.all()
        changed = book != self._last_book
        now = asyncio.get_running_loop().time()
        for name in set(self._last_book or ()) - set(book):
            self._retired[name] = now
        self._retired = {name: at for name, at in self._retired.items()
                         if name not in book and now - at < RETIRED_SECONDS}
        self._last_book = book
        if self._passes % FULL_REREAD_PASSES == 0:
            await self._reread(self.pool.ready_clients())
        self._passes += 1
        touched: list[EngineClient] = []
        for client in self.pool.ready_clients():
            held = _adapters(client)
            missing = [a for a in book.values() if a.base_model_name in ("", _base(client))
                       and (a.name not in held or held[a.name].path != a.path)]
            stray = [a.name for a in held.values() if a.loaded_at_runtime and a.name in self._retired]
            for adapter in missing:
                await self._give(client, adapter, inplace=adapter.name in held)
            if stray:
                await asyncio.gather(*(self._unload_from([client], name) for name in stray))
            if missing or stray or changed:
                touched.append(client)
        await self._reread(touched)

    async def _give(self, client: EngineClient, adapter: Adapter, *, inplace: bool = False) -> None:
        """Loads `adapter` on the worker (in place of the one of its name it holds, with `inplace`); a
        failure is logged once per worker, adapter and error, and tried again by the next pass."""
        request = engine_pb2.LoadLoraAdapterRequest(lora_name=adapter.name, lora_path=adapter.path,
                                                    load_inplace=inplace)
        key = (client.member_id, adapter.name)
        try:
            await client.stub.LoadLoraAdapter(request, timeout=LOAD_DEADLINE_SECONDS, metadata=client.metadata)
        except grpc.aio.AioRpcError as error:
            if self._failing.get(key) != error.details():
                logger.warning("LoRA adapter %s could not be given to %s: %s: %s", adapter.name, client.address,
                               error.code().name, error.details())
            self._failing[key] = error.details() or ""
            return
        self._failing.pop(key, None)
        logger.info("LoRA adapter %s given to %s", adapter.name, client.address)
