"""The worker's tool calling on fixed model text: vLLM's hermes and mistral parsers, streamed and whole,
and the refusals a request's tools and tool_choice can get. No engine: the real tokenizer only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2

from taco_llm.engine_worker.frontend.sampling import InvalidField
from taco_llm.engine_worker.frontend.tools import ToolCalling, ToolRequest, tool_parser_class
from taco_llm.engine_worker.vllm_internals import tool_parser_names
from taco_llm.protos import engine_pb2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from taco_llm.engine_worker.vllm_internals import get_tokenizer

    return get_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def hermes(tokenizer: Any) -> ToolCalling:
    return ToolCalling(tool_parser_class("hermes", True, tokenizer), True, tokenizer, None, "hermes")


def _chat(tool_choice: Any = None, parallel: bool | None = None) -> engine_pb2.ChatInput:
    chat = engine_pb2.ChatInput()
    if tool_choice is not None:
        chat.tool_choice.CopyFrom(json_format.ParseDict(tool_choice, struct_pb2.Value()))
    if parallel is not None:
        chat.parallel_tool_calls = parallel
    return chat


def _run(tools: ToolRequest, tokenizer: Any, text: str) -> tuple[list[engine_pb2.ChoiceDelta], engine_pb2.ChoiceDelta]:
    """Feeds the text token by token, as the engine's deltas come; returns the deltas and the last one."""
    parser = tools.choice_parser()
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        delta = engine_pb2.ChoiceDelta(text=tokenizer.decode([token], skip_special_tokens=False), token_ids=[token],
                                       finish_reason=engine_pb2.FINISH_REASON_STOP if last else None)
        parser.delta(delta, [1, 2, 3] if i == 0 else None, finished=last)
        deltas.append(delta)
    return deltas, deltas[-1]


def _streamed(deltas: list[engine_pb2.ChoiceDelta]) -> tuple[str, list[dict[str, str]]]:
    assert all(d.WhichOneof("output") == "parsed" for d in deltas)
    content = "".join(d.parsed.content for d in deltas if d.parsed.HasField("content"))
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for c in d.parsed.tool_calls:
            call = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += c.id
            call["name"] += c.function_name
            call["arguments"] += c.function_arguments
    return content, [calls[i] for i in sorted(calls)]


def test_vllm_parsers_are_offered(tokenizer: Any) -> None:
    names = tool_parser_names()
    assert {"hermes", "mistral"} <= set(names)
    assert tool_parser_class("hermes", False, tokenizer) is None  # as vLLM: no auto, no parser


def test_named_choice_becomes_a_constraint_and_parses(hermes: ToolCalling, tokenizer: Any) -> None:
    tools = hermes.prepare(MESSAGES, [WEATHER, TIME], _chat({"type": "function", "function": {"name": "get_weather"}}),
                           None)
    assert tools is not None and tools.named
    overrides = tools.sampling_overrides()
    tag = json.loads(overrides["structured_outputs"].structural_tag)
    # vLLM's structural tag: the output must open a call of exactly this function.
    begins = [t["begin"] for t in tag["format"]["tags"]]
    assert begins and all('{"name": "get_weather", "arguments": ' in b for b in begins)
    assert overrides["skip_special_tokens"] is False
    deltas, last = _run(tools, tokenizer, HERMES_CALL)
    content, calls = _streamed(deltas)
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["id"].startswith("chatcmpl-tool-")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    # The first fragment names the call; the rest carry arguments only.
    first = next(d.parsed.tool_calls[0] for d in deltas if d.parsed.tool_calls)
    assert first.type == "function" and first.function_name == "get_weather"
    assert last.finish_reason == engine_pb2.FINISH_REASON_STOP  # a named choice finishes with "stop", as OpenAI's
    assert last.parsed.whole.content == "" and last.parsed.whole.finish_reason == engine_pb2.FINISH_REASON_STOP
    (whole,) = last.parsed.whole.tool_calls
    assert (whole.function_name, json.loads(whole.function_arguments)) == ("get_weather", {"city": "Paris"})


def test_required_choice_finishes_with_tool_calls(hermes: ToolCalling, tokenizer: Any) -> None:
    tools = hermes.prepare(MESSAGES, [WEATHER, TIME], _chat("required"), None)
    assert tools is not None and tools.required
    assert tools.sampling_overrides()["structured_outputs"].structural_tag
    two = HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas, last = _run(tools, tokenizer, two)
    _, calls = _streamed(deltas)
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert last.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS
    assert last.parsed.whole.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS
    assert [c.function_name for c in last.parsed.whole.tool_calls] == ["get_weather", "get_time"]


def test_parallel_tool_calls_false_keeps_the_first(hermes: ToolCalling, tokenizer: Any) -> None:
    tools = hermes.prepare(MESSAGES, [WEATHER, TIME], _chat("required", parallel=False), None)
    assert tools is not None
    two = HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas, last = _run(tools, tokenizer, two)
    assert [c["name"] for c in _streamed(deltas)[1]] == ["get_weather"]
    assert [c.function_name for c in last.parsed.whole.tool_calls] == ["get_weather"]


