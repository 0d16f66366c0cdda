"""The fleet's runtime LoRA adapters without an engine: fake workers that hold adapters as a worker's
LoadLoraAdapter and UnloadLoraAdapter do, the book in memory and in a real Redis. The real workers are in
test_fleet_e2e.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from taco_llm.gateway.errors import APIError
from taco_llm.gateway.fleet_adapters import Adapter, AdapterBook, FleetAdapters, MemoryAdapterBook, RedisAdapterBook
from taco_llm.protos import engine_pb2

from .support import RedisServer

BASE = "base-model"


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@dataclass
class FakeWorker:
    """A worker's adapters: name -> (path, loaded at runtime)."""

    address: str
    base: str = BASE
    adapters: dict[str, tuple[str, bool]] = field(default_factory=dict)
    refuses: bool = False
    calls: list[str] = field(default_factory=list)

    async def LoadLoraAdapter(self, request: engine_pb2.LoadLoraAdapterRequest,
                              **_: Any) -> engine_pb2.LoadLoraAdapterResponse:
        self.calls.append(f"load {request.lora_name}")
        if self.refuses:
            raise _rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA is off")
        if request.lora_name in self.adapters:
            return engine_pb2.LoadLoraAdapterResponse(loaded=False)
        self.adapters[request.lora_name] = (request.lora_path, True)
        return engine_pb2.LoadLoraAdapterResponse(loaded=True)

    async def UnloadLoraAdapter(self, request: engine_pb2.UnloadLoraAdapterRequest,
                                **_: Any) -> engine_pb2.UnloadLoraAdapterResponse:
        self.calls.append(f"unload {request.lora_name}")
        if self.adapters.pop(request.lora_name, None) is None:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND, "no such adapter")
        return engine_pb2.UnloadLoraAdapterResponse()


class FakeClient:
    """What FleetAdapters reads of an EngineClient: its stub, its ModelInfo (read again on read_info)."""

    def __init__(self, worker: FakeWorker) -> None:
        self.stub = worker
        self.address = self.member_id = worker.address
        self.metadata = ()
        self.info: engine_pb2.ModelInfo | None = None
        self.ready = True

    async def read_info(self, deadline: float) -> None:
        worker = self.stub
        self.info = engine_pb2.ModelInfo(
            served_model_names=[worker.base, *worker.adapters],
            lora_adapters=[engine_pb2.LoraAdapter(name=name, path=path, base_model_name=worker.base,
                                                  loaded_at_runtime=runtime)
                           for name, (path, runtime) in worker.adapters.items()])


class FakePool:
    def __init__(self, clients: list[FakeClient]) -> None:
        self.clients = clients

    def ready_clients(self) -> list[FakeClient]:
        return [c for c in self.clients if c.ready and c.info is not None]

    def unavailable(self) -> APIError:
        return APIError(503, "no worker is ready")


def _fleet(*workers: FakeWorker, book: AdapterBook | None = None) -> tuple[FleetAdapters, list[FakeClient]]:
    clients = [FakeClient(worker) for worker in workers]
    for client in clients:
        asyncio.run(client.read_info(1))
    return FleetAdapters(FakePool(clients), book or MemoryAdapterBook()), clients  # type: ignore[arg-type]


def test_a_load_reaches_every_worker_and_an_unload_leaves_none() -> None:
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    fleet, clients = _fleet(a, b)

    async def run() -> None:
        assert "Success" in await fleet.load("sql", "/adapters/sql", base_model_name=None, inplace=False)
        assert all(c.info is not None and "sql" in c.info.served_model_names for c in clients)
        assert await fleet.book.all() == {"sql": Adapter("sql", "/adapters/sql", BASE)}
        assert "Success" in await fleet.unload("sql")
        assert a.adapters == b.adapters == {} and await fleet.book.all() == {}
        with pytest.raises(APIError) as unknown:
            await fleet.unload("sql")
        assert (unknown.value.status, unknown.value.param) == (404, "lora_name")
    asyncio.run(run())


