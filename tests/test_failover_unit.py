"""Retries before the first token, stream migration, and the per-request metrics and traces, through the
real gateway app against small in-process fake engines (no vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient

from taco_llm.gateway.app import GatewaySettings, create_app
from taco_llm.gateway.circuit_breaker import BreakerState, CircuitBreaker
from taco_llm.gateway.engine_pool import EngineClient, EnginePool
from taco_llm.gateway.failover import FailoverPolicy, is_worker_fault
from taco_llm.gateway.metrics import REGISTRY
from taco_llm.gateway.routing import RouteKey
from taco_llm.gateway.serving import EngineCalls
from taco_llm.protos import engine_pb2, engine_pb2_grpc, rich_status
from taco_llm.protos.engine_limits import ENGINE_SERVICE
from taco_llm.protos.rich_status import Reason

from .otlp_receiver import OtlpReceiver
from .support import free_port

MODEL = "fake-model"
PROMPT_IDS = [1, 2, 3]
DEFAULT_MAX_TOKENS = 8


def token_text(position: int) -> str:
    """The fake model's output depends on the position only, so a continuation is checkable."""
    return f"t{position} "


def token_id(position: int) -> int:
    return 100 + position


@dataclass
class Behaviour:
    # Abort with UNAVAILABLE before `started`.
    fail_before_start: bool = False
    # Refuse with INVALID_ARGUMENT (rich status, field `temperature`) before `started`.
    refuse: bool = False
    # Abort with UNAVAILABLE (reason ENGINE_DEAD) after sending this many tokens.
    die_after: int | None = None
    # Abort with UNAVAILABLE after the last delta, instead of sending `finished`.
    die_before_finished: bool = False
    # Refuse with INVALID_ARGUMENT (a client fault, mid-stream) after sending this many tokens.
    refuse_after: int | None = None
    # Seconds before `started` (a long prefill, or a queue), and between tokens.
    start_delay: float = 0.0
    token_delay: float = 0.0
    # Wedged: never sends `started` / nothing more after this many tokens, and says so in GetLoad
    # (engine_stalled_ms) as a worker whose engine stopped stepping does.
    hang_before_start: bool = False
    hang_after: int | None = None
    # Before failing (fail_before_start, die_after), report NOT_SERVING and wait until the gateway has
    # seen it: a worker that goes down for good.
    unready_before_failing: bool = False
    # NOT_SERVING on health during start_delay (a draining worker, or one whose busy health checks miss
    # their deadlines), while its engine steps (GetLoad: engine_stalled_ms 0).
    unready_while_starting: bool = False


