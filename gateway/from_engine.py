"""The engine's Generate messages to OpenAI response objects, whole or as stream chunks (the stream itself,
with its retries and migrations, is failover.EngineStream)."""

from __future__ import annotations

import asyncio
import math
import os
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

from taco_llm.protos import engine_pb2

from .errors import APIError
from .metrics import REGISTRY

if TYPE_CHECKING:
    from .failover import EngineStream

# JSON has no -inf; vLLM's server clamps to the same value.
_LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return _LOGPROB_FLOOR if math.isnan(value) or value < _LOGPROB_FLOOR else value


# The proto's finish reasons as OpenAI (and vLLM) spell them; UNSPECIFIED (still running) is absent.
FINISH_REASONS: dict[int, str] = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    engine_pb2.FINISH_REASON_ERROR: "error",
    engine_pb2.FINISH_REASON_REPETITION: "repetition",
}


def finish_reason(value: int) -> str | None:
    """None while the choice runs."""
    return FINISH_REASONS.get(value)


def delta_text(delta: engine_pb2.ChoiceDelta) -> str:
    """The model's own text in a delta, whichever output variant carries it."""
    match delta.WhichOneof("output"):
        case "text":
            return delta.text
        case "parsed":
            return delta.parsed.raw_text
        case _:
            return ""


@dataclass
class ChoiceState:
    """What has been generated so far for one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # The worker's whole-text parse, where it parsed tool calls.
    parsed: engine_pb2.ParsedChoice | None = None

    def add(self, delta: engine_pb2.ChoiceDelta) -> None:
        self.text += delta_text(delta)
        if delta.WhichOneof("output") == "parsed" and delta.parsed.HasField("whole"):
            self.parsed = delta.parsed.whole
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason:
            self.finish_reason = finish_reason(delta.finish_reason)
            self.stop_reason = stop_reason(delta)


def stop_reason(delta: engine_pb2.ChoiceDelta) -> str | int | None:
    kind = delta.WhichOneof("stop_reason")
    if kind == "stop_string":
        return delta.stop_string
    if kind == "stop_token_id":
        return delta.stop_token_id
    return None


def usage_json(usage: engine_pb2.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def add_usage(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a or b
    total = {k: a[k] + b[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {
        "cached_tokens": a["prompt_tokens_details"]["cached_tokens"] + b["prompt_tokens_details"]["cached_tokens"]
    }
    return total


@dataclass(frozen=True, kw_only=True)
class TokenText:
    """How a token appears in logprobs: its text, or `token_id:N` with --return-tokens-as-token-ids."""

    as_token_ids: bool = False

    def __call__(self, token_id: int, token: str) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else token


def chat_logprobs(items: list[engine_pb2.TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    def entry(token_id: int, token: str, logprob: float) -> dict[str, Any]:
        shown = text_of(token_id, token)
        return {"token": shown, "logprob": _logprob(logprob), "bytes": list(shown.encode("utf-8"))}

    content = []
    for item in items:
        top = [entry(t.token_id, t.token, t.logprob) for t in item.top]
        content.append({**entry(item.token_id, item.token, item.logprob), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(items: list[engine_pb2.TokenLogprob], text_of: TokenText,
                        start_offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = start_offset
    for item in items:
        shown = text_of(item.token_id, item.token)
        tokens.append(shown)
        token_logprobs.append(_logprob(item.logprob))
        top_logprobs.append({text_of(t.token_id, t.token): _logprob(t.logprob) for t in item.top} or None)
        offsets.append(offset)
        offset += len(item.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprobs_json(entries: Iterable[engine_pb2.PromptTokenLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first, which has no context) or
    {token_id: {"logprob", "rank", "decoded_token"}}, -inf clamped as vLLM's server does."""
    return [
        {str(c.token_id): {"logprob": _logprob(c.logprob), "rank": c.rank, "decoded_token": c.token}
         for c in entry.candidates} or None
        for entry in entries
    ]


@dataclass
class Collected:
    choices: list[ChoiceState]
    usage: engine_pb2.Usage | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[engine_pb2.PromptTokenLogprobs] = field(default_factory=list)


async def collect(stream: EngineStream, n: int) -> Collected:
    """Reads a whole stream into its choices, usage, prompt tokens and prompt logprobs."""
    result = Collected([ChoiceState(i) for i in range(n)], None, [])
    async for message in stream.messages():
        match message.WhichOneof("phase"):
            case "started":
                result.prompt_token_ids = list(message.started.prompt_token_ids)
                result.prompt_logprobs = list(message.started.prompt_logprobs)
            case "delta":
                for delta in message.delta.choices:
                    if delta.index >= n:
                        raise APIError(500, f"the engine sent choice {delta.index} of {n}")
                    result.choices[delta.index].add(delta)
            case "finished":
                result.usage = message.finished.usage
            case _:
                # A phase this gateway does not know: a newer worker; failing loudly beats a wrong answer.
                raise APIError(500, "the engine sent a message of no phase this gateway knows")
    return result


# A source's messages as the relay hands them on: (which source, message).
Sourced = tuple[int, engine_pb2.GenerateResponse]

# On a busy gateway an event waits for more of its stream's messages: up to this many, for at most this
# long (about one decode step of a GPU engine).
_MAX_BATCH = 32
_MAX_DELAY = 0.02
# A client that reads slower than the engine writes: at most this many of its stream's messages wait
# here. Then the reading tasks stop reading, gRPC's flow control holds the rest back at the worker, and
# vLLM merges the deltas it could not hand on (DELTA output kind) instead of queueing them.
MAX_PENDING = 256


