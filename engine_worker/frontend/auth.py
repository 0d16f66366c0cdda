"""`taco_llm worker --api-key KEY`: gRPC calls must carry `authorization: Bearer KEY` in their metadata.

The health service stays open, so that probes and load balancers need no key.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from taco_llm.protos import rich_status
from taco_llm.protos.rich_status import Reason

OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/",)
DENIED = "missing or invalid API key: send metadata 'authorization: Bearer <key>' (the worker's --api-key)"


def _bearer(metadata: Any) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            raw = value if isinstance(value, bytes) else value.encode()
            scheme, _, token = raw.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


async def _deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await rich_status.abort(context, grpc.StatusCode.UNAUTHENTICATED, DENIED, Reason.API_KEY_INVALID, "authorization")


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call before the servicer runs."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(_deny, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        self.expected = api_key.encode()

    def allows(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method.startswith(OPEN_SERVICE_PREFIXES):
            return True
        token = _bearer(details.invocation_metadata)
        # compare_digest: the time taken does not tell how much of a guess was right.
        return token is not None and hmac.compare_digest(token, self.expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self.allows(handler_call_details):
            return handler
        return _denying(handler)
