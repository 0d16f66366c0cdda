"""The gateway's own load, for load balancers (/load): requests on the generating routes that have not
been answered in full yet, counted from when their handler starts to the last chunk of their answer
(a stream's end, or the client leaving it), as vLLM's server counts its `server_load`. Per gateway
process (--api-server-count counts each process apart, as vLLM does).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse

T = TypeVar("T")


class ServerLoad:
    """The count /load reports."""

    def __init__(self) -> None:
        self.in_progress = 0

    async def counted(self, answer: Awaitable[T]) -> T:
        """Counts a generating request while it is answered: a streamed answer until its body ends."""
        self.in_progress += 1
        try:
            result = await answer
        except BaseException:
            self.in_progress -= 1
            raise
        if isinstance(result, StreamingResponse):
            result.body_iterator = self._released(result.body_iterator)
        else:
            self.in_progress -= 1
        return result

    async def _released(self, body: AsyncIterable[Any]) -> AsyncIterator[Any]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.in_progress -= 1
