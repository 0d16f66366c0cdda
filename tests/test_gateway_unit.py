"""The gateway's translation and error mapping on fixed inputs (no engine needed)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from taco_llm.gateway import to_engine
from taco_llm.gateway.app import GatewaySettings, create_app
from taco_llm.gateway.engine_pool import EngineClient, EnginePool
from taco_llm.gateway.errors import APIError, from_grpc
from taco_llm.gateway.from_engine import ChoiceState, TokenText, finish_reason, prompt_logprobs_json
from taco_llm.gateway.protocol import ChatCompletionRequest, CompletionRequest
from taco_llm.gateway.serving import EngineCalls
from taco_llm.gateway.serving_chat import ServingChat
from taco_llm.gateway.serving_completion import ServingCompletion
from taco_llm.gateway.serving_models import ServingModels
from taco_llm.protos import engine_pb2, rich_status
from taco_llm.protos.rich_status import Reason


def test_gateway_imports_neither_torch_nor_vllm() -> None:
    code = ("import sys, taco_llm.gateway.app, taco_llm.gateway.__main__; "
            "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chat_request_translation() -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "temperature": 0.5, "max_completion_tokens": 7, "stop": "x", "logprobs": True, "top_logprobs": 2,
        "seed": 3, "logit_bias": {"5": 1.5}, "response_format": {"type": "json_object"},
    })
    request = to_engine.chat_request(body, "id-1")
    assert request.request_id == "id-1" and request.model == "m"
    assert request.chat.messages[0].content_parts[0].text == "hi"
    s = request.sampling
    assert s.temperature == 0.5 and s.max_tokens == 7 and list(s.stop) == ["x"]
    assert s.logprobs == 2 and s.seed == 3 and dict(s.logit_bias) == {5: 1.5}
    assert s.structured_output.json_object
    assert not s.HasField("top_p"), "unset fields stay unset for the model's defaults"


def test_completion_prompt_forms() -> None:
    assert to_engine.completion_prompts("a") == ["a"]
    assert to_engine.completion_prompts([1, 2]) == [[1, 2]]
    assert to_engine.completion_prompts([[1], [2]]) == [[1], [2]]
    assert to_engine.completion_prompts(["a", "b"]) == ["a", "b"]
    with pytest.raises(APIError) as excinfo:
        to_engine.completion_prompts([])
    assert excinfo.value.param == "prompt"


def test_two_structured_output_kinds_are_refused() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]})
    with pytest.raises(APIError) as excinfo:
        to_engine.completion_request(body, "x", "id")
    assert excinfo.value.status == 400 and "only one kind" in excinfo.value.message


def test_bad_logit_bias_key_is_named() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"abc": 1}})
    with pytest.raises(APIError) as excinfo:
        to_engine.completion_request(body, "x", "id")
    assert excinfo.value.param == "logit_bias"


@pytest.mark.parametrize(
    ("code", "status"),
    [(grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.NOT_FOUND, 404),
     (grpc.StatusCode.RESOURCE_EXHAUSTED, 400), (grpc.StatusCode.UNAVAILABLE, 503),
     (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.INTERNAL, 500)],
)
def test_grpc_status_to_http(code: grpc.StatusCode, status: int) -> None:
    rich = rich_status.status(code, "max_tokens must be at least 1", Reason.FIELD_INVALID, "max_tokens")
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*rich.trailing_metadata),
                                 details=rich.details)
    api = from_grpc(error, to_engine.CHAT_PARAMS)
    assert api.status == status
    assert api.param == "max_completion_tokens"
    body = api.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def _client(address: str, names: list[str], in_flight: int) -> EngineClient:
    client = EngineClient(address, None, None, None)  # type: ignore[arg-type]
    client.info = engine_pb2.ModelInfo(served_model_names=names)
    client.ready = True
    client.in_flight = in_flight
    return client


def test_pool_routes_to_least_busy_worker_of_the_model() -> None:
    pool = EnginePool(["a:1"])
    pool.clients = [_client("a:1", ["m"], 3), _client("b:1", ["m"], 1), _client("c:1", ["other"], 0)]
    assert pool.pick("m").address == "b:1"
    assert pool.pick("other").address == "c:1"
    with pytest.raises(APIError) as excinfo:
        pool.pick("nope")
    assert excinfo.value.status == 404
    for c in pool.clients:
        c.ready = False
    with pytest.raises(APIError) as excinfo:
        pool.pick("m")
    assert excinfo.value.status == 503


def test_rich_status_round_trip_and_plain_statuses() -> None:
    rich = rich_status.status(grpc.StatusCode.FAILED_PRECONDITION, "window.window_id 7 is not attached",
                              Reason.WINDOW_NOT_FOUND, "window.window_id")
    error = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(*rich.trailing_metadata), details=rich.details)
    details = rich_status.details_of(error)
    assert details == rich_status.ErrorDetails("WINDOW_NOT_FOUND", "window.window_id")
    assert rich_status.has_reason(error, Reason.WINDOW_NOT_FOUND)
    assert not rich_status.has_reason(error, Reason.WINDOW_UNREACHABLE)
    # A status without details (gRPC's own, or another server's) has neither reason nor field.
    plain = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 details="connection refused")
    assert rich_status.details_of(plain) == rich_status.ErrorDetails()
    assert from_grpc(plain).param is None


def test_json_fields_travel_as_structs() -> None:
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False, "depth": 3},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
    })
    chat = to_engine.chat_request(body, "id").chat
    assert chat.tools.values[0].struct_value["function"]["name"] == "f"
    assert chat.tool_choice.string_value == "required"
    assert chat.chat_template_kwargs["enable_thinking"] is False
    schema = to_engine.chat_request(body, "id").sampling.structured_output.json_schema
    assert schema["type"] == "object"
    bad = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": "[1]"}})
    with pytest.raises(APIError) as excinfo:
        to_engine.completion_request(bad, "x", "id")
    assert excinfo.value.param == "structured_outputs.json"


def test_prompt_logprobs_are_refused_with_stream_and_passed_on_otherwise() -> None:
    streamed = CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": 2, "stream": True})
    with pytest.raises(APIError) as excinfo:
        to_engine.completion_request(streamed, "x", "id")
    assert excinfo.value.status == 400 and excinfo.value.param == "prompt_logprobs"
    whole = CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": 2})
    assert to_engine.completion_request(whole, "x", "id").sampling.prompt_logprobs == 2


def test_prompt_logprobs_in_vllms_shape() -> None:
    entries = [
        engine_pb2.PromptTokenLogprobs(),
        engine_pb2.PromptTokenLogprobs(candidates=[
            engine_pb2.RankedLogprob(token_id=5, token="a", logprob=-2.5, rank=3),
            engine_pb2.RankedLogprob(token_id=9, token="b", logprob=float("-inf"), rank=1),
        ]),
    ]
    assert prompt_logprobs_json(entries) == [
        None, {"5": {"logprob": -2.5, "rank": 3, "decoded_token": "a"},
               "9": {"logprob": -9999.0, "rank": 1, "decoded_token": "b"}},
    ]


def test_choice_state_reads_both_output_variants() -> None:
    state = ChoiceState(0)
    state.add(engine_pb2.ChoiceDelta(text="Hel"))
    parsed = engine_pb2.ChoiceDelta(parsed=engine_pb2.ParsedDelta(raw_text="lo", content="lo"),
                                    finish_reason=engine_pb2.FINISH_REASON_STOP, stop_token_id=2)
    parsed.parsed.whole.finish_reason = engine_pb2.FINISH_REASON_TOOL_CALLS
    state.add(parsed)
    assert state.text == "Hello" and state.finish_reason == "stop" and state.stop_reason == 2
    assert state.parsed is not None and finish_reason(state.parsed.finish_reason) == "tool_calls"
    assert finish_reason(engine_pb2.FINISH_REASON_UNSPECIFIED) is None


# --- the serving objects, on a canned worker stream --------------------------------------------------

class _Call:
    """A Generate call that plays back canned messages."""

    def __init__(self, messages: list[engine_pb2.GenerateResponse]):
        self.messages = list(messages)

    async def read(self) -> object:
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    def cancel(self) -> bool:
        return True


class _Stub:
    def __init__(self, messages: list[engine_pb2.GenerateResponse]):
        self.messages = messages

    def Generate(self, request: engine_pb2.GenerateRequest, metadata: object = ()) -> _Call:
        return _Call(self.messages)


def _serving_pool(messages: list[engine_pb2.GenerateResponse]) -> EnginePool:
    client = _client("a:1", ["base", "alias", "lora"], 0)
    assert client.info is not None
    client.info.lora_adapters.append(engine_pb2.LoraAdapter(name="lora", path="/lora", base_model_name="base"))
    client.info.model_path = "/base"
    client.stub = _Stub(messages)  # type: ignore[assignment]
    pool = EnginePool(["a:1"])
    pool.clients = [client]
    return pool


def _canned(text: str) -> list[engine_pb2.GenerateResponse]:
    return [
        engine_pb2.GenerateResponse(started=engine_pb2.Started(prompt_token_ids=[1, 2])),
        engine_pb2.GenerateResponse(delta=engine_pb2.Delta(choices=[engine_pb2.ChoiceDelta(
            index=0, text=text, token_ids=[7], finish_reason=engine_pb2.FINISH_REASON_STOP)])),
        engine_pb2.GenerateResponse(finished=engine_pb2.Finished(
            usage=engine_pb2.Usage(prompt_tokens=2, completion_tokens=1))),
    ]


async def _body(response: object) -> bytes:
    assert isinstance(response, StreamingResponse)
    return b"".join([part if isinstance(part, bytes) else str(part).encode()
                     async for part in response.body_iterator])


def _staying_client() -> Request:
    """The HTTP request of a client that never leaves (for the disconnect watch of a whole answer)."""
    async def receive() -> dict[str, object]:
        await asyncio.sleep(3600)
        return {}

    return Request({"type": "http"}, receive)


def test_chat_stream_framing_and_usage() -> None:
    chat = ServingChat(EngineCalls(_serving_pool(_canned("hé"))), response_role="assistant",
                       token_text=TokenText(as_token_ids=False))
    body = ChatCompletionRequest.model_validate({
        "model": "alias", "messages": [{"role": "user", "content": "hi"}], "stream": True, "request_id": "x",
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    })

    async def run() -> bytes:
        return await _body(await chat.create(body, _staying_client()))

    raw = asyncio.run(run())
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert [c["id"] for c in chunks] == ["chatcmpl-x"] * 3
    # The worker's first served name, though the client asked for an alias (as vLLM's server answers).
    assert {c["model"] for c in chunks} == {"base"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and chunks[0]["usage"] is None
    assert chunks[1]["choices"][0]["delta"] == {"content": "hé"} and chunks[1]["usage"]["total_tokens"] == 3
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "hé".encode() in raw, "SSE text is UTF-8, not \\u escapes"


def test_completion_batch_whole_and_models() -> None:
    pool = _serving_pool(_canned("!"))
    completion = ServingCompletion(EngineCalls(pool), token_text=TokenText(as_token_ids=True))
    body = CompletionRequest.model_validate({"model": "lora", "prompt": ["a", "b"], "echo": True,
                                             "return_token_ids": True, "request_id": "y"})

    async def run() -> object:
        return await completion.create(body, _staying_client())

    whole = asyncio.run(run())
    assert isinstance(whole, dict)
    assert whole["model"] == "lora" and whole["object"] == "text_completion"
    assert [(c["index"], c["text"], c["token_ids"]) for c in whole["choices"]] == [(0, "a!", [7]), (1, "b!", [7])]
    assert whole["usage"]["total_tokens"] == 6
    models = {m["id"]: m for m in ServingModels(pool).models()["data"]}
    assert models["lora"]["parent"] == "base" and models["lora"]["root"] == "/lora"
    assert models["alias"]["parent"] is None and models["alias"]["root"] == "/base"


class _PacedCall(_Call):
    """Plays its messages back one engine step apart, so that each goes out in a chunk of its own."""

    async def read(self) -> object:
        await asyncio.sleep(0.01)
        return await super().read()


class _PacedStub(_Stub):
    def Generate(self, request: engine_pb2.GenerateRequest, metadata: object = ()) -> _Call:
        return _PacedCall(self.messages)


def test_streamed_chat_token_ids_include_deltas_that_show_no_text() -> None:
    """An emoji spans three tokens: the first two show no text yet (the detokenizer holds the partial
    character back). With return_token_ids their ids are still sent, in a chunk with an empty delta, as
    vLLM's server sends them: the streamed ids add up to the whole answer's."""
    ids = [10813, 232, 227, 13]
    deltas = [("", [ids[0]], 0), ("", [ids[1]], 0), ("\N{PARTY POPPER}", [ids[2]], 0),
              ("!", [ids[3]], engine_pb2.FINISH_REASON_STOP)]
    messages = [engine_pb2.GenerateResponse(started=engine_pb2.Started(prompt_token_ids=[1, 2]))]
    messages += [engine_pb2.GenerateResponse(delta=engine_pb2.Delta(choices=[engine_pb2.ChoiceDelta(
        index=0, text=text, token_ids=token_ids, finish_reason=reason)])) for text, token_ids, reason in deltas]
    messages.append(engine_pb2.GenerateResponse(finished=engine_pb2.Finished(
        usage=engine_pb2.Usage(prompt_tokens=2, completion_tokens=len(ids)))))
    pool = _serving_pool(messages)
    pool.clients[0].stub = _PacedStub(messages)  # type: ignore[assignment]
    chat = ServingChat(EngineCalls(pool), response_role="assistant", token_text=TokenText(as_token_ids=False))

    def run(stream: bool) -> object:
        body = ChatCompletionRequest.model_validate({
            "model": "base", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "return_token_ids": True})

        async def create() -> object:
            response = await chat.create(body, _staying_client())
            return await _body(response) if stream else response

        return asyncio.run(create())

    raw = run(stream=True)
    assert isinstance(raw, bytes)
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n")[:-2]]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    whole = run(stream=False)
    assert isinstance(whole, dict)
    assert whole["choices"][0]["token_ids"] == ids
    assert streamed == ids, "the ids of deltas that show no text were dropped"
    assert "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"]) == \
        "\N{PARTY POPPER}!"
    # The first delta goes out alone (a stream's first token is never held back): it shows no text.
    silent = [choice for c in chunks for choice in c["choices"]
              if choice.get("token_ids") and not choice["delta"] and choice["finish_reason"] is None]
    assert silent and silent[0]["token_ids"][0] == ids[0]


class _RefusingDetokenize(_Stub):
    """A worker that runs prompts but refuses to turn their token ids back into text."""

    def __init__(self, messages: list[engine_pb2.GenerateResponse]):
        super().__init__(messages)
        self.calls: list[_Call] = []

    def Generate(self, request: engine_pb2.GenerateRequest, metadata: object = ()) -> _Call:
        call = _Call(self.messages)
        call.cancel = lambda: self.calls.append(call) or True  # type: ignore[method-assign]
        return call

    async def Detokenize(self, request: engine_pb2.DetokenizeRequest, metadata: object = ()) -> object:
        raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="token_ids: 99999 is outside the vocabulary")


def test_a_refused_echo_closes_every_stream_it_opened() -> None:
    pool = _serving_pool(_canned("!"))
    stub = _RefusingDetokenize(_canned("!"))
    pool.clients[0].stub = stub  # type: ignore[assignment]
    completion = ServingCompletion(EngineCalls(pool), token_text=TokenText(as_token_ids=False))
    body = CompletionRequest.model_validate({"model": "base", "prompt": [[1, 2], [3, 4]], "echo": True})

    async def run() -> object:
        return await completion.create(body, _staying_client())

    with pytest.raises(APIError):
        asyncio.run(run())
    assert len(stub.calls) == 2, f"{len(stub.calls)} of the 2 engine calls were cancelled"
    assert pool.clients[0].in_flight == 0, "the worker still counts the refused request's streams"


def test_app_factory_assembles_every_route() -> None:
    app = create_app(GatewaySettings(engines=["127.0.0.1:1"]))
    paths = {getattr(route, "path", None) for route in app.routes}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
            "/version", "/metrics"} <= paths


def test_batched_histogram_observations_equal_plain_ones() -> None:
    """BatchedObserver adds counts through prometheus_client's private parts: it must still be able to
    (else it silently falls back to plain observes, and the gateway pays per token again), and the
    histogram it fills must read exactly as one observed value by value."""
    from prometheus_client import CollectorRegistry, Histogram

    from taco_llm.gateway.metrics import BatchedObserver, _can_add_counts

    registry = CollectorRegistry()
    buckets = (0.001, 0.01, 0.1, 1.0)
    plain = Histogram("plain_seconds", "values observed one by one", buckets=buckets, registry=registry)
    batched = Histogram("batched_seconds", "values observed in batches", buckets=buckets, registry=registry)
    assert _can_add_counts(batched), "prometheus_client's histogram changed: BatchedObserver no longer batches"
    observer = BatchedObserver(batched)
    values = [(i * 0.37) % 1.3 for i in range(1000)] + [0.001, 0.01, 1.0]  # bounds land in their own bucket
    for value in values:
        plain.observe(value)
        observer.observe(value)
    observer.flush()

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name.removeprefix(name), s.labels, round(s.value, 9))
                for metric in registry.collect() if metric.name == name for s in metric.samples
                if not s.name.endswith("_created")]

    assert samples("batched_seconds") == samples("plain_seconds")


async def test_an_unexpected_error_is_a_500_that_shows_nothing_internal() -> None:
    app = create_app(GatewaySettings(engines=["127.0.0.1:1"]))

    async def broken() -> None:
        raise RuntimeError("pool state at 10.9.8.7:50051")

    app.add_api_route("/broken", broken)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        reply = await client.get("/broken")
    error = reply.json()["error"]
    assert reply.status_code == 500 and error["type"] == "server_error"
    assert "10.9.8.7" not in error["message"] and "RuntimeError" not in error["message"]


def test_refusal_and_thinking_parts_carry_their_text_to_the_worker() -> None:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot"},
                                          {"type": "thinking", "thinking": "hmm"}]}]})
    parts = to_engine.chat_messages(request.messages)[1].content_parts
    assert [(p.type, p.text) for p in parts] == [("refusal", "I cannot"), ("thinking", "hmm")]


def test_validation_errors_name_the_field_without_union_tags() -> None:
    from fastapi.testclient import TestClient

    app = create_app(GatewaySettings(engines=["127.0.0.1:1"]))
    with TestClient(app) as http:
        for path, body, param in [
            ("/v1/completions", {"model": "m", "prompt": 5}, "prompt"),
            ("/v1/completions", {"model": "m"}, "prompt"),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]},
             "messages[0].content"),
            ("/v1/chat/completions", {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ]:
            error = http.post(path, json=body).json()["error"]
            assert error["param"] == param, (body, error)
            assert ".str" not in error["message"] and "list[" not in error["message"], error


async def test_server_load_counts_a_stream_until_its_body_ends() -> None:
    from starlette.responses import JSONResponse

    from taco_llm.gateway.server_load import ServerLoad

    load = ServerLoad()
    release = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await release.wait()
        yield b"data: 2\n\n"

    async def answer() -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    streamed = await load.counted(answer())
    assert load.in_progress == 1, "returned, not yet sent"
    chunks = streamed.body_iterator.__aiter__()
    assert await anext(chunks) == b"data: 1\n\n" and load.in_progress == 1, "under way"
    release.set()
    assert [chunk async for chunk in chunks] == [b"data: 2\n\n"] and load.in_progress == 0

    async def whole() -> JSONResponse:
        return JSONResponse({})

    await load.counted(whole())
    assert load.in_progress == 0

    async def refused() -> JSONResponse:
        raise ValueError("refused")

    with pytest.raises(ValueError):
        await load.counted(refused())
    assert load.in_progress == 0
