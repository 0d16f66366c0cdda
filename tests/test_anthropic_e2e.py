"""Anthropic's Messages API end to end, through Anthropic's own SDK (`anthropic` from PyPI) against
`taco_llm serve` on the default model: plain and streamed messages, a tool-use round trip (on the
stack with a tool parser), count_tokens, and Anthropic's error shapes. Greedy answers are compared with
the same conversation asked as a chat completion: the two routes are one engine call.
"""

from __future__ import annotations

from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You answer in one short sentence."
QUESTION = "What is the capital of France?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
# Anthropic's SDK has dropped the sampling parameters from its signatures (its models fix them); vLLM-style
# servers still take them in the body, as clients send them with extra_body.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA,
           "strict": True}


def _client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(stack: Stack) -> anthropic.Anthropic:
    return _client(stack)


def test_a_message_is_the_chat_completion_of_the_same_conversation(claude: anthropic.Anthropic,
                                                                   client: openai.OpenAI) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}])
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert chat.usage is not None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                          chat.usage.completion_tokens)


def test_a_streamed_message_says_what_the_whole_one_does(claude: anthropic.Anthropic) -> None:
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 20, "extra_body": GREEDY,
                             "messages": [{"role": "user", "content": "Tell me about rivers."}]}
    whole = claude.messages.create(**asked)
    with claude.messages.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 20
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_stop_sequence_is_reported_as_anthropic_does(claude: anthropic.Anthropic) -> None:
    asked: list[Any] = [{"role": "user", "content": "Tell me about rivers."}]
    whole = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=asked)
    text = whole.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # somewhere in what the model says, greedy
    stopped = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, stop_sequences=[stop],
                                     messages=asked)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    said = stopped.content[0].text if stopped.content else ""  # type: ignore[union-attr]
    assert text.startswith(said) and stop not in said, (text, stop, said)


def test_count_tokens_is_the_prompt_a_message_is_charged(claude: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    charged = claude.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=messages)
    assert counted.input_tokens == charged.usage.input_tokens > 0


def test_bad_requests_get_anthropic_errors_naming_the_field(claude: anthropic.Anthropic, stack: Stack) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as negative:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": -1})
    assert negative.value.body["type"] == "error"  # type: ignore[index]
    assert negative.value.body["error"]["message"].startswith("temperature")  # type: ignore[index]
    # Not through the SDK, which would not send them: a body without max_tokens, a server tool, thinking.
    import httpx

    for body, field in (({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                          "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking")):
        refused = httpx.post(f"{stack.base_url}/v1/messages", json=body, timeout=30)
        assert refused.status_code == 400, refused.text
        error = refused.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(field), error


def test_a_tool_use_round_trip(frontend_stack: Stack) -> None:
    claude = _client(frontend_stack)
    question: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    called = claude.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],  # type: ignore[list-item]
                                    tool_choice={"type": "tool", "name": "get_weather"}, messages=question)
    (use,) = [block for block in called.content if block.type == "tool_use"] or [called]  # shown if absent
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert called.stop_reason == "tool_use"

    with claude.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=question) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [block for block in streamed.content if block.type == "tool_use"] or [streamed]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"

    answer = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, tools=[WEATHER],  # type: ignore[list-item]
                                    messages=[*question, {"role": "assistant", "content": called.content},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": use.id,
                                                                            "content": "Sunny, 21 degrees."}]}])
    assert answer.content and answer.usage.input_tokens > called.usage.input_tokens
    counted = claude.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=question)  # type: ignore[list-item]
    bare = claude.messages.count_tokens(model=MODEL, messages=question)
    assert counted.input_tokens > bare.input_tokens, "the tools are rendered into the prompt"