@dataclass
class FakeEngine(engine_pb2_grpc.EngineServicer):
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list[engine_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    models: list[str] = field(default_factory=lambda: [MODEL])
    health: health.aio.HealthServicer | None = None
    # Generate calls the gateway cancelled, and those still running.
    cancelled: int = 0
    running: int = 0
    # Since when the engine has been wedged (time.monotonic), for GetLoad's engine_stalled_ms.
    hung_since: float | None = None

    async def Generate(self, request: engine_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateResponse]:
        self.running += 1
        try:
            async for message in self._generate(request, context):
                yield message
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def _hang(self) -> None:
        self.hung_since = time.monotonic()
        await asyncio.sleep(3600)

    async def _fail(self, context: grpc.aio.ServicerContext, reason: int | None = None) -> None:
        if self.behaviour.unready_before_failing:
            assert self.health is not None
            await self.health.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            await asyncio.sleep(1.0)  # the gateway's health checks (every 0.2 s) see it
        if reason is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the fake engine is down")
        await rich_status.abort(context, grpc.StatusCode.UNAVAILABLE, "the engine died", reason)

    async def _generate(self, request: engine_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateResponse]:
        self.requests.append(engine_pb2.GenerateRequest.FromString(request.SerializeToString()))
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        b = self.behaviour
        if request.model not in self.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this worker does not serve {request.model!r}")
        if b.fail_before_start:
            await self._fail(context)
        if b.refuse:
            await rich_status.invalid_argument(context, "temperature must be at least 0", "temperature")
        if b.hang_before_start:
            await self._hang()
        if b.unready_while_starting and self.health is not None:
            await self.health.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(b.start_delay)
        if b.unready_while_starting and self.health is not None:
            await self.health.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        resumed = list(request.resume.output_token_ids)
        # The contract: resume holds the choice's tokens already sent, in order.
        assert resumed == [token_id(i) for i in range(len(resumed))], resumed
        n = request.sampling.n or 1
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        yield engine_pb2.GenerateResponse(request_id=request.request_id,
                                          started=engine_pb2.Started(prompt_token_ids=PROMPT_IDS))
        for sent, position in enumerate(range(len(resumed), max_tokens)):
            if sent:
                await asyncio.sleep(b.token_delay)
            if b.die_after is not None and sent == b.die_after:
                await self._fail(context, Reason.ENGINE_DEAD)
            if b.refuse_after is not None and sent == b.refuse_after:
                await rich_status.invalid_argument(context, "a token went out of range", "logit_bias")
            if b.hang_after is not None and sent == b.hang_after:
                await self._hang()
            last = position == max_tokens - 1
            yield engine_pb2.GenerateResponse(request_id=request.request_id, delta=engine_pb2.Delta(choices=[
                engine_pb2.ChoiceDelta(
                    index=i, text=token_text(position), token_ids=[token_id(position)],
                    finish_reason=engine_pb2.FINISH_REASON_LENGTH if last else engine_pb2.FINISH_REASON_UNSPECIFIED)
                for i in range(n)]))
        if b.die_before_finished:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine died")
        yield engine_pb2.GenerateResponse(request_id=request.request_id, finished=engine_pb2.Finished(
            usage=engine_pb2.Usage(prompt_tokens=len(PROMPT_IDS), completion_tokens=max_tokens * n)))

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        return engine_pb2.ModelInfo(served_model_names=self.models, max_model_len=2048, vocab_size=1000)

    async def GetLoad(self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> engine_pb2.Load:
        stalled = 0 if self.hung_since is None else int((time.monotonic() - self.hung_since) * 1000)
        return engine_pb2.Load(num_running_requests=self.running, engine_stalled_ms=stalled)


@contextlib.asynccontextmanager
async def fake_engines(*behaviours: Behaviour,
                       models: list[list[str]] | None = None) -> AsyncIterator[list[tuple[str, FakeEngine]]]:
    """One grpc.aio server per behaviour, listed by address in the order round_robin visits them.
    `models`: what each serves, in that order (default: MODEL)."""
    servers, engines = [], []
    for _ in behaviours:
        server = grpc.aio.server()
        engine = FakeEngine()
        engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
        engine.health = health.aio.HealthServicer()
        await engine.health.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(engine.health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        engines.append((f"127.0.0.1:{port}", engine))
    # round_robin goes by address: the behaviours are handed out in that order.
    ordered = sorted(engines, key=lambda pair: pair[0])
    for (_, engine), behaviour in zip(ordered, behaviours, strict=True):
        engine.behaviour = behaviour
    for (_, engine), names in zip(ordered, models or [], strict=False):
        engine.models = names
    try:
        yield ordered
    finally:
        for server in servers:
            await server.stop(grace=None)


@dataclass
class Outcomes:
    """What the pool's breakers were fed, and the pool."""

    pool: EnginePool
    fed: list[tuple[str, bool]] = field(default_factory=list)

    def in_flight(self) -> dict[str, int]:
        return {c.address: c.in_flight for c in self.pool.clients}


@contextlib.asynccontextmanager
async def gateway(engines: list[tuple[str, FakeEngine]],
                  **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Outcomes]]:
    addresses = [a for a, _ in engines]
    pool = EnginePool(addresses, health_interval=0.2, routing="round_robin")
    outcomes = Outcomes(pool)
    record = pool.record_outcome

    def recording(client: EngineClient, *, worker_fault: bool) -> None:
        outcomes.fed.append((client.address, worker_fault))
        record(client, worker_fault=worker_fault)

    pool.record_outcome = recording  # type: ignore[method-assign]
    app = create_app(GatewaySettings(engines=addresses, routing="round_robin", retry_backoff=0.001, **settings),
                     pool)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
            yield client, outcomes


def counter(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def sse_events(raw: str) -> list[Any]:
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def streamed_text(events: list[Any]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in events
                   if isinstance(c, dict) and c.get("choices"))


EXPECTED_TEXT = "".join(token_text(i) for i in range(DEFAULT_MAX_TOKENS))


# --- classification, without a server ------------------------------------------------------------

def _rpc_error(code: grpc.StatusCode, reason: int | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if reason is not None:
        rich = rich_status.status(code, "x", reason)
        trailing = grpc.aio.Metadata(*rich.trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="x")


@pytest.mark.parametrize(("code", "worker"), [
    (grpc.StatusCode.UNAVAILABLE, True), (grpc.StatusCode.INTERNAL, True), (grpc.StatusCode.UNKNOWN, True),
    (grpc.StatusCode.DEADLINE_EXCEEDED, True), (grpc.StatusCode.CANCELLED, True),
    (grpc.StatusCode.INVALID_ARGUMENT, False), (grpc.StatusCode.NOT_FOUND, False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False), (grpc.StatusCode.ALREADY_EXISTS, False),
    (grpc.StatusCode.FAILED_PRECONDITION, False), (grpc.StatusCode.OUT_OF_RANGE, False),
    (grpc.StatusCode.UNAUTHENTICATED, False),
])
def test_faults_are_told_apart_by_code(code: grpc.StatusCode, worker: bool) -> None:
    assert is_worker_fault(_rpc_error(code)) is worker


def test_a_draining_worker_is_a_worker_fault_by_reason() -> None:
    assert is_worker_fault(_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, Reason.WORKER_DRAINING))
    assert not is_worker_fault(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, Reason.FIELD_INVALID))


def test_backoff_doubles_with_jitter_and_flags_are_checked() -> None:
    policy = FailoverPolicy(retry_backoff=0.1)
    for attempt in range(4):
        assert 0.05 * 2 ** attempt <= policy.backoff(attempt) <= 0.1 * 2 ** attempt
    with pytest.raises(ValueError, match="--max-retries"):
        FailoverPolicy(max_retries=-1)


# --- through the app -------------------------------------------------------------------------------

async def test_a_worker_that_fails_before_the_first_token_is_retried_on_another() -> None:
    before = counter("taco_llm_router_retries_total", {"code": "UNAVAILABLE"})
    async with fake_engines(Behaviour(fail_before_start=True), Behaviour()) as engines, \
            gateway(engines) as (client, outcomes):
        reply = await client.post("/v1/chat/completions", json=chat_body())
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == EXPECTED_TEXT
        (bad, bad_engine), (good, good_engine) = engines
        assert len(bad_engine.requests) == 1 and len(good_engine.requests) == 1
        assert outcomes.fed == [(bad, True), (good, False)]
    assert counter("taco_llm_router_retries_total", {"code": "UNAVAILABLE"}) == before + 1


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stream_whose_worker_dies_continues_on_another(stream: bool) -> None:
    before = counter("taco_llm_router_migrations_total", {"outcome": "resumed"})
    async with fake_engines(Behaviour(die_after=5), Behaviour()) as engines, \
            gateway(engines) as (client, outcomes):
        body = chat_body(stream=stream, logprobs=False, stream_options={"include_usage": True} if stream else None)
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        (dead, _), (_, alive_engine) = engines
        resume = alive_engine.requests[0].resume
        assert list(resume.output_token_ids) == [token_id(i) for i in range(5)]
        assert alive_engine.requests[0].request_id.startswith("chatcmpl-")
        if stream:
            events = sse_events(reply.text)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
            assert streamed_text(events) == EXPECTED_TEXT, "no token lost or repeated"
            usage = events[-2]["usage"]
        else:
            assert reply.json()["choices"][0]["message"]["content"] == EXPECTED_TEXT
            usage = reply.json()["usage"]
        assert usage["completion_tokens"] == DEFAULT_MAX_TOKENS and usage["prompt_tokens"] == len(PROMPT_IDS)
        assert (dead, True) in outcomes.fed
    assert counter("taco_llm_router_migrations_total", {"outcome": "resumed"}) == before + 1


async def test_a_worker_lost_after_every_choice_finished_is_not_resumed() -> None:
    async with fake_engines(Behaviour(die_before_finished=True), Behaviour()) as engines, \
            gateway(engines) as (client, _):
        body = chat_body(stream=True, n=2, stream_options={"include_usage": True})
        reply = await client.post("/v1/chat/completions", json=body)
        events = sse_events(reply.text)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
        assert events[-2]["usage"]["completion_tokens"] == 2 * DEFAULT_MAX_TOKENS
        assert events[-2]["usage"]["prompt_tokens"] == len(PROMPT_IDS)
        assert not engines[1][1].requests, "a finished choice is not continued"


async def test_a_refusal_is_the_clients_answer_and_no_fault_of_the_worker() -> None:
    retries = sum(counter("taco_llm_router_retries_total", {"code": c}) for c in ("INVALID_ARGUMENT", "UNAVAILABLE"))
    async with fake_engines(Behaviour(refuse=True), Behaviour()) as engines, \
            gateway(engines) as (client, outcomes):
        reply = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "temperature"
        (refusing, _), (_, other) = engines
        assert not other.requests, "a client's fault is not retried"
        assert outcomes.fed == [(refusing, False)]
    assert sum(counter("taco_llm_router_retries_total", {"code": c})
               for c in ("INVALID_ARGUMENT", "UNAVAILABLE")) == retries


def _assert_no_internals(message: str, engines: list[tuple[str, FakeEngine]]) -> None:
    """A client reads what failed in its terms: no worker address, no worker's or gRPC library's message
    for a server-side fault (the gateway logs those)."""
    assert message
    for address, _ in engines:
        assert address not in message and address.rpartition(":")[2] not in message, message
    for internal in ("the fake engine is down", "the engine died", "UNAVAILABLE"):
        assert internal not in message, message


async def test_no_worker_left_before_the_first_token_is_a_503_with_retry_after() -> None:
    async with fake_engines(Behaviour(fail_before_start=True), Behaviour(fail_before_start=True)) as engines, \
            gateway(engines, max_retries=5) as (client, _):
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert reply.status_code == 503, reply.text
        assert int(reply.headers["retry-after"]) >= 1
        _assert_no_internals(reply.json()["error"]["message"], engines)


async def test_every_worker_dying_mid_stream_ends_with_an_error_event() -> None:
    before = counter("taco_llm_router_migrations_total", {"outcome": "failed"})
    async with fake_engines(Behaviour(die_after=3), Behaviour(die_after=2)) as engines, \
            gateway(engines) as (client, _):
        reply = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert reply.status_code == 200
        events = sse_events(reply.text)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
        assert events[-2]["error"]["code"] in ("no_engine_ready", "engine_failed")
        _assert_no_internals(events[-2]["error"]["message"], engines)
        # What was sent before the failure is whole: no repeats from the continuation that also died.
        assert streamed_text(events) == "".join(token_text(i) for i in range(5))
    assert counter("taco_llm_router_migrations_total", {"outcome": "failed"}) == before + 1


async def test_a_completion_stream_ends_with_an_error_event_too() -> None:
    async with fake_engines(Behaviour(die_after=3)) as engines, gateway(engines) as (client, _):
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
        events = sse_events(reply.text)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "".join(token_text(i) for i in range(3))


async def test_n_above_one_is_not_resumed_mid_stream() -> None:
    before = counter("taco_llm_router_migrations_total", {"outcome": "not_resumable"})
    async with fake_engines(Behaviour(die_after=2), Behaviour()) as engines, gateway(engines) as (client, _):
        reply = await client.post("/v1/chat/completions", json=chat_body(stream=True, n=2))
        events = sse_events(reply.text)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
        assert not engines[1][1].requests, "nothing was resubmitted"
    assert counter("taco_llm_router_migrations_total", {"outcome": "not_resumable"}) == before + 1


@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}}, {"stop": ["never"]},
                                   {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}],
                         ids=["structured_output", "stop", "presence_penalty", "frequency_penalty"])
