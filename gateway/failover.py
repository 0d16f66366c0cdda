"""One Generate request that outlives the worker it started on.

Before the first message (`started`) a worker fault is retried on another worker, after a backoff; once
the stream is under way it is migrated: the same request goes to another worker with `resume` holding the
output tokens already relayed, and the new worker's stream (its `started` dropped) carries on where the
old one stopped, so the client reads one unbroken stream. Faults are told apart by gRPC status code and
ErrorReason only, never by message text.

A client fault (a bad field, an unknown model, a prompt too long...) is the client's answer at once and
never counts against the worker; a worker fault (the worker died, drained, broke, or ended the stream
early) feeds the worker's circuit breaker through `EnginePool.record_outcome`.

The stream also measures its request (time to first token, inter-token latency, end-to-end latency,
tokens, finish reasons: gateway/metrics.py) and puts its routing on the request's trace span.
"""

from __future__ import annotations

import array
import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from taco_llm.protos import engine_pb2
from taco_llm.protos.rich_status import Reason, details_of

from . import tracing
from .engine_pool import EngineClient, EnginePool
from .errors import APIError, from_grpc, service_unavailable
from .from_engine import finish_reason
from .metrics import (
    E2E_LATENCY,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    MIGRATIONS,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    RETRIES,
    TIME_TO_FIRST_TOKEN,
    BatchedObserver,
)
from .rate_limits import charge_tokens
from .routing import Route, RouteKey

logger = logging.getLogger(__name__)

# Codes that answer the request, not the worker's health: what the request asked is wrong, or not
# allowed, whichever worker gets it. Every other code (UNAVAILABLE, INTERNAL, UNKNOWN, DEADLINE_EXCEEDED
# since the gateway sets no deadline, CANCELLED since the gateway never reads a call it cancelled, ...)
# is the worker's fault.
CLIENT_FAULT_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
})
_WORKER_GONE_REASONS = frozenset({Reason.Name(Reason.ENGINE_DEAD), Reason.Name(Reason.WORKER_DRAINING)})
# RETRIES' `code` for a stream that ended before its first message.
EARLY_END = "EARLY_END"


def _resumable_with_output(request: engine_pb2.GenerateRequest) -> bool:
    """Whether a worker can continue this request from output already relayed (engine.proto, Resume):
    one choice, no grammar (vLLM cannot advance one over tokens it did not sample), no stop strings (vLLM
    holds back text for them that the client never got, and one could span the resume point), and no
    presence or frequency penalty (vLLM applies them to output tokens only; resumed tokens are prompt)."""
    sampling = request.sampling
    if (sampling.n or 1) != 1 or sampling.stop or sampling.presence_penalty or sampling.frequency_penalty:
        return False
    return not _constrained(request)


def _constrained(request: engine_pb2.GenerateRequest) -> bool:
    """Whether the output follows a grammar: structured output, or a tool call forced through it
    (tool_choice "required" or a named function)."""
    if request.sampling.structured_output.WhichOneof("kind") is not None:
        return True
    if request.WhichOneof("input") != "chat" or not request.chat.HasField("tool_choice"):
        return False
    choice = request.chat.tool_choice
    return choice.WhichOneof("kind") == "struct_value" or choice.string_value == "required"


def is_worker_fault(error: grpc.aio.AioRpcError) -> bool:
    if error.code() not in CLIENT_FAULT_CODES:
        return True
    # A worker that is dying or draining says so by reason, whatever the code.
    return details_of(error).reason in _WORKER_GONE_REASONS


@dataclass(frozen=True, kw_only=True)
class FailoverPolicy:
    """--max-retries, --retry-backoff, --max-migrations."""

    max_retries: int = 2
    retry_backoff: float = 0.05
    max_migrations: int = 2

    def __post_init__(self) -> None:
        for flag, value in (("--max-retries", self.max_retries), ("--retry-backoff", self.retry_backoff),
                            ("--max-migrations", self.max_migrations)):
            if value < 0:
                raise ValueError(f"{flag} must be 0 or more, not {value}")

    def backoff(self, attempt: int) -> float:
        """The wait before retry `attempt` (0 first): doubling, with jitter so that the requests a dead
        worker dropped at once do not all land on the next one at once."""
        return self.retry_backoff * (2 ** attempt) * random.uniform(0.5, 1.0)


def served_model_name(asked: str | None, info: engine_pb2.ModelInfo) -> str:
    # As vLLM's: responses carry the worker's first served name whichever of its names was asked for
    # (--served-model-name A B); a LoRA adapter's name is carried as asked.
    adapters = {a.name for a in info.lora_adapters}
    base_names = [n for n in info.served_model_names if n not in adapters]
    return asked if asked and asked not in base_names else base_names[0]