def test_the_book_names_the_base_and_an_adapter_cannot_take_another_models_name() -> None:
    a, b = FakeWorker("a:1"), FakeWorker("b:1", base="other-base", adapters={"other-sql": ("/o", False)})
    fleet, _ = _fleet(a, b)

    async def run() -> None:
        await fleet.load("sql", "/adapters/sql", base_model_name=BASE, inplace=False)
        assert await fleet.book.all() == {"sql": Adapter("sql", "/adapters/sql", BASE)}
        for name in ("other-base", "other-sql"):
            with pytest.raises(APIError) as taken:
                await fleet.load(name, "/adapters/x", base_model_name=BASE, inplace=False)
            assert (taken.value.status, taken.value.param) == (400, "lora_name")
    asyncio.run(run())


def test_a_failed_load_in_place_puts_each_worker_back_on_its_path() -> None:
    a = FakeWorker("a:1", adapters={"sql": ("/adapters/old", True)})
    b = FakeWorker("b:1", adapters={"sql": ("/adapters/old", True)}, refuses=True)
    fleet, _ = _fleet(a, b)

    async def replace_in_place(worker: FakeWorker) -> Any:
        original = worker.LoadLoraAdapter

        async def load(request: engine_pb2.LoadLoraAdapterRequest, **kwargs: Any) -> Any:
            if request.load_inplace and not worker.refuses:
                worker.calls.append(f"load {request.lora_name} in place from {request.lora_path}")
                worker.adapters[request.lora_name] = (request.lora_path, True)
                return engine_pb2.LoadLoraAdapterResponse(loaded=True)
            return await original(request, **kwargs)
        return load

    async def run() -> None:
        a.LoadLoraAdapter = await replace_in_place(a)  # type: ignore[method-assign]
        with pytest.raises(APIError):
            await fleet.load("sql", "/adapters/new", base_model_name=None, inplace=True)
        assert a.adapters["sql"] == ("/adapters/old", True)
        assert a.calls == ["load sql in place from /adapters/new", "load sql in place from /adapters/old"]
    asyncio.run(run())


def test_a_gateway_that_may_not_change_adapters_says_why() -> None:
    fleet = FleetAdapters(FakePool([]), MemoryAdapterBook(),  # type: ignore[arg-type]
                          refusal=APIError(404, "runtime LoRA updating is off"))

    async def run() -> None:
        for call in (fleet.load("x", "/x", base_model_name=None, inplace=False), fleet.unload("x")):
            with pytest.raises(APIError) as refused:
                await call
            assert refused.value.status == 404
    asyncio.run(run())


def test_one_worker_refusing_undoes_the_load_everywhere() -> None:
    a, b = FakeWorker("a:1"), FakeWorker("b:1", refuses=True)
    fleet, clients = _fleet(a, b)

    async def run() -> None:
        with pytest.raises(APIError) as refused:
            await fleet.load("sql", "/adapters/sql", base_model_name=None, inplace=False)
        assert refused.value.status == 400
        assert a.adapters == {} and a.calls == ["load sql", "unload sql"]
        assert await fleet.book.all() == {}
        assert clients[0].info is not None and "sql" not in clients[0].info.served_model_names
    asyncio.run(run())


@pytest.mark.parametrize(("fields", "status", "param"), [
    ({"name": "", "path": "/x"}, 400, "lora_name"),
    ({"name": "x", "path": ""}, 400, "lora_path"),
    ({"name": BASE, "path": "/x"}, 400, "lora_name"),
    ({"name": "x", "path": "/x", "base": "other"}, 404, "base_model_name"),
])
def test_bad_loads_are_refused_by_name(fields: dict[str, str], status: int, param: str) -> None:
    fleet, _ = _fleet(FakeWorker("a:1"))

    async def run() -> None:
        with pytest.raises(APIError) as refused:
            await fleet.load(fields["name"], fields["path"], base_model_name=fields.get("base"), inplace=False)
        assert (refused.value.status, refused.value.param) == (status, param)
    asyncio.run(run())


def test_with_several_base_models_the_base_must_be_named_and_only_its_workers_load() -> None:
    a, b = FakeWorker("a:1"), FakeWorker("b:1", base="other-base")
    fleet, _ = _fleet(a, b)

    async def run() -> None:
        with pytest.raises(APIError) as refused:
            await fleet.load("sql", "/adapters/sql", base_model_name=None, inplace=False)
        assert refused.value.param == "base_model_name"
        await fleet.load("sql", "/adapters/sql", base_model_name="other-base", inplace=False)
        assert "sql" not in a.adapters and "sql" in b.adapters
        # The loop keeps it off the other base's workers too.
        await fleet.reconcile()
        assert "sql" not in a.adapters
    asyncio.run(run())