async def test_what_a_worker_cannot_continue_is_not_resumed_mid_stream(extra: dict[str, object]) -> None:
    """A worker cannot continue a grammar from tokens it did not sample, find a stop string across the
    resume point, or penalise resumed tokens as output (engine.proto, Resume), so the gateway ends such a
    stream with an error event rather than resubmitting it."""
    before = counter("taco_llm_router_migrations_total", {"outcome": "not_resumable"})
    async with fake_engines(Behaviour(die_after=2), Behaviour()) as engines, gateway(engines) as (client, _):
        body = chat_body(stream=True, **extra)
        events = sse_events((await client.post("/v1/chat/completions", json=body)).text)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
        assert not engines[1][1].requests, "nothing was resubmitted"
    assert counter("taco_llm_router_migrations_total", {"outcome": "not_resumable"}) == before + 1


async def test_request_metrics_carry_the_response_model_name() -> None:
    def sample(name: str, **labels: str) -> float:
        return counter(name, {"model_name": MODEL, **labels})

    before = {"ttft": sample("vllm:time_to_first_token_seconds_count"),
              "itl": sample("vllm:inter_token_latency_seconds_count"),
              "e2e": sample("vllm:e2e_request_latency_seconds_count"),
              "gen": sample("vllm:generation_tokens_total"), "prompt": sample("vllm:prompt_tokens_total"),
              "ok": sample("vllm:request_success_total", finished_reason="length")}
    async with fake_engines(Behaviour()) as engines, gateway(engines) as (client, _):
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                            "max_tokens": DEFAULT_MAX_TOKENS})
        assert reply.status_code == 200
    assert sample("vllm:time_to_first_token_seconds_count") == before["ttft"] + 1
    assert sample("vllm:inter_token_latency_seconds_count") == before["itl"] + DEFAULT_MAX_TOKENS - 1
    assert sample("vllm:e2e_request_latency_seconds_count") == before["e2e"] + 1
    assert sample("vllm:generation_tokens_total") == before["gen"] + DEFAULT_MAX_TOKENS
    assert sample("vllm:prompt_tokens_total") == before["prompt"] + len(PROMPT_IDS)
    assert sample("vllm:request_success_total", finished_reason="length") == before["ok"] + 1


