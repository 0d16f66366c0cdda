"""One Generate request that outlives the worker it started on.

Before the first message (`started`) a worker fault is retried on another worker, after a backoff; once
the stream is under way it is migrated: the same request goes to another worker with `resume` holding the
output tokens already relayed, and the new worker's stream (its `started` dropped) carries on where the
old one stopped, so the client reads one unbroken stream. Faults are told apart by gRPC status code and
ErrorReason only, never by message text.

A client fault (a bad field, an unknown model, a prompt too long...) is the client's answer at once and
never counts against the worker; a worker fault (the worker died, drained, broke, or ended the stream
early) feeds the worker's circuit breaker through `EnginePool.record_outcome`.

A worker can also fail silently: its engine wedged while its gRPC server still answers. A stream that
has waited `--stream-stall-timeout` for its worker's next message (its first included) while the worker
shows no sign of progress is abandoned as a worker fault: its call is cancelled (which aborts the request
in the engine) and it is retried or migrated like any other. The signs of progress are this gateway's
other streams on that worker (a message within the deadline), and the worker's own word: ready, with a
Load report whose `engine_stalled_ms` is under the deadline. The worker sends `started` only once the
engine has run the prompt, so a long prefill or a wait in the engine's queue is quiet: the worker's
report is what keeps such a stream.

Every retry and migration goes to a worker of the model the first attempt resolved, so a request that
names no model stays on the one it started on. A stream closed while it connects (by a sibling prompt's
failure, or its client leaving) releases the call it opened, and gives back a half-open breaker's trial
slot that its request held.

The stream also measures its request (time to first token, inter-token latency, end-to-end latency,
tokens, finish reasons: gateway/metrics.py) and puts its routing on the request's trace span.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from taco_llm.protos import engine_pb2
from taco_llm.protos.prefix_view import pack_digests
from taco_llm.protos.rich_status import Reason, details_of

from . import tracing
from .args import DEFAULT_STREAM_STALL_TIMEOUT
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
from .prefix_index import CHUNK_CHARS
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
# RETRIES' `code` for a stream that ended before its first message, and for one whose worker stalled.
EARLY_END = "EARLY_END"
STALLED = "STALLED"
# A stall check that finds the worker progressing looks again this soon (or at the deadline, if shorter).
_STALL_RECHECK_SECONDS = 1.0


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
    """--max-retries, --retry-backoff, --max-migrations, --stream-stall-timeout (0: no deadline)."""

    max_retries: int = 2
    retry_backoff: float = 0.05
    max_migrations: int = 2
    stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT

    def __post_init__(self) -> None:
        for flag, value in (("--max-retries", self.max_retries), ("--retry-backoff", self.retry_backoff),
                            ("--max-migrations", self.max_migrations),
                            ("--stream-stall-timeout", self.stream_stall_timeout)):
            if not value >= 0 or math.isinf(value):  # NaN compares false
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


class _Stalled(Exception):
    """The stream's call was cancelled by its stall deadline."""


