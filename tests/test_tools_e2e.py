"""Tool calling end to end: the OpenAI SDK → gateway → worker (vLLM's hermes parser) → vLLM.

The 135M model does not call tools of its own accord, so these force the call (a named tool_choice or
"required"), which vLLM turns into structured output; the parsing of free model text is in
test_tools_unit.py.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from google.protobuf import json_format, struct_pb2

from taco_llm.protos import engine_pb2, engine_pb2_grpc

from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
# strict: the arguments must follow the schema (vLLM pins it in the structural tag), not just be JSON.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMETERS, "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], temperature=0,
                                          max_tokens=60, **kwargs)


def _streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The calls put together from the stream, and the tool-call deltas as they came."""
    deltas = [call for chunk in chunks if chunk.choices for call in (chunk.choices[0].delta.tool_calls or [])]
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id:
            call["id"] = d.id
        if d.function and d.function.name:
            call["name"] = d.function.name
        if d.function and d.function.arguments:
            call["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], deltas


def test_named_tool_choice_forces_the_call(frontend_client: openai.OpenAI) -> None:
    reply = _create(frontend_client, tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.message.tool_calls, choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    # OpenAI (and vLLM) finish a named tool_choice with "stop", not "tool_calls".
    assert choice.finish_reason == "stop"
    assert not choice.message.content


def test_named_tool_choice_streams_openai_shaped_deltas(frontend_client: openai.OpenAI) -> None:
    whole = _create(frontend_client, tool_choice=NAMED).choices[0].message.tool_calls[0]
    chunks = list(_create(frontend_client, tool_choice=NAMED, stream=True))
    calls, deltas = _streamed_calls(chunks)
    # The first delta names the call; the later ones only add argument text.
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert rest and all(d.id is None and d.function.name is None and d.type is None for d in rest)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    # Streamed fragments are the model's own text; the whole reply re-serializes it (both as vLLM does).
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert all(not (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_required_tool_choice_streaming_and_not(frontend_client: openai.OpenAI) -> None:
    reply = _create(frontend_client, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and {c.function.name for c in choice.message.tool_calls} <= {
        "get_weather", "get_time"}
    for call in choice.message.tool_calls:
        assert isinstance(json.loads(call.function.arguments), dict)

    chunks = list(_create(frontend_client, tool_choice="required", stream=True))
    calls, _ = _streamed_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert all(c["id"] for c in calls)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_parallel_tool_calls_false_keeps_one_call(frontend_client: openai.OpenAI) -> None:
    reply = _create(frontend_client, tool_choice="required", parallel_tool_calls=False)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_tool_results_go_back_to_the_model(frontend_client: openai.OpenAI) -> None:
    call = _create(frontend_client, tool_choice=NAMED).choices[0].message.tool_calls[0]
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    reply = frontend_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                    tool_choice="none", temperature=0, max_tokens=20)
    assert reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls


def test_auto_tool_choice_streaming_matches_non_streaming(frontend_client: openai.OpenAI) -> None:
    whole = _create(frontend_client).choices[0]
    chunks = list(_create(frontend_client, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls, _ = _streamed_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
    assert text == (whole.message.content or "")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.finish_reason]


def test_tool_choice_naming_an_unknown_function_is_a_400(frontend_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _create(frontend_client, tool_choice={"type": "function", "function": {"name": "launch_rocket"}})
    assert caught.value.body["param"] == "tool_choice"
    assert "does not match any of the specified `tools`" in caught.value.body["message"]


def test_empty_tools_is_a_400(frontend_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        frontend_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[], max_tokens=5)
    assert caught.value.body["param"] == "tools"


def test_worker_reports_its_tool_parser(frontend_stack: Stack, stack: Stack) -> None:
    for running, parser in ((frontend_stack, "hermes"), (stack, "")):
        with grpc.insecure_channel(running.grpc_address) as channel:
            info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest())
        assert info.tool_call_parser == parser


# Without --enable-auto-tool-choice and --tool-call-parser, as vLLM 0.32's own server answers.

def test_without_a_parser_tools_default_to_auto_and_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client)
    assert caught.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in caught.value.body["message"]


def test_without_a_parser_a_named_choice_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, tool_choice=NAMED)
    assert 'tool_choice=function "get_weather" requires --tool-call-parser' in caught.value.body["message"]


def test_without_a_parser_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    reply = _create(client, tool_choice="none")
    assert reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_grpc_clients_get_the_parsed_calls(frontend_stack: Stack) -> None:
    """Straight to the worker: tools and tool_choice as JSON values in, content/tool-call fragments and the
    whole parse out."""
    request = engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(
            messages=[engine_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])],
            tools=json_format.ParseDict([WEATHER], struct_pb2.ListValue()),
            tool_choice=json_format.ParseDict(NAMED, struct_pb2.Value()),
        ),
        sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=60),
    )
    with grpc.insecure_channel(frontend_stack.grpc_address) as channel:
        messages = list(engine_pb2_grpc.EngineStub(channel).Generate(request))
    deltas = [d for m in messages for d in m.delta.choices]
    assert deltas and all(d.WhichOneof("output") == "parsed" for d in deltas)
    fragments = [c for d in deltas for c in d.parsed.tool_calls]
    assert fragments[0].function_name == "get_weather" and fragments[0].id
    raw = "".join(d.parsed.raw_text for d in deltas)
    assert raw.startswith("<tool_call>")  # the model's own text stays in `raw_text`
    (last,) = [d for d in deltas if d.finish_reason]
    (call,) = last.parsed.whole.tool_calls
    assert call.function_name == "get_weather"
    assert json.loads(call.function_arguments) == json.loads("".join(f.function_arguments for f in fragments))
