"""What the serving objects share: calls to the workers, and the watch for a client that leaves before a
non-streaming answer is ready."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse

from taco_llm.protos import engine_pb2

from .args import DEFAULT_STREAM_STALL_TIMEOUT
from .engine_pool import EngineClient, EnginePool
from .errors import from_grpc
from .failover import EngineStream, FailoverPolicy
from .protocol import StreamOptions
from .routing import RouteKey

T = TypeVar("T")


class EngineCalls:
    """The workers, and how a request survives their failures; each call carries its worker's gRPC
    metadata (the workers' API key)."""

    def __init__(self, pool: EnginePool, *, max_retries: int = 2, retry_backoff: float = 0.05,
                 max_migrations: int = 2, stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT) -> None:
        self.pool = pool
        self.policy = FailoverPolicy(max_retries=max_retries, retry_backoff=retry_backoff,
                                     max_migrations=max_migrations, stream_stall_timeout=stream_stall_timeout)
        # Worker address -> when a stream last had a message from it: the stall deadline's sign that a
        # quiet stream's worker is busy, not stuck (failover.py).
        self.progress: dict[str, float] = {}

    async def generate(self, request: engine_pb2.GenerateRequest, param_names: Mapping[str, str],
                       route_key: RouteKey, *, arrival: float | None = None) -> EngineStream:
        """Opens a Generate call on the worker the pool routes it to and waits for its first message, so
        that what the worker refuses before generating is raised here, before any response head; a
        worker that fails before then is replaced by another (failover.py). `arrival`: when the request
        arrived (time.perf_counter), for the time-to-first-token metric; default now."""
        return await EngineStream.open(self.pool, self.policy, request, param_names=param_names,
                                       route_key=route_key,
                                       arrival=time.perf_counter() if arrival is None else arrival,
                                       progress=self.progress)

    async def tokenize(self, request: engine_pb2.TokenizeRequest,
                       param_names: Mapping[str, str]) -> engine_pb2.TokenizeResponse:
        client = self.pool.pick(request.model or None)
        try:
            return await client.stub.Tokenize(request, metadata=client.metadata)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error, param_names) from None

    async def detokenize(self, request: engine_pb2.DetokenizeRequest, param_names: Mapping[str, str], *,
                         client: EngineClient | None = None) -> str:
        """`client`: the worker that must answer (an echo's text comes from the worker that ran its
        prompt); otherwise the least-busy worker of the model."""
        client = client or self.pool.pick(request.model or None)
        try:
            reply = await client.stub.Detokenize(request, metadata=client.metadata)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error, param_names) from None
        return reply.text  # type: ignore[no-any-return]


def engine_metadata(engine_api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {engine_api_key}"),) if engine_api_key else ()


def usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats), both false without stream_options."""
    if options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | JSONResponse:
    """Runs a non-streaming request, cancelling it (and so the engine request) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # Cancelled by our caller (a batch whose other conversation was refused): the work goes too, and
        # an error it already ended with is taken here, not left to be logged as never retrieved.
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return JSONResponse({"error": {"message": "client disconnected", "type": "request_cancelled",
                                       "param": None, "code": 499}}, status_code=499)
    return task.result()
