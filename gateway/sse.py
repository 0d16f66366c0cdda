"""Server-sent events as OpenAI's streaming endpoints frame them.

A stream's chunks differ only in their choices (and, at the end, the usage): `ChunkFormat` encodes the
constant head (id, object, created, model) once per stream, and the choices are JSON text made by the
serving objects, so that a chunk is a few string joins rather than a dict encoded whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

from .errors import APIError
from .request_context import RequestContext

DONE = b"data: [DONE]\n\n"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def string(text: str) -> str:
    """A JSON string, as `dumps` writes one (non-ASCII kept), without the encoder's general dispatch."""
    return encode_basestring(text)  # type: ignore[no-any-return]


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload).encode() + b"\n\n"


def typed_event(payload: dict[str, Any]) -> bytes:
    """An event named by its payload's `type` (`event: TYPE`), as the Responses and Messages APIs stream."""
    return f"event: {payload['type']}\ndata: {dumps(payload)}\n\n".encode()


def error_event(error: APIError) -> bytes:
    """A failure after the response head went out can only be told in the stream itself."""
    return event(error.body())


class ChunkFormat:
    """One stream's chunks: with include_usage every chunk has a `usage` key, null but on the last, as
    OpenAI's. The bytes are those `event` would give for the same dict."""

    __slots__ = ("_close", "_open")

    def __init__(self, context: RequestContext, object_name: str) -> None:
        head = dumps(context.head(object_name))
        self._open = "data: " + head[:-1] + ',"choices":['
        self._close = '],"usage":null}\n\n' if context.options.include_usage else "]}\n\n"

    def text(self, choices: Iterable[str]) -> str:
        """One event's text, of its choices' JSON."""
        return self._open + ",".join(choices) + self._close

    def chunk(self, choices: Iterable[str]) -> bytes:
        return self.text(choices).encode()

    def usage_chunk(self, usage: dict[str, Any] | None, choices: Iterable[str] = ()) -> bytes:
        return (self._open + ",".join(choices) + '],"usage":' + dumps(usage) + "}\n\n").encode()


def chunk(context: RequestContext, object_name: str, choices: list[dict[str, Any]],
          usage: dict[str, Any] | None = None) -> bytes:
    """One chunk, of choices as dicts (the rare ones: echo, a stream's first)."""
    payload = {**context.head(object_name), "choices": choices}
    if context.options.include_usage:
        payload["usage"] = usage
    return event(payload)