class _Meter:
    """One request's latency and token metrics, labelled with the response's model name: a few clock
    reads per engine message, nothing per token."""

    __slots__ = ("arrival", "generated", "inter_token", "last", "model", "prompt_tokens")

    def __init__(self, model: str, arrival: float):
        self.model = model
        self.inter_token = BatchedObserver(INTER_TOKEN_LATENCY.labels(model))
        self.arrival = arrival
        self.last = 0.0  # 0: no token yet
        self.generated = 0
        # Known from `started`; charged to the tenant at the end whether or not `finished` arrived, so that a
        # client that leaves early cannot have long prompts prefilled for free.
        self.prompt_tokens = 0

    def tokens(self, count: int, now: float) -> None:
        if self.last:
            self.inter_token.observe((now - self.last) / count)
        else:
            TIME_TO_FIRST_TOKEN.labels(self.model).observe(now - self.arrival)
        self.last = now
        self.generated += count

    def finished(self, usage: engine_pb2.Usage, now: float) -> None:
        E2E_LATENCY.labels(self.model).observe(now - self.arrival)
        PROMPT_TOKENS.labels(self.model).inc(usage.prompt_tokens)
        self.prompt_tokens = usage.prompt_tokens

    def closed(self) -> None:
        self.inter_token.flush()
        if self.generated:
            GENERATION_TOKENS.labels(self.model).inc(self.generated)
        if self.prompt_tokens or self.generated:
            charge_tokens(self.prompt_tokens + self.generated)  # the tenant's --rate-limit-tokens-per-minute


