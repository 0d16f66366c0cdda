"""Refuses request bytes that are no message of the method's type with INVALID_ARGUMENT.

grpc.aio parses a request with the handler's deserializer before the servicer runs, and answers a
protobuf DecodeError with UNKNOWN quoting the library's message. RequestDecodingInterceptor
re-registers each of our handlers (methods under the `/taco_llm.` packages; health and reflection
stay as they are) to receive the raw bytes and parse them itself: a request that does not parse is
refused with the rich status of protos/errors.proto (FIELD_INVALID), in the client's terms. A
client-streaming call is parsed message by message as the servicer reads it; a bad one ends the call
there, so the servicer never sees it (PutBlocks stores only complete blocks, so nothing of a
half-received block is kept).

Shared by the worker and the cache service; it imports neither torch nor vLLM. Install it after the
API-key interceptor, so an unauthenticated caller is told that first.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from taco_llm.protos.rich_status import Reason, abort

logger = logging.getLogger(__name__)

OUR_METHOD_PREFIX = "/taco_llm."

Deserializer = Callable[[bytes], Any]


def _type_name(deserializer: Deserializer, method: str) -> str:
    """The request's message type (`Message.FromString` is bound to its class), else the method."""
    message_class = getattr(deserializer, "__self__", None)
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    return descriptor.full_name if descriptor is not None else f"{method} request"


class _Decoder:
    """Parses one method's raw requests; refuses one that does not parse."""

    def __init__(self, deserializer: Deserializer, method: str):
        self.deserializer = deserializer
        self.method = method
        self.type_name = _type_name(deserializer, method)

    async def one(self, raw: bytes, context: grpc.aio.ServicerContext, which: str = "the request") -> Any:
        try:
            return self.deserializer(raw)
        except DecodeError:
            await self._refuse(context, which)

    async def each(self, raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        index = 0
        async for raw in raws:
            yield await self.one(raw, context, f"request message {index}")
            index += 1

    async def _refuse(self, context: grpc.aio.ServicerContext, which: str) -> NoReturn:
        # Only the client's mistake: no traceback, and the library's text stays out of the answer.
        logger.info("%s: refused %s: not a valid %s message", self.method, which, self.type_name)
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{which} is not a valid {self.type_name} message",
                    Reason.FIELD_INVALID)


async def _results(outcome: Any) -> AsyncIterator[Any]:
    """What a unary-stream or stream-stream behavior produced: the messages an async generator yields,
    or none where it is a coroutine that writes with context.write."""
    if hasattr(outcome, "__aiter__"):
        async for message in outcome:
            yield message
    else:
        await outcome


def _decoding(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that takes raw bytes and parses them itself."""
    decoder = _Decoder(handler.request_deserializer, method)
    serializer = handler.response_serializer
    if handler.unary_unary:
        unary_unary = handler.unary_unary

        async def unary_unary_call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary_unary(await decoder.one(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary_call, response_serializer=serializer)
    if handler.unary_stream:
        unary_stream = handler.unary_stream

        async def unary_stream_call(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for message in _results(unary_stream(await decoder.one(raw, context), context)):
                yield message

        return grpc.unary_stream_rpc_method_handler(unary_stream_call, response_serializer=serializer)
    if handler.stream_unary:
        stream_unary = handler.stream_unary

        async def stream_unary_call(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            return await stream_unary(decoder.each(raws, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary_call, response_serializer=serializer)
    stream_stream = handler.stream_stream

    async def stream_stream_call(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for message in _results(stream_stream(decoder.each(raws, context), context)):
            yield message

    return grpc.stream_stream_rpc_method_handler(stream_stream_call, response_serializer=serializer)


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    """Our methods answer a request that does not parse with INVALID_ARGUMENT (see the module)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.request_deserializer is None or not method.startswith(OUR_METHOD_PREFIX):
            return handler
        return _decoding(handler, method)