async def test_traces_carry_the_routing_and_reach_the_worker() -> None:
    receiver = OtlpReceiver(free_port())
    receiver.start()
    try:
        async with fake_engines(Behaviour(fail_before_start=True), Behaviour()) as engines:
            async with gateway(engines, otlp_traces_endpoint=receiver.endpoint) as (client, _):
                reply = await client.post("/v1/chat/completions", json=chat_body())
                assert reply.status_code == 200, reply.text
            # The app's lifespan has ended: its spans were flushed.
            (good, good_engine) = engines[1]
            traceparent = good_engine.metadata[0]["traceparent"]
            spans = list(receiver.spans())
            routed = [s for s in spans if s.service == "taco-llm-gateway" and "taco_llm.retries" in s.attributes]
            assert len(routed) == 1, spans
            attributes = routed[0].attributes
            assert attributes["taco_llm.retries"] == 1 and attributes["taco_llm.migrations"] == 0
            assert attributes["taco_llm.worker.address"] == good
            assert attributes["taco_llm.routing.policy"] == "round_robin"
            # W3C traceparent: version-traceid-spanid-flags; the worker joins the request's trace.
            assert traceparent.split("-")[1] == routed[0].trace_id
            assert any(s.name.endswith("/Generate") and s.trace_id == routed[0].trace_id for s in spans)
    finally:
        receiver.stop()
        GrpcAioInstrumentorClient().uninstrument()


