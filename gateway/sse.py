"""Server-sent events as OpenAI's streaming endpoints frame them."""

from __future__ import annotations

import json
from typing import Any

from .errors import APIError
from .request_context import RequestContext

DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def error_event(error: APIError) -> bytes:
    """A failure after the response head went out can only be told in the stream itself."""
    return event(error.body())


def chunk(context: RequestContext, object_name: str, choices: list[dict[str, Any]],
          usage: dict[str, Any] | None = None) -> bytes:
    """One chunk; with include_usage every chunk has a `usage` key, null but on the last, as OpenAI's."""
    payload = {**context.head(object_name), "choices": choices}
    if context.options.include_usage:
        payload["usage"] = usage
    return event(payload)