def test_the_loop_gives_a_newcomer_the_books_adapters_and_takes_only_what_left_the_book() -> None:
    newcomer = FakeWorker("c:1", adapters={"direct": ("/adapters/direct", True), "own": ("/adapters/own", False)})
    book = MemoryAdapterBook()
    asyncio.run(book.put(Adapter("sql", "/adapters/sql")))
    fleet, clients = _fleet(newcomer, book=book)

    async def run() -> None:
        await fleet.reconcile()
        # Given the book's; a gRPC client's own adapter and the start-up one are not the fleet's to take.
        assert newcomer.adapters == {"sql": ("/adapters/sql", True), "direct": ("/adapters/direct", True),
                                     "own": ("/adapters/own", False)}
        assert clients[0].info is not None and "sql" in clients[0].info.served_model_names
        calls = list(newcomer.calls)
        await fleet.reconcile()  # nothing left to do: no call
        assert newcomer.calls == calls
        await book.remove("sql")  # through another gateway replica
        await fleet.reconcile()
        assert set(newcomer.adapters) == {"direct", "own"}
    asyncio.run(run())


def test_a_worker_that_cannot_take_adapters_is_retried_quietly(caplog: pytest.LogCaptureFixture) -> None:
    book = MemoryAdapterBook()
    asyncio.run(book.put(Adapter("sql", "/adapters/sql")))
    worker = FakeWorker("a:1", refuses=True)
    fleet, _ = _fleet(worker, book=book)

    async def run() -> None:
        for _ in range(3):
            await fleet.reconcile()
    asyncio.run(run())
    assert worker.calls == ["load sql"] * 3
    assert sum("could not be given" in record.message for record in caplog.records) == 1



def test_the_redis_book_is_one_for_every_gateway(redis_server: RedisServer) -> None:
    async def run() -> None:
        first, second = RedisAdapterBook(redis_server.url), RedisAdapterBook(redis_server.url)
        await first.put(Adapter("sql", "/adapters/sql", "base"))
        assert await second.all() == {"sql": Adapter("sql", "/adapters/sql", "base")}
        assert await second.remove("sql") == Adapter("sql", "/adapters/sql", "base")
        assert await first.remove("sql") is None and await first.all() == {}
        await first.close()
        await second.close()
    asyncio.run(run())


def test_the_loop_moves_a_worker_whose_path_differs_from_the_books_in_place() -> None:
    book = MemoryAdapterBook()
    asyncio.run(book.put(Adapter("sql", "/adapters/new", BASE)))
    behind = FakeWorker("a:1", adapters={"sql": ("/adapters/old", True)})
    fleet, _ = _fleet(behind, book=book)
    seen: list[tuple[str, bool]] = []
    original = behind.LoadLoraAdapter

    async def load(request: engine_pb2.LoadLoraAdapterRequest, **kwargs: Any) -> Any:
        seen.append((request.lora_path, request.load_inplace))
        if request.load_inplace:
            behind.adapters[request.lora_name] = (request.lora_path, True)
            return engine_pb2.LoadLoraAdapterResponse(loaded=True)
        return await original(request, **kwargs)

    behind.LoadLoraAdapter = load  # type: ignore[method-assign]
    asyncio.run(fleet.reconcile())
    assert seen == [("/adapters/new", True)] and behind.adapters["sql"] == ("/adapters/new", True)


@pytest.mark.parametrize(("allowed", "processes", "registry", "status"), [
    (False, 1, None, 404), (True, 2, None, 400), (True, 2, "redis://r:6379/0", None), (True, 1, None, None)])
def test_when_a_gateway_may_change_the_fleets_adapters(allowed: bool, processes: int, registry: str | None,
                                                        status: int | None) -> None:
    from taco_llm.gateway.app import GatewaySettings, runtime_lora_refusal

    refusal = runtime_lora_refusal(GatewaySettings(runtime_lora_updating=allowed, api_server_count=processes,
                                                   registry_url=registry))
    assert (refusal.status if refusal is not None else None) == status