# --- a wedged worker: the stall deadline (--stream-stall-timeout) ----------------------------------

STALL = 0.5  # the tests' --stream-stall-timeout, seconds


async def _post_within(client: httpx.AsyncClient, seconds: float, path: str, body: dict[str, Any]) -> httpx.Response:
    """The reply, or a failure naming the hang (a wedged worker hangs the request for ever)."""
    try:
        return await asyncio.wait_for(client.post(path, json=body), seconds)
    except TimeoutError:
        raise AssertionError(f"no answer within {seconds} s: the request hangs on the wedged worker") from None


async def test_a_worker_wedged_before_the_first_message_is_abandoned_for_another() -> None:
    before = counter("taco_llm_router_retries_total", {"code": "STALLED"})
    async with fake_engines(Behaviour(hang_before_start=True), Behaviour()) as engines, \
            gateway(engines, stream_stall_timeout=STALL) as (client, outcomes):
        reply = await _post_within(client, 10, "/v1/chat/completions", chat_body())
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == EXPECTED_TEXT
        (wedged, wedged_engine), (good, _) = engines
        assert outcomes.fed == [(wedged, True), (good, False)], "a stall is the worker's fault"
        await _until(lambda: wedged_engine.cancelled == 1, "the wedged worker's call was not cancelled")
        assert outcomes.in_flight() == {wedged: 0, good: 0}
    assert counter("taco_llm_router_retries_total", {"code": "STALLED"}) == before + 1


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stream_whose_worker_wedges_midway_continues_on_another(stream: bool) -> None:
    async with fake_engines(Behaviour(hang_after=3), Behaviour()) as engines, \
            gateway(engines, stream_stall_timeout=STALL) as (client, outcomes):
        reply = await _post_within(client, 10, "/v1/chat/completions", chat_body(stream=stream))
        assert reply.status_code == 200, reply.text
        text = streamed_text(sse_events(reply.text)) if stream else reply.json()["choices"][0]["message"]["content"]
        assert text == EXPECTED_TEXT, "no token lost or repeated"
        (wedged, wedged_engine), (_, alive_engine) = engines
        assert list(alive_engine.requests[0].resume.output_token_ids) == [token_id(i) for i in range(3)]
        assert (wedged, True) in outcomes.fed
        await _until(lambda: wedged_engine.cancelled == 1, "the wedged worker's call was not cancelled")