def test_auto_splits_content_from_the_call(hermes: ToolCalling, tokenizer: Any) -> None:
    tools = hermes.prepare(MESSAGES, [WEATHER], _chat(), None)  # no tool_choice with tools: "auto"
    assert tools is not None and not tools.named and not tools.required
    assert "structured_outputs" not in tools.sampling_overrides()  # auto leaves the model free
    deltas, last = _run(tools, tokenizer, "Let me check. " + HERMES_CALL)
    content, calls = _streamed(deltas)
    assert content == "Let me check. " and [c["name"] for c in calls] == ["get_weather"]
    assert last.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS
    assert last.parsed.whole.content == "Let me check. "
    assert last.parsed.whole.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS


def test_auto_without_a_call_is_plain_content(hermes: ToolCalling, tokenizer: Any) -> None:
    tools = hermes.prepare(MESSAGES, [WEATHER], _chat("auto"), None)
    assert tools is not None
    deltas, last = _run(tools, tokenizer, "It is sunny in Paris.")
    assert _streamed(deltas) == ("It is sunny in Paris.", [])
    assert last.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert last.parsed.whole.content == "It is sunny in Paris." and not last.parsed.whole.tool_calls


def test_tool_choice_none_is_not_parsed(hermes: ToolCalling) -> None:
    assert hermes.prepare(MESSAGES, [WEATHER], _chat("none"), None) is None
    assert hermes.prepare(MESSAGES, None, _chat(), None) is None


def test_mistral_parser_on_mistral_style_text(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    # SmolLM has no [TOOL_CALLS] token, so the mistral parser refuses it (see the start-up test); a
    # tokenizer with the token added stands in for a Mistral one.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    mistral = ToolCalling(tool_parser_class("mistral", True, tokenizer), True, tokenizer, None, "mistral")
    tools = mistral.prepare(MESSAGES, [WEATHER], _chat(), None)
    assert tools is not None
    deltas, last = _run(tools, tokenizer, 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    content, calls = _streamed(deltas)
    assert content.strip() == "Sure."
    assert [c["name"] for c in calls] == ["get_weather"] and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert last.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS
    (whole,) = last.parsed.whole.tool_calls
    assert (whole.function_name, json.loads(whole.function_arguments)) == ("get_weather", {"city": "Paris"})


def test_mistral_parser_refuses_a_tokenizer_without_its_token(tokenizer: Any) -> None:
    from taco_llm.engine_worker.frontend.tools import ToolParserProblem

    with pytest.raises(ToolParserProblem, match="--tool-call-parser mistral"):
        tool_parser_class("mistral", True, tokenizer)


@pytest.mark.parametrize(("tools", "choice", "field", "text"), [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "does not match any"),
    ([WEATHER], {"type": "function"}, "tool_choice.function", "Invalid value for `function`"),
    ([WEATHER], "sometimes", "tool_choice", "Invalid value for `tool_choice`"),
    (None, "required", "tool_choice", "`tools` must be set"),
    ([], None, "tools", "must not be an empty array"),
])
def test_bad_tools_name_their_field(hermes: ToolCalling, tools: Any, choice: Any, field: str, text: str) -> None:
    with pytest.raises(InvalidField) as caught:
        hermes.prepare(MESSAGES, tools, _chat(choice), None)
    assert caught.value.field == field and text in str(caught.value)


def test_tool_choice_of_the_wrong_json_type(hermes: ToolCalling) -> None:
    # tool_choice is a google.protobuf.Value: text that is not JSON cannot be sent, but a number can.
    with pytest.raises(InvalidField) as caught:
        hermes.prepare(MESSAGES, [WEATHER], engine_pb2.ChatInput(tool_choice=struct_pb2.Value(number_value=3)), None)
    assert caught.value.field == "tool_choice"


def test_without_a_parser_choices_are_refused_as_vllm_does(tokenizer: Any) -> None:
    plain = ToolCalling(None, False, tokenizer, None)
    with pytest.raises(InvalidField, match='"auto" tool choice requires --enable-auto-tool-choice'):
        plain.prepare(MESSAGES, [WEATHER], _chat(), None)
    with pytest.raises(InvalidField, match='tool_choice="required" requires --tool-call-parser'):
        plain.prepare(MESSAGES, [WEATHER], _chat("required"), None)
    assert plain.prepare(MESSAGES, [WEATHER], _chat("none"), None) is None


# The flags, checked before the engine starts: each error names its flag and is no traceback.

def _worker_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from taco_llm.engine_worker.frontend.args import parse

    with pytest.raises(SystemExit) as caught:
        parse(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_unknown_tool_call_parser_is_a_start_up_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = _worker_error(["--enable-auto-tool-choice", "--tool-call-parser", "nope"], capsys)
    assert "--tool-call-parser nope: no such tool-call parser" in err and "hermes" in err


def test_a_parser_the_tokenizer_cannot_serve_is_a_start_up_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = _worker_error(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"], capsys)
    assert "--tool-call-parser mistral cannot be used with the tokenizer" in err


def test_auto_tool_choice_needs_a_parser(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--enable-auto-tool-choice needs --tool-call-parser" in _worker_error(["--enable-auto-tool-choice"], capsys)


def test_serve_refuses_an_unknown_parser_without_a_traceback() -> None:
    import subprocess
    import sys

    from .support import ROOT, free_port

    done = subprocess.run(
        [sys.executable, "-m", "taco_llm.cli", "serve", "--port", str(free_port()), "--grpc-port", str(free_port()),
         "--enable-auto-tool-choice", "--tool-call-parser", "nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "--tool-call-parser nope: no such tool-call parser" in output
    assert "Traceback" not in output
