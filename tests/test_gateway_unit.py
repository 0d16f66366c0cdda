"""The gateway's translation and error mapping on fixed inputs (no engine needed)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from gateway import to_engine
from gateway.engine_pool import EngineClient, EnginePool
from gateway.errors import APIError, from_grpc
from gateway.from_engine import ChoiceState, finish_reason, prompt_logprobs_json
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from protos import engine_pb2, rich_status
from protos.rich_status import Reason


def test_gateway_imports_neither_torch_nor_vllm() -> None:
    code = ("import sys, gateway.app, gateway.__main__; "
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