class EngineStream:
    """One Generate request's stream, whichever workers serve it; errors come out as APIError.

    Made by `open` (EngineCalls.generate), which returns once the first message (`started`) arrived, so
    that every refusal a worker makes before generating still becomes an HTTP status. `messages()` then
    yields `started`, the deltas and `finished` as one stream, migrating it on a worker fault.
    """

    # Set by `open` (the client by the first successful _connect) before it returns the stream.
    client: EngineClient
    model_name: str
    _meter: _Meter

    def __init__(self, pool: EnginePool, policy: FailoverPolicy, request: engine_pb2.GenerateRequest, *,
                 param_names: Mapping[str, str], route_key: RouteKey, arrival: float):
        self.pool = pool
        self.policy = policy
        self.request = request
        self.param_names = param_names
        self.route_key = route_key
        self.n = request.sampling.n or 1
        self.retries = 0
        self.migrations = 0
        self._tried: list[EngineClient] = []
        self._call: Any = None
        self._first: engine_pb2.GenerateResponse | None = None
        self._finished = False
        self._closed = False
        self._resumable_with_output = _resumable_with_output(request)
        # Choice 0's output token ids relayed so far: a migration's resume. Kept only where one may happen.
        self._keep_ids = self._resumable_with_output and policy.max_migrations > 0
        # An array: 4 bytes a token, and extended from protobuf faster than a list.
        self._output_ids = array.array("I")
        self._relayed_delta = False
        self._choices_done = 0
        self._prompt_tokens = 0
        self._arrival = arrival
        # How the current worker was chosen, for the trace.
        self.route: Route | None = None
        self._span = tracing.current_span()

    @property
    def model(self) -> str:
        return self.request.model

    @classmethod
    async def open(cls, pool: EnginePool, policy: FailoverPolicy, request: engine_pb2.GenerateRequest, *,
                   param_names: Mapping[str, str], route_key: RouteKey, arrival: float) -> EngineStream:
        stream = cls(pool, policy, request, param_names=param_names, route_key=route_key, arrival=arrival)
        try:
            stream._first = await stream._connect(tries=policy.max_retries + 1, migrating=False)
        finally:
            stream._annotate()
        stream.model_name = served_model_name(route_key.model, stream._info())
        stream._meter = _Meter(stream.model_name, stream._arrival)
        return stream

    def _annotate(self) -> None:
        tracing.annotate(self._span, self.route, retries=self.retries, migrations=self.migrations)

    def _info(self) -> engine_pb2.ModelInfo:
        info = self.client.info
        assert info is not None, "the pool routes only to workers whose ModelInfo it has"
        return info

    async def _connect(self, *, tries: int, migrating: bool) -> engine_pb2.GenerateResponse:
        """Opens the call on a worker and returns its first message; a worker fault before it is tried
        on another worker (up to `tries` calls in all). Raises APIError: the client's fault at once,
        the pool's 404/503 when no worker is left, or a 503 once the tries are spent."""
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(self.policy.backoff(attempt - 1))
            route = self.pool.route(self.route_key, exclude=self._tried)
            client = route.client
            if not self.request.model:
                info = client.info
                assert info is not None
                self.request.model = info.served_model_names[0]
            if migrating:
                self.migrations += 1
            elif attempt:
                self.retries += 1
            call = client.stub.Generate(self.request, metadata=client.metadata)
            client.in_flight += 1
            try:
                first = await _first_message(call)
            except grpc.aio.AioRpcError as error:
                client.in_flight -= 1
                call.cancel()
                if not is_worker_fault(error):
                    self.pool.record_outcome(client, worker_fault=False)
                    raise from_grpc(error, self.param_names) from None
                code = error.code().name
                logger.warning("engine %s failed request %s before its first message: %s: %s", client.address,
                               self.request.request_id, code, error.details())
            except BaseException:
                # Cancelled (the client left): that says nothing of the worker.
                client.in_flight -= 1
                call.cancel()
                raise
            else:
                if first is not None:
                    self.pool.record_outcome(client, worker_fault=False)
                    self.route, self.client, self._call = route, client, call
                    return first
                client.in_flight -= 1
                code = EARLY_END
                logger.warning("engine %s ended request %s's stream before its first message", client.address,
                               self.request.request_id)
            self.pool.record_outcome(client, worker_fault=True)
            self._tried.append(client)
            if not migrating and attempt + 1 < tries:
                RETRIES.labels(code).inc()
        # Which workers and why is in the log above: their addresses and errors are not the client's.
        raise service_unavailable(f"the engine failed this request on {tries} worker(s) in turn; retry later",
                                  code="engine_failed")

    async def messages(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self._observe(first)
                yield first
            while True:
                try:
                    message = await self._call.read()
                except grpc.aio.AioRpcError as error:
                    if self._finished or self._closed:
                        return  # the answer is whole, or nobody reads it any more
                    if not is_worker_fault(error):
                        raise from_grpc(error, self.param_names) from None
                    failure = from_grpc(error, self.param_names)
                else:
                    if message is not grpc.aio.EOF:
                        self._observe(message)
                        yield message
                        continue
                    if self._finished:
                        return
                    logger.warning("engine %s ended request %s's stream before it finished", self.client.address,
                                   self.request.request_id)
                    failure = service_unavailable("the engine worker serving this stream stopped before it finished",
                                                  code="engine_failed")
                ending = await self._recover(failure)
                if ending is not None:
                    self._observe(ending)
                    yield ending
                    return
        finally:
            self.close()

    def _observe(self, message: engine_pb2.GenerateResponse) -> None:
        # Runs once per relayed message: each protobuf field is read once, and one choice (n = 1, the
        # common case) is read without iterating.
        phase = message.WhichOneof("phase")
        if phase == "delta":
            self._relayed_delta = True
            choices = message.delta.choices
            if len(choices) == 1:
                delta = choices[0]
                ids = delta.token_ids
                count = len(ids)
                if self._keep_ids:
                    self._output_ids.extend(ids)
                if delta.finish_reason:
                    self._choice_finished(delta.finish_reason)
            else:
                count = 0
                for delta in choices:
                    count += len(delta.token_ids)
                    if delta.finish_reason:
                        self._choice_finished(delta.finish_reason)
            if count:
                self._meter.tokens(count, time.perf_counter())
        elif phase == "started":
            self._prompt_tokens = len(message.started.prompt_token_ids)
            self._meter.prompt_tokens = self._prompt_tokens
        elif phase == "finished":
            self._finished = True
            self._meter.finished(message.finished.usage, time.perf_counter())

    def _choice_finished(self, reason: int) -> None:
        self._choices_done += 1
        REQUEST_SUCCESS.labels(self._meter.model, finish_reason(reason) or "unknown").inc()

    async def _recover(self, failure: APIError) -> engine_pb2.GenerateResponse | None:
        """After the stream's worker failed: continues the stream on another worker (None), or, where
        every choice had already finished, the `finished` message the worker did not send; raises
        `failure` (or why no worker could take the stream over) where neither can be done."""
        self.pool.record_outcome(self.client, worker_fault=True)
        self._tried.append(self.client)
        self._release()
        if self._choices_done >= self.n:
            # Resuming a finished choice would generate past its end; only the usage is missing.
            return engine_pb2.GenerateResponse(request_id=self.request.request_id, finished=engine_pb2.Finished(
                usage=engine_pb2.Usage(prompt_tokens=self._prompt_tokens, completion_tokens=self._meter.generated)))
        # Before any delta the client has seen nothing a fresh request would not repeat: any request will do.
        resumable = self._resumable_with_output or not self._relayed_delta
        budget = self.policy.max_migrations - self.migrations
        if not resumable or budget <= 0:
            MIGRATIONS.labels("not_resumable").inc()
            raise failure
        if self._relayed_delta:
            resume = self.request.resume
            del resume.output_token_ids[:]
            resume.output_token_ids.extend(self._output_ids)
        try:
            # The new call's `started` repeats what the client already has.
            await self._connect(tries=budget, migrating=True)
        except APIError as error:
            MIGRATIONS.labels("failed").inc()
            raise APIError(error.status, f"the stream's worker failed ({failure.message}) and no other worker "
                                         f"could continue it ({error.message})", param=error.param,
                           code=error.code, headers=error.headers) from None
        MIGRATIONS.labels("resumed").inc()
        return None

    def _release(self) -> None:
        if self._call is not None:
            self.client.in_flight -= 1
            self._call.cancel()
            self._call = None

    def close(self) -> None:
        """Ends the call; cancelling a running call aborts the request in the engine."""
        if not self._closed:
            self._closed = True
            self._release()
            self._meter.closed()
            if self.migrations:
                self._annotate()


async def _first_message(call: Any) -> engine_pb2.GenerateResponse | None:
    """The call's first message that has a phase; None if the stream ended without one."""
    while True:
        message = await call.read()
        if message is grpc.aio.EOF:
            return None
        if message.WhichOneof("phase") is not None:
            return message  # type: ignore[no-any-return]