async def test_a_slow_worker_that_reports_progress_is_not_abandoned() -> None:
    """A first message later than the deadline (a long prefill, a queue) from a worker whose engine steps
    (engine_stalled_ms 0) is waited for: no retry, no fault."""
    async with fake_engines(Behaviour(start_delay=4 * STALL), Behaviour()) as engines, \
            gateway(engines, stream_stall_timeout=STALL) as (client, outcomes):
        reply = await _post_within(client, 10, "/v1/chat/completions", chat_body(stream=True))
        assert streamed_text(sse_events(reply.text)) == EXPECTED_TEXT
        (slow, _), (_, other) = engines
        assert outcomes.fed == [(slow, False)] and not other.requests


async def test_a_worker_out_of_rotation_whose_engine_steps_is_not_abandoned() -> None:
    """Not ready (draining, or a busy worker's health checks missing their deadlines) is no sign of a stall:
    its streams are waited for while its Load reports say its engine steps."""
    async with fake_engines(Behaviour(start_delay=6 * STALL, unready_while_starting=True), Behaviour()) as engines, \
            gateway(engines, stream_stall_timeout=STALL) as (client, outcomes):
        reply = await _post_within(client, 10, "/v1/chat/completions", chat_body(stream=True))
        assert streamed_text(sse_events(reply.text)) == EXPECTED_TEXT
        (slow, slow_engine), (_, other) = engines
        assert outcomes.fed == [(slow, False)] and not other.requests and slow_engine.cancelled == 0


async def test_the_stall_deadline_is_off_at_zero_and_checked() -> None:
    with pytest.raises(ValueError, match="--stream-stall-timeout"):
        FailoverPolicy(stream_stall_timeout=-1)
    with pytest.raises(ValueError, match="--stream-stall-timeout"):
        FailoverPolicy(stream_stall_timeout=float("nan"))
    async with fake_engines(Behaviour(hang_before_start=True), Behaviour()) as engines, \
            gateway(engines, stream_stall_timeout=0) as (client, outcomes):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.post("/v1/chat/completions", json=chat_body()), 4 * STALL)
        assert outcomes.fed == []


async def _until(condition: Any, failure: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.02)


# --- a stream closed while it connects releases what it opened ------------------------------------

async def test_a_batch_prompt_migrating_when_another_fails_releases_its_new_call() -> None:
    """Non-streaming /v1/completions with two prompts: prompt 1's worker dies and its stream migrates
    to a worker slow to start; meanwhile prompt 0 is refused mid-stream, which ends the request and
    closes prompt 1's stream while its _connect still waits. That stream must release the call its
    connect opens: else the worker counts it in flight for ever, and generates it for nobody."""
    async with fake_engines(Behaviour(refuse_after=2, token_delay=0.3), Behaviour(die_after=1),
                            Behaviour(start_delay=1.0, token_delay=0.2)) as engines, \
            gateway(engines) as (client, outcomes):
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
        assert reply.status_code == 400, reply.text
        slow_engine = engines[2][1]
        assert slow_engine.requests, "prompt 1 did not migrate to the slow worker"
        await _until(lambda: slow_engine.running == 0, "the migrated call runs on for nobody")
        assert slow_engine.cancelled == 1
        await asyncio.sleep(1.5)  # past the slow worker's start: a late connect would count it now
        assert all(count == 0 for count in outcomes.in_flight().values()), outcomes.in_flight()


# --- the model a request without one resolved to stays its model ----------------------------------

