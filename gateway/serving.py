"""What the serving objects share: calls to the workers, the response's model name, and the watch for
a client that leaves before a non-streaming answer is ready."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse

from taco_llm.protos import engine_pb2

from .engine_pool import EngineClient, EnginePool
from .errors import from_grpc
from .from_engine import EngineStream
from .protocol import StreamOptions

T = TypeVar("T")


@dataclass(frozen=True)
class EngineCalls:
    """The workers; each call carries its worker's gRPC metadata (the workers' API key)."""

    pool: EnginePool

    async def generate(self, request: engine_pb2.GenerateRequest, param_names: Mapping[str, str]) -> EngineStream:
        """Opens a Generate call on the least-busy worker of the model and waits for its first message,
        so that what the worker refuses before generating is raised here, before any response head."""
        client = self.pool.pick(request.model or None)
        if not request.model:
            assert client.info is not None
            request.model = client.info.served_model_names[0]
        stream = EngineStream(client, request, param_names)
        try:
            await stream.first()
        except BaseException:
            stream.close()
            raise
        return stream

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


def response_model_name(asked: str | None, stream: EngineStream) -> str:
    # As vLLM's: responses carry the worker's first served name whichever of its names was asked for
    # (--served-model-name A B); a LoRA adapter's name is carried as asked.
    info = stream.client.info
    assert info is not None
    adapters = {a.name for a in info.lora_adapters}
    base_names = [n for n in info.served_model_names if n not in adapters]
    return asked if asked and asked not in base_names else base_names[0]


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
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return JSONResponse({"error": {"message": "client disconnected", "type": "request_cancelled",
                                       "param": None, "code": 499}}, status_code=499)
    return task.result()