class LoopLoad:
    """Whether this process's event loop is busy: a timer every PERIOD seconds sees how late it fires.
    A saturated gateway reads one message per stream per turn of its loop, and turns get long; an
    idle one turns in microseconds."""

    PERIOD = 0.005
    LATE = 0.002

    def __init__(self) -> None:
        self.busy = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0

    def watch(self) -> None:
        """Starts the timer on the running loop, where it does not run yet."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._due = loop.time() + self.PERIOD
            loop.call_at(self._due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return  # a loop that was replaced (tests run several)
        now = loop.time()
        self.busy = now - self._due > self.LATE
        self._due = now + self.PERIOD
        loop.call_at(self._due, self._tick, loop)


LOOP_LOAD = LoopLoad()


def _tokens_of(message: engine_pb2.GenerateResponse) -> int:
    if message.WhichOneof("phase") != "delta":
        return 0
    choices = message.delta.choices
    if len(choices) == 1:
        return len(choices[0].token_ids)
    return sum(len(c.token_ids) for c in choices)


class _Coalescer:
    """See `coalesced`: the sources' reading tasks fill `pending`; `batches` hands it on when ready."""

    def __init__(self, count: int, stream_interval: int) -> None:
        self.pending: list[Sourced] = []
        # Set while `pending` has room: the reading tasks wait on it when it is full.
        self._room = asyncio.Event()
        self._room.set()
        self.stream_interval = stream_interval
        self.running = count
        self.failure: BaseException | None = None
        # Whether `pending` may go out now.
        self.ready = False
        self.batches_out = 0
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._unsent_tokens = 0
        # Whether each source's first token went out: that one is never held back.
        self._started = [False] * count

    def wake(self) -> None:
        self.ready = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def add(self, index: int, message: engine_pb2.GenerateResponse) -> None:
        pending = self.pending
        pending.append((index, message))
        count = _tokens_of(message)
        # A source's first token goes out at once, whatever the interval and the loop's load: it is
        # the client's time to first token.
        first_token = count > 0 and not self._started[index]
        if first_token:
            self._started[index] = True
        if self.stream_interval > 1:
            self._unsent_tokens += count
            if count and not first_token and self._unsent_tokens < self.stream_interval:
                return
        if self.ready or self._timer is not None:
            if first_token or len(pending) >= _MAX_BATCH:
                self.wake()
        elif first_token or not LOOP_LOAD.busy or not self.batches_out:
            self.wake()
        else:
            self._timer = asyncio.get_running_loop().call_later(_MAX_DELAY, self.wake)

    async def pump(self, index: int, source: AsyncIterator[engine_pb2.GenerateResponse]) -> None:
        try:
            async for message in source:
                self.add(index, message)
                if len(self.pending) >= MAX_PENDING:
                    # Full: it goes out whatever the interval, and nothing more is read until it has.
                    self._room.clear()
                    self.wake()
                    await self._room.wait()
        except Exception as error:  # APIError; `batches` raises it where the client would have seen it
            if self.failure is None:
                self.failure = error
        finally:
            self.running -= 1
            self.wake()

    async def take(self) -> list[Sourced] | None:
        """The next batch; None at the end. Raises a source's failure after the messages before it."""
        while True:
            if not self.ready and self.running:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
                self._waiter = None
            self.ready = False
            if self.pending:
                batch = self.pending[:]
                self.pending.clear()
                self._room.set()
                self._unsent_tokens = 0
                self.batches_out += 1
                return batch
            if self.failure is not None:
                raise self.failure
            if not self.running:
                return None


# Every stream's coalescer while it lives, for the gauge: summed when /metrics is read, so that the relay
# pays nothing per message for it.
_LIVE: weakref.WeakSet[_Coalescer] = weakref.WeakSet()


def _buffered_messages() -> float:
    return sum(len(state.pending) for state in list(_LIVE))


# prometheus_client's multiprocess mode (--api-server-count > 1) adds up files each process writes, and a
# function gauge writes none: there the gauge is left out rather than shown as a constant 0.
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    Gauge(
        "taco_llm_gateway_stream_buffered_messages",
        f"Engine messages held for streams whose clients have not taken them yet (at most {MAX_PENDING} a stream)",
        registry=REGISTRY,
    ).set_function(_buffered_messages)


async def coalesced(sources: list[AsyncIterator[engine_pb2.GenerateResponse]], *,
                    stream_interval: int = 1) -> AsyncGenerator[list[Sourced], None]:
    """The sources' messages in the order they arrive, handed on in batches: one event for every message
    that arrived while the previous one was being written, so that a client (or a gateway) that falls
    behind gets fewer, larger events instead of an ever longer queue. Each source is read by a task of
    its own, so reading never waits on the client's socket.

    While the gateway is busy (LOOP_LOAD) a batch also waits up to _MAX_DELAY for more messages: a
    saturated gateway would otherwise pay a whole event (JSON, ASGI send, a socket write) per token
    exactly when CPU is short. An idle one sends each message at once. With `stream_interval` N > 1
    (vLLM's --stream-interval) a batch waits for N tokens, except a source's first token, any message
    that is not a delta (`finished`) and the end. A source's APIError is raised after the messages that
    came before it; leaving the loop early stops every source."""
    LOOP_LOAD.watch()
    state = _Coalescer(len(sources), stream_interval)
    _LIVE.add(state)
    tasks = [asyncio.create_task(state.pump(i, s)) for i, s in enumerate(sources)]
    try:
        while (batch := await state.take()) is not None:
            yield batch
    finally:
        state.stop()
        for task in tasks:
            task.cancel()