@pytest.mark.parametrize("phase", ["retry", "migration"])
async def test_a_request_without_a_model_stays_on_the_model_it_was_routed_to(phase: str) -> None:
    """Two models in the fleet; a request names none, so it goes to the first worker's model (m1). That
    worker goes down for good: the retry or migration must go to the other worker of m1, not to the
    worker that is now first in the pool (m2)."""
    failing = Behaviour(unready_before_failing=True, **({"fail_before_start": True} if phase == "retry"
                                                         else {"die_after": 3}))
    async with fake_engines(failing, Behaviour(), Behaviour(), models=[["m1"], ["m2"], ["m1"]]) as engines, \
            gateway(engines) as (client, _):
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        reply = await _post_within(client, 10, "/v1/chat/completions", body)
        assert reply.status_code == 200, reply.text
        events = sse_events(reply.text)
        assert not any("error" in e for e in events if isinstance(e, dict)), events[-2:]
        assert streamed_text(events) == EXPECTED_TEXT
        assert {e["model"] for e in events if isinstance(e, dict)} == {"m1"}
        (_, _), (_, other_model), (_, same_model) = engines
        assert not other_model.requests, "a request for m1 went to a worker of m2"
        assert [r.model for r in same_model.requests] == ["m1"]


# --- a half-open worker's trial slot -------------------------------------------------------------

def test_an_abandoned_trial_frees_its_slot_at_once() -> None:
    breaker = CircuitBreaker(threshold=1, base_cooldown=5.0, trial_timeout=30.0)
    breaker.record(0.0, worker_fault=True)
    assert breaker.state(6.0) is BreakerState.HALF_OPEN
    breaker.routed(6.0)
    trial = breaker.trial_out()
    assert trial is not None and not breaker.allows(6.5)
    breaker.abandon(trial)
    assert breaker.allows(6.5) and breaker.state(6.5) is BreakerState.HALF_OPEN
    # A trial that timed out and was replaced is no longer the abandoned request's to free.
    breaker.routed(7.0)
    old = breaker.trial_out()
    assert old is not None
    breaker.routed(40.0)
    breaker.abandon(old)
    assert not breaker.allows(41.0), "the newer trial's slot was freed by the old one's caller"
    # A request routed while the breaker was closed is no trial.
    closed = CircuitBreaker()
    closed.routed(0.0)
    assert closed.trial_out() is None


@pytest.mark.parametrize("phase", ["first attempt", "migration"])
async def test_a_cancelled_trial_request_frees_the_half_open_slot(phase: str) -> None:
    """The client of the request that took a half-open worker's trial leaves before the worker answered
    (or, for a migration, before the new worker's first message): the next request may try the worker
    at once, not 30 s (trial_timeout) later."""
    behaviours = (Behaviour(start_delay=30),) if phase == "first attempt" else \
        (Behaviour(die_after=2), Behaviour(start_delay=30))
    async with fake_engines(*behaviours) as engines, gateway(engines) as (_, outcomes):
        pool = outcomes.pool
        trial_worker = next(c for c in pool.clients if c.address == engines[-1][0])
        engines_calls = EngineCalls(pool, retry_backoff=0.001)

        def half_open() -> None:
            trial_worker.breaker.opened_at = pool.clock() - trial_worker.breaker.cooldown - 1

        async def run() -> None:
            stream = await engines_calls.generate(
                engine_pb2.GenerateRequest(model=MODEL, text="x"), {}, RouteKey(model=MODEL))
            half_open()  # the migration's target is the trial
            async for _ in stream.messages():
                pass

        if phase == "first attempt":
            half_open()
        task = asyncio.create_task(run())
        await _until(lambda: bool(engines[-1][1].requests), "the trial request was not sent")
        assert not trial_worker.breaker.allows(pool.clock()), "the trial is out"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert trial_worker.breaker.state(pool.clock()) is BreakerState.HALF_OPEN
        assert trial_worker.breaker.allows(pool.clock()), "the cancelled trial still holds the slot"
        assert all(count == 0 for count in outcomes.in_flight().values()), outcomes.in_flight()


def test_the_stall_deadline_flag_reaches_the_gateway_and_is_checked() -> None:
    from taco_llm.gateway.__main__ import parse

    assert parse(["--engine", "a:1"]).stream_stall_timeout == 30
    assert parse(["--engine", "a:1", "--stream-stall-timeout", "7.5"]).stream_stall_timeout == 7.5
    assert parse(["--engine", "a:1", "--stream-stall-timeout", "0"]).stream_stall_timeout == 0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse(["--engine", "a:1", "--stream-stall-timeout", bad])
