"""Hostile requests straight at the worker's gRPC port, as a client that skips the gateway would send them:
each is refused before it is queued, with a precise status naming the field, and the worker serves on
with the same greedy text as before."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from taco_llm.protos import engine_pb2, engine_pb2_grpc, rich_status

from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
PROBE = "What is the capital of France?"
BAD_PATTERN_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "(unclosed"}}}


def _chat(*messages: engine_pb2.ChatMessage, **sampling: Any) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(model=MODEL, chat=engine_pb2.ChatInput(messages=list(messages)),
                                      sampling=engine_pb2.SamplingParams(**sampling))


def _user(text: str = "hi") -> engine_pb2.ChatMessage:
    return engine_pb2.ChatMessage(role="user", content=text)


def _greedy_text(engine: engine_pb2_grpc.EngineStub) -> str:
    replies = engine.Generate(_chat(_user(PROBE), temperature=0, max_tokens=12))
    return "".join(c.text for r in replies if r.WhichOneof("phase") == "delta" for c in r.delta.choices)


def _refusal(call: Any) -> tuple[grpc.StatusCode, rich_status.ErrorDetails, str]:
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    return caught.value.code(), rich_status.details_of(caught.value), caught.value.details()


@pytest.fixture(scope="module")
def baseline(stack: Stack) -> Iterator[str]:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        yield _greedy_text(engine_pb2_grpc.EngineStub(channel))


def _so(**kind: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    if "json_schema" in kind:
        kind["json_schema"] = json_format.ParseDict(kind["json_schema"], engine_pb2.StructuredOutput().json_schema)
    return {"structured_output": engine_pb2.StructuredOutput(**kind)}


# (request, field named, reason); every one INVALID_ARGUMENT.
CASES: dict[str, tuple[engine_pb2.GenerateRequest, str, str]] = {
    "unknown role": (_chat(_user(), engine_pb2.ChatMessage(role="hacker", content="obey")),
                     "chat.messages[1].role", "FIELD_INVALID"),
    "image part to a text-only model": (
        _chat(engine_pb2.ChatMessage(role="user", content_parts=[
            engine_pb2.ContentPart(type="text", text="what is this?"), engine_pb2.ContentPart(type="image_url")])),
        "chat.messages[0].content_parts[1].type", "FIELD_INVALID"),
    "audio part": (_chat(engine_pb2.ChatMessage(role="user", content_parts=[
        engine_pb2.ContentPart(type="input_audio")])), "chat.messages[0].content_parts[0].type", "FIELD_INVALID"),
    "absurd n": (_chat(_user(), n=2**32 - 1, temperature=1.0), "n", "FIELD_INVALID"),
    "n past --max-n": (_chat(_user(), n=129, temperature=1.0), "n", "FIELD_INVALID"),
    "max_tokens past the context": (_chat(_user(), max_tokens=100_000), "max_tokens", "FIELD_INVALID"),
    "max_tokens int32 max": (_chat(_user(), max_tokens=INT32_MAX), "max_tokens", "FIELD_INVALID"),
    "min_tokens past max_tokens": (_chat(_user(), max_tokens=5, min_tokens=6), "min_tokens", "FIELD_INVALID"),
    "prompt_logprobs -1 (the whole vocabulary)": (_chat(_user(), prompt_logprobs=-1), "prompt_logprobs",
                                                  "FIELD_INVALID"),
    "huge prompt_logprobs": (_chat(_user(), prompt_logprobs=INT32_MAX), "prompt_logprobs", "FIELD_INVALID"),
    "top logprobs past the vocabulary": (_chat(_user(), logprobs=VOCAB + 1), "logprobs", "FIELD_INVALID"),
    "logprobs -1": (_chat(_user(), logprobs=-1), "logprobs", "FIELD_INVALID"),
    "100,000 stop strings": (_chat(_user(), stop=[f"s{i}" for i in range(100_000)]), "stop", "FIELD_INVALID"),
    "a 100,000-character stop string": (_chat(_user(), stop=["x" * 100_000]), "stop", "FIELD_INVALID"),
    "NaN temperature": (_chat(_user(), temperature=math.nan), "temperature", "FIELD_INVALID"),
    "infinite top_p": (_chat(_user(), top_p=math.inf), "top_p", "FIELD_INVALID"),
    "infinite repetition_penalty": (_chat(_user(), repetition_penalty=math.inf), "repetition_penalty",
                                    "FIELD_INVALID"),
    "NaN presence_penalty": (_chat(_user(), presence_penalty=math.nan), "presence_penalty", "FIELD_INVALID"),
    "NaN logit_bias value": (_chat(_user(), logit_bias={5: math.nan}), "logit_bias", "FIELD_INVALID"),
    "top_k below -1": (_chat(_user(), top_k=INT32_MIN), "top_k", "FIELD_INVALID"),
    "prompt token past the vocabulary": (
        engine_pb2.GenerateRequest(model=MODEL, token_ids=engine_pb2.TokenIds(ids=[1, VOCAB])), "token_ids",
        "TOKEN_OUT_OF_VOCABULARY"),
    "logit_bias key past the vocabulary": (_chat(_user(), logit_bias={2**32 - 1: 1.0}), "logit_bias",
                                           "TOKEN_OUT_OF_VOCABULARY"),
    "stop_token_id past the vocabulary": (_chat(_user(), stop_token_ids=[VOCAB]), "stop_token_ids",
                                          "TOKEN_OUT_OF_VOCABULARY"),
    "resumed id past the vocabulary": (
        engine_pb2.GenerateRequest(model=MODEL, text="hi", resume=engine_pb2.Resume(output_token_ids=[VOCAB])),
        "resume.output_token_ids", "TOKEN_OUT_OF_VOCABULARY"),
    "empty text": (engine_pb2.GenerateRequest(model=MODEL, text=""), "text", "FIELD_REQUIRED"),
    "empty token ids": (engine_pb2.GenerateRequest(model=MODEL, token_ids=engine_pb2.TokenIds()), "token_ids",
                        "FIELD_REQUIRED"),
    "no messages": (_chat(), "chat.messages", "FIELD_REQUIRED"),
    "regex the compiler rejects": (_chat(_user(), **_so(regex="(abc")), "structured_output.regex",
                                   "FIELD_INVALID"),
    "regex with a NUL byte": (_chat(_user(), **_so(regex="a\x00")), "structured_output.regex", "FIELD_INVALID"),
    "schema with a malformed pattern": (_chat(_user(), **_so(json_schema=BAD_PATTERN_SCHEMA)),
                                        "structured_output.json_schema", "FIELD_INVALID"),
    "unsatisfiable schema": (_chat(_user(), **_so(json_schema={"type": "integer", "minimum": 5, "maximum": 1})),
                             "structured_output.json_schema", "FIELD_INVALID"),
    "grammar with an undefined rule": (_chat(_user(), **_so(grammar="root ::= foo")),
                                       "structured_output.grammar", "FIELD_INVALID"),
    "empty choice": (_chat(_user(), **_so(choice=engine_pb2.ChoiceList())), "structured_output.choice",
                     "FIELD_INVALID"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_request_is_refused_naming_the_field(baseline: str, engine: engine_pb2_grpc.EngineStub,
                                                     name: str) -> None:
    request, field, reason = CASES[name]
    code, details, message = _refusal(engine.Generate(request))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, rich_status.ErrorDetails(reason, field)), message
    assert message and "Traceback" not in message


def test_tokenize_refuses_an_unknown_role(engine: engine_pb2_grpc.EngineStub) -> None:
    request = engine_pb2.TokenizeRequest(model=MODEL, chat=engine_pb2.ChatInput(messages=[
        engine_pb2.ChatMessage(role="hacker", content="x")]))
    with pytest.raises(grpc.RpcError) as caught:
        engine.Tokenize(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rich_status.details_of(caught.value) == rich_status.ErrorDetails("FIELD_INVALID", "chat.messages[0].role")


@pytest.mark.parametrize("sampling", [
    {"seed": INT64_MIN, "temperature": 1.0}, {"seed": INT64_MAX, "temperature": 1.0}, {"seed": -1},
    {"top_k": INT32_MAX}, {"max_tokens": 2048}, {"n": 2, "temperature": 1.0, "stop": ["x" * 1024] * 64},
])
def test_extreme_values_in_range_are_served(baseline: str, engine: engine_pb2_grpc.EngineStub,
                                            sampling: dict[str, Any]) -> None:
    sampling = {"max_tokens": 2, **sampling}
    replies = list(engine.Generate(_chat(_user(), **sampling)))
    assert replies[-1].WhichOneof("phase") == "finished"


@pytest.mark.parametrize("priority", [INT32_MIN, INT32_MAX])
def test_any_priority_is_served(engine: engine_pb2_grpc.EngineStub, priority: int) -> None:
    request = _chat(_user(), max_tokens=2)
    request.priority = priority
    assert list(engine.Generate(request))[-1].WhichOneof("phase") == "finished"


def test_forced_tool_call_with_a_malformed_pattern_is_refused(frontend_stack: Stack) -> None:
    """A forced call of a strict tool becomes structured output from the tool's schema (vLLM's hermes parser
    holds a non-strict tool's arguments to any JSON): compiled at admission too, and refused by name."""
    from google.protobuf import json_format, struct_pb2

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": BAD_PATTERN_SCHEMA,
                                             "strict": True}}
    chat = engine_pb2.ChatInput(messages=[_user("Weather in Paris?")])
    chat.tools.CopyFrom(json_format.ParseDict([tool], struct_pb2.ListValue()))
    chat.tool_choice.CopyFrom(json_format.ParseDict("required", struct_pb2.Value()))
    with grpc.insecure_channel(frontend_stack.grpc_address) as channel:
        code, details, message = _refusal(engine_pb2_grpc.EngineStub(channel).Generate(
            engine_pb2.GenerateRequest(model=MODEL, chat=chat, sampling=engine_pb2.SamplingParams(max_tokens=20))))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, rich_status.ErrorDetails("FIELD_INVALID",
                                                                                         "chat.tools")), message


def test_a_chat_that_renders_empty_is_refused(frontend_stack: Stack) -> None:
    chat = engine_pb2.ChatInput(messages=[_user()], chat_template="{{ '' }}", add_generation_prompt=False)
    with grpc.insecure_channel(frontend_stack.grpc_address) as channel:
        code, details, message = _refusal(engine_pb2_grpc.EngineStub(channel).Generate(
            engine_pb2.GenerateRequest(model=MODEL, chat=chat)))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, rich_status.ErrorDetails("FIELD_REQUIRED",
                                                                                         "chat")), message


def test_still_serving_the_same_greedy_text(baseline: str, engine: engine_pb2_grpc.EngineStub) -> None:
    assert baseline and _greedy_text(engine) == baseline
    load = engine.GetLoad(engine_pb2.GetLoadRequest())
    assert load.num_active_streams == 0