def _cancelling() -> bool:
    """Whether the running task is being cancelled (a CancelledError then is the task's, not a call's)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _closed_while_connecting() -> APIError:
    # Nobody reads it: the stream's reader has gone (a sibling prompt failed, or the client left).
    return APIError(499, "the stream was closed while it connected to a worker", code="request_cancelled")


class EngineStream:
    """One Generate request's stream, whichever workers serve it; errors come out as APIError.

    Made by `open` (EngineCalls.generate), which returns once the first message (`started`) arrived, so
    that every refusal a worker makes before generating still becomes an HTTP status. `messages()` then
    yields `started`, the deltas and `finished` as one stream, migrating it on a worker fault.
    """

    # Set by `open` (the client by _connect) before it returns the stream.
    client: EngineClient
    model_name: str
    _meter: _Meter

    def __init__(self, pool: EnginePool, policy: FailoverPolicy, request: engine_pb2.GenerateRequest, *,
                 param_names: Mapping[str, str], route_key: RouteKey, arrival: float,
                 progress: dict[str, float] | None = None):
        self.pool = pool
        self.policy = policy
        self.request = request
        self.param_names = param_names
        self.route_key = route_key
        # The model as the client asked for it (None: the default), for the response's model name; the
        # route key is pinned to the model the first attempt resolved.
        self.asked_model = route_key.model
        self.n = request.sampling.n or 1
        self.retries = 0
        self.migrations = 0
        self._tried: list[EngineClient] = []
        # The call open now (and counted in its worker's in_flight), None between calls and once closed.
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
        # The stall deadline: worker address -> when this gateway last had a message from it on any stream
        # (time.perf_counter; shared by the streams of one EngineCalls), when this stream's call last sent
        # one, whether the stream waits on its call now, and the call it cancelled for a stall.
        self._progress = {} if progress is None else progress
        self._last_arrival = 0.0
        self._reading = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled_call: Any = None

    @property
    def model(self) -> str:
        return self.request.model

    @classmethod
    async def open(cls, pool: EnginePool, policy: FailoverPolicy, request: engine_pb2.GenerateRequest, *,
                   param_names: Mapping[str, str], route_key: RouteKey, arrival: float,
                   progress: dict[str, float] | None = None) -> EngineStream:
        stream = cls(pool, policy, request, param_names=param_names, route_key=route_key, arrival=arrival,
                     progress=progress)
        try:
            stream._first = await stream._connect(tries=policy.max_retries + 1, migrating=False)
        except BaseException:
            stream._stop_watchdog()
            raise
        finally:
            stream._annotate()
        stream.model_name = served_model_name(stream.asked_model, stream._info())
        stream._meter = _Meter(stream.model_name, stream._arrival)
        return stream

    def _annotate(self) -> None:
        tracing.annotate(self._span, self.route, retries=self.retries, migrations=self.migrations)

    def _info(self) -> engine_pb2.ModelInfo:
        info = self.client.info
        assert info is not None, "the pool routes only to workers whose ModelInfo it has"
        return info

    def _pin_model(self, client: EngineClient) -> None:
        """A request that names no model gets the first worker's; its retries and migrations then go to
        workers of that model only, not to whichever model is the pool's default by then."""
        if self.route_key.model:
            return
        info = client.info
        assert info is not None
        self.request.model = self.request.model or info.served_model_names[0]
        self.route_key = dataclasses.replace(self.route_key, model=self.request.model)

    async def _connect(self, *, tries: int, migrating: bool) -> engine_pb2.GenerateResponse:
        """Opens the call on a worker and returns its first message; a worker fault before it is tried
        on another worker (up to `tries` calls in all). Raises APIError: the client's fault at once,
        the pool's 404/503 when no worker is left, or a 503 once the tries are spent."""
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(self.policy.backoff(attempt - 1))
            if self._closed:
                raise _closed_while_connecting()
            route = self.pool.route(self.route_key, exclude=self._tried)
            client = route.client
            # Read right after routing: whether this request holds the worker's half-open trial.
            trial = client.breaker.trial_out()
            self._pin_model(client)
            if migrating:
                self.migrations += 1
            elif attempt:
                self.retries += 1
            self._name_prefix(route)
            call = self._open_call(client)
            try:
                first = await self._first_message(call)
            except _Stalled:
                code = STALLED
                logger.warning("engine %s sent request %s nothing for %.1f s, with no sign of progress: "
                               "abandoned before its first message", client.address, self.request.request_id,
                               self.policy.stream_stall_timeout)
            except grpc.aio.AioRpcError as error:
                self._release()
                if self._closed:
                    if trial is not None:
                        client.breaker.abandon(trial)
                    raise _closed_while_connecting() from None
                if not is_worker_fault(error):
                    self.pool.record_outcome(client, worker_fault=False)
                    raise from_grpc(error, self.param_names) from None
                code = error.code().name
                logger.warning("engine %s failed request %s before its first message: %s: %s", client.address,
                               self.request.request_id, code, error.details())
            except BaseException:
                # Cancelled (the client left), or closed (nobody reads it): that says nothing of the worker,
                # and a trial it held is free for the next request.
                self._release()
                if trial is not None:
                    client.breaker.abandon(trial)
                if self._closed and not _cancelling():
                    raise _closed_while_connecting() from None
                raise
            else:
                if first is not None:
                    self.pool.record_outcome(client, worker_fault=False)
                    self.pool.prefilled(route)
                    if self._closed:
                        # Closed while the first message came: the call must not run on for nobody.
                        self._release()
                        raise _closed_while_connecting()
                    self.route = route
                    return first
                code = EARLY_END
                logger.warning("engine %s ended request %s's stream before its first message", client.address,
                               self.request.request_id)
            self._release()
            self.pool.record_outcome(client, worker_fault=True)
            self._tried.append(client)
            if not migrating and attempt + 1 < tries:
                RETRIES.labels(code).inc()
        # Which workers and why is in the log above: their addresses and errors are not the client's.
        raise service_unavailable(f"the engine failed this request on {tries} worker(s) in turn; retry later",
                                  code="engine_failed")

    def _name_prefix(self, route: Route) -> None:
        """Sends the prompt's chunk digests to a worker that publishes what its cache holds in them."""
        if route.prefix_hashes and route.client.prefix_view_id:
            self.request.prefix_chunks.CopyFrom(engine_pb2.PrefixChunks(
                digests=pack_digests(route.prefix_hashes), chunk_chars=CHUNK_CHARS,
                text_chars=len(self.route_key.prefix_text)))
        else:
            self.request.ClearField("prefix_chunks")

    def _open_call(self, client: EngineClient) -> Any:
        """Starts the Generate call on `client`: counted in its in_flight until _release, and watched by
        the stall deadline."""
        call = client.stub.Generate(self.request, metadata=client.metadata)
        client.in_flight += 1
        self.client, self._call = client, call
        self._last_arrival = time.perf_counter()
        timeout = self.policy.stream_stall_timeout
        if timeout and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(timeout, self._check_stall)
        return call

    async def _first_message(self, call: Any) -> engine_pb2.GenerateResponse | None:
        """The call's first message that has a phase; None if the stream ended without one."""
        while True:
            message = await self._read(call)
            if message is grpc.aio.EOF:
                return None
            self._arrived(time.perf_counter())
            if message.WhichOneof("phase") is not None:
                return message  # type: ignore[no-any-return]

    async def _read(self, call: Any) -> Any:
        """The call's next message (or EOF); raises _Stalled where the stall deadline cancelled the call."""
        self._reading = True
        try:
            return await call.read()
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from a read of a call cancelled here: the task goes on.
            if self._stalled_call is call and not _cancelling():
                raise _Stalled from None
            raise
        except grpc.aio.AioRpcError:
            if self._stalled_call is call:
                raise _Stalled from None
            raise
        finally:
            self._reading = False

    def _arrived(self, now: float) -> None:
        self._last_arrival = now
        self._progress[self.client.address] = now

    def _check_stall(self) -> None:
        """The stall deadline's timer: cancels the call where the stream has waited the deadline for its
        next message and its worker shows no progress; else looks again when it could next be due."""
        self._watchdog = None
        call = self._call
        if call is None or self._closed:
            return  # no call to watch: the next _open_call arms it again
        timeout = self.policy.stream_stall_timeout
        now = time.perf_counter()
        quiet = now - self._last_arrival
        if quiet < timeout:
            delay = timeout - quiet
        elif not self._reading:
            delay = timeout  # the stream's reader is busy (a slow client): the worker is not waited on
        elif self._worker_progressing(now, timeout):
            delay = min(timeout, _STALL_RECHECK_SECONDS)
        else:
            logger.warning("engine %s sent request %s nothing for %.1f s, with no sign of progress: abandoning "
                           "the call", self.client.address, self.request.request_id, quiet)
            self._stalled_call = call
            call.cancel()  # the pending read raises; the engine aborts the request
            return
        self._watchdog = asyncio.get_running_loop().call_later(delay, self._check_stall)

    def _worker_progressing(self, now: float, timeout: float) -> bool:
        """Whether the stream's worker shows progress: another of this gateway's streams had a message
        from it within the deadline, or its recent Load report says its engine stepped within the
        deadline. Whether it is in rotation says nothing here: a draining worker, or a busy one whose
        health checks came late, still steps; a wedged engine shows a growing engine_stalled_ms, and a
        worker cut off or frozen whole stops reporting."""
        client = self.client
        if self._progress.get(client.address, 0.0) > now - timeout:
            return True
        report = self.pool.recent_report(client)
        return report is not None and report.engine_stalled_ms < timeout * 1000

    async def messages(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self._observe(first, time.perf_counter())
                yield first
            while True:
                if self._closed:
                    return  # closed by another task while this one waited to be resumed: nobody reads
                try:
                    message = await self._read(self._call)
                except asyncio.CancelledError:
                    if self._closed and not _cancelling():
                        return  # close() cancelled the call: nobody reads it any more
                    raise
                except _Stalled:
                    if self._finished:
                        return  # the answer is whole; only the end of the call did not come
                    failure = service_unavailable("the engine worker serving this stream stopped making "
                                                  "progress", code="engine_failed")
                except grpc.aio.AioRpcError as error:
                    if self._finished or self._closed:
                        return  # the answer is whole, or nobody reads it any more
                    if not is_worker_fault(error):
                        raise from_grpc(error, self.param_names) from None
                    failure = from_grpc(error, self.param_names)
                else:
                    if message is not grpc.aio.EOF:
                        now = time.perf_counter()
                        self._arrived(now)
                        self._observe(message, now)
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
                    self._observe(ending, time.perf_counter())
                    yield ending
                    return
        finally:
            self.close()

    def _observe(self, message: engine_pb2.GenerateResponse, now: float) -> None:
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
                self._meter.tokens(count, now)
        elif phase == "started":
            self._prompt_tokens = len(message.started.prompt_token_ids)
            self._meter.prompt_tokens = self._prompt_tokens
        elif phase == "finished":
            self._finished = True
            self._meter.finished(message.finished.usage, now)

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
            if self._closed:
                raise  # nobody reads it: no migration to count
            MIGRATIONS.labels("failed").inc()
            raise APIError(error.status, f"the stream's worker failed ({failure.message}) and no other worker "
                                         f"could continue it ({error.message})", param=error.param,
                           code=error.code, headers=error.headers) from None
        MIGRATIONS.labels("resumed").inc()
        return None

    def _release(self) -> None:
        """Ends the call open now, if any, and takes it off its worker's in_flight."""
        call = self._call
        if call is not None:
            self._call = None
            self.client.in_flight -= 1
            call.cancel()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def close(self) -> None:
        """Ends the call, also one still connecting; cancelling a running call aborts the request in the
        engine."""
        if not self._closed:
            self._closed = True
            self._release()
            self._stop_watchdog()
            self._meter.closed()
            if self.migrations:
                self._annotate()
