"""Anthropic's Messages API turned into chat completion fields (gateway/serving_messages.py), without an
engine: turns, tool uses and results, images, tools and tool_choice, and refusals that name the field.
The engine's side is tested through Anthropic's SDK in test_anthropic_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest

from taco_llm.gateway.anthropic_protocol import MessagesRequest
from taco_llm.gateway.errors import APIError
from taco_llm.gateway.serving_messages import chat_request

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def _request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})


def test_turns_tool_uses_and_results_become_chat_messages() -> None:
    chat = chat_request(_request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "...", "signature": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "text", "text": "And tomorrow?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
        ],
        tools=[{"name": "get_weather", "description": "d", "input_schema": SCHEMA}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=5))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief.\nBe kind."
    assistant = chat.messages[2]
    assert assistant.content == "Let me look." and assistant.tool_calls is not None
    assert assistant.tool_calls[0].function.name == "get_weather"
    assert assistant.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert (chat.messages[3].tool_call_id, chat.messages[3].content) == ("toolu_1", "Sunny")
    parts = chat.messages[4].content
    assert isinstance(parts, list) and parts[0].text == "And tomorrow?"
    assert parts[1].model_dump()["image_url"] == {"url": "data:image/png;base64,AAAA"}
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                            "description": "d"}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens) == (["END"], 0.5, 5, 8)


def test_a_named_tool_choice_and_an_error_result() -> None:
    chat = chat_request(_request(
        messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}]}],
        tools=[{"name": "f", "input_schema": SCHEMA}], tool_choice={"type": "tool", "name": "f"}))
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.messages[0].content == "Error: boom"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]},
     "messages.0.content.0.source.url"),
])
def test_what_cannot_be_served_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        chat_request(_request(**{"messages": [{"role": "user", "content": "hi"}], **fields}))
    assert refused.value.status == 400 and refused.value.param == param
    body = refused.value.anthropic_body()
    assert body["type"] == "error" and body["error"]["message"].startswith(param)  # type: ignore[index]
