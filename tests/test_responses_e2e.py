"""OpenAI's Responses API end to end, through the openai SDK's `client.responses` against `taco_llm serve`
on the default model: whole and streamed responses, a conversation chained by previous_response_id,
JSON-schema output, logprobs, a function-call round trip (on the stack with a tool parser), and the
refusals. Greedy answers are compared with the same conversation asked as a chat completion: the two
routes are one engine call. The store shared by several gateways is tested on the fleet
(test_fleet_e2e.py), the tenants' scopes in test_tenants_e2e.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You answer in one short sentence."
QUESTION = "What is the capital of France?"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}


def _chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, int]:
    reply = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=max_tokens, temperature=0)
    assert reply.usage is not None
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens


def test_a_response_is_the_chat_completion_of_the_same_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=24,
                                       temperature=0)
    text, prompt_tokens = _chat_text(client, [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": QUESTION}], 24)
    assert response.output_text == text and text
    assert response.usage is not None and response.usage.input_tokens == prompt_tokens
    assert response.id.startswith("resp_") and response.model == MODEL
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    # Stored by default, as in OpenAI's API.
    assert client.responses.retrieve(response.id).output_text == text


def test_a_streamed_response_tells_what_the_whole_one_does(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if final.status == "incomplete" else "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_previous_response_id_carries_the_conversation_on(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, instructions=SYSTEM, input="My name is Ada. Say hello to me.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=12, temperature=0)
    # The instructions are not carried on (as in OpenAI's API); the turns and the answer are.
    text, prompt_tokens = _chat_text(client, [
        {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], 12)
    assert second.output_text == text
    assert second.usage is not None and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id


def test_a_json_schema_format_is_followed(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Name a city in France, as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), CITY_SCHEMA)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_logprobs_come_with_the_output_text_when_included(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)


def test_bad_requests_name_the_field(client: openai.OpenAI, stack: Stack) -> None:
    def refused(body: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(f"{stack.base_url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
        assert reply.status_code == 400, reply.text
        return dict(reply.json()["error"])

    assert refused({"input": [{"type": "item_reference", "id": "x"}]})["param"] == "input[0].type"
    assert refused({"input": "hi", "tools": [{"type": "web_search"}]})["param"] == "tools[0].type"
    assert refused({"input": "hi", "background": True, "store": False})["param"] == "background"
    assert refused({"input": "hi", "max_output_tokens": -1})["param"] == "max_output_tokens"
    assert refused({"input": 3})["param"] == "input"
    with pytest.raises(openai.BadRequestError) as unknown_previous:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nothing")
    assert unknown_previous.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nothing")
    # Not stored: never found again.
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": CITY_SCHEMA}


def test_a_function_call_round_trip(frontend_client: openai.OpenAI) -> None:
    call_response = frontend_client.responses.create(
        model=MODEL, input="What is the weather like in Paris today?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0)
    calls = [item for item in call_response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY_SCHEMA)
    with frontend_client.responses.stream(
            model=MODEL, input="What is the weather like in Paris today?", tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    # The same call; the whole answer's arguments are the parser's JSON, the stream's the model's text.
    assert json.loads(streamed) == json.loads(calls[0].arguments)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == streamed
    answer = frontend_client.responses.create(
        model=MODEL, previous_response_id=call_response.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C."}],
        max_output_tokens=20, temperature=0)
    assert answer.output_text and answer.output[0].type == "message"
