"""The rich error model (protos/errors.proto) in Python, for every taco-llm service and client.

A refusal is a gRPC status whose trailing metadata holds a google.rpc.Status with an ErrorInfo (the
reason, domain "taco-llm") and a BadRequest naming the field. Servers call `abort`; clients read
`details_of(error)` and decide by `details.reason` (or `has_reason`), never by the message text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from taco_llm.protos import errors_pb2

DOMAIN = "taco-llm"
Reason = errors_pb2.ErrorReason


def status(code: grpc.StatusCode, message: str, reason: int, field: str | None = None) -> grpc.Status:
    """The grpc.Status to end a call with; `reason` is an ErrorReason value."""
    name = Reason.Name(reason)  # type: ignore[arg-type]
    rich = status_pb2.Status(code=code.value[0], message=message)
    rich.details.add().Pack(error_details_pb2.ErrorInfo(reason=name, domain=DOMAIN))
    if field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message, reason=name)
        rich.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return rpc_status.to_status(rich)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, reason: int,
                field: str | None = None) -> NoReturn:
    """Ends a grpc.aio call with the rich status."""
    rich = status(code, message, reason, field)
    await context.abort(rich.code, rich.details, trailing_metadata=rich.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")


async def invalid_argument(context: grpc.aio.ServicerContext, message: str, field: str) -> NoReturn:
    """The commonest refusal: INVALID_ARGUMENT, reason FIELD_INVALID, naming the field."""
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, message, Reason.FIELD_INVALID, field)


@dataclass(frozen=True)
class ErrorDetails:
    """What a taco-llm refusal says beyond its status code."""

    reason: str | None = None  # ErrorInfo.reason, when the domain is ours
    field: str | None = None   # the first BadRequest field violation's field


def details_of(error: Any) -> ErrorDetails:
    """The reason and field of a failed call (a grpc.RpcError that is a grpc.Call, sync or aio);
    empty where the status carries none (another server, or the transport failed)."""
    try:
        rich = rpc_status.from_call(error)
    except (ValueError, AttributeError):  # an inconsistent status, or an error that is not a call
        return ErrorDetails()
    if rich is None:
        return ErrorDetails()
    reason = field = None
    for detail in rich.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) and field is None:
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                field = bad.field_violations[0].field
    return ErrorDetails(reason, field)


def has_reason(error: Any, reason: int) -> bool:
    return details_of(error).reason == Reason.Name(reason)  # type: ignore[arg-type]
