"""Tool calling with vLLM's own machinery.

A chat request's tools and tool_choice become vLLM's ChatCompletionRequest, which validates them as
vLLM's server does. vLLM's Parser (a tool-call parser picked by --tool-call-parser, from vLLM's
ToolParserManager) then adjusts it: a forced tool_choice ("required" or a named function) becomes a
structured-output constraint (a JSON schema or an xgrammar structural tag, whichever the parser
asks for). The model's text is parsed by the same Parser, per delta while streaming, and once more
in whole at the end for non-streaming replies, exactly as vLLM's chat serving does both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

from taco_llm.protos import engine_pb2
from taco_llm.protos.rich_status import Reason

from ..vllm_internals import (
    AUTO_TOOL_CHOICE_NEEDS_PARSER,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    DeltaMessage,
    Parser,
    ParserManager,
    TokenizerLike,
    forced_tool_choice_needs_parser,
    get_tokenizer,
    make_tool_call_id,
    maybe_filter_parallel_tool_calls,
)
from .sampling import InvalidField, json_value


class ToolParserProblem(ValueError):
    """--tool-call-parser names a parser that cannot work with this model's tokenizer."""


def tool_parser_class(name: str | None, enable_auto_tools: bool, tokenizer: str | TokenizerLike,
                      model_name: str = "") -> type[Parser] | None:
    """vLLM's Parser class for the flags; None where vLLM's server would have none (no
    --enable-auto-tool-choice, or no --tool-call-parser)."""
    if not name or not enable_auto_tools:
        return None
    if isinstance(tokenizer, str):
        model_name = model_name or tokenizer
        tokenizer = get_tokenizer(tokenizer)
    try:
        return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, tokenizer=tokenizer,
                                        model_name=model_name)
    except TypeError as error:  # vLLM's message names the flag
        raise ToolParserProblem(str(error)) from None


def _validation_field(error: ValidationError) -> tuple[str, str]:
    """The request field and message of vLLM's first complaint."""
    for item in error.errors():
        cause = (item.get("ctx") or {}).get("error")
        if isinstance(cause, VLLMValidationError):
            return cause.parameter or "tools", str(cause)
        location = [str(p) for p in item.get("loc", ())]
        if location:
            return ".".join(location), f"{'.'.join(location)}: {item.get('msg')}"
    return "tools", str(error)


def _choice_text(choice: Any) -> str:
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return f'function "{choice.function.name}"'
    return f'"{choice}"'


class ToolCalling:
    """The worker's tool-call settings; `prepare` makes one request's ToolRequest."""

    def __init__(self, parser_cls: type[Parser] | None, enable_auto_tools: bool, tokenizer: TokenizerLike,
                 model_config: Any, parser_name: str = ""):
        self.parser_cls = parser_cls
        self.enable_auto_tools = enable_auto_tools
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.parser_name = parser_name if parser_cls is not None else ""

    def prepare(self, messages: list[dict[str, Any]], tools: list[Any] | None, chat: engine_pb2.ChatInput,
                constraint: StructuredOutputsParams | None) -> ToolRequest | None:
        """None when the output is not to be parsed (no tools, tool_choice "none", or no parser);
        errors (bad tools, a tool_choice this worker cannot honour) name the field."""
        if tools is None and not chat.HasField("tool_choice"):
            return None
        data: dict[str, Any] = {"model": "", "messages": messages, "tools": tools}
        if chat.HasField("tool_choice"):
            data["tool_choice"] = json_value(chat.tool_choice)
        if chat.HasField("parallel_tool_calls"):
            data["parallel_tool_calls"] = chat.parallel_tool_calls
        if constraint is not None:
            data["structured_outputs"] = constraint
        try:
            request = ChatCompletionRequest.model_validate(data)
        except ValidationError as error:
            raise InvalidField(*_validation_field(error)) from None
        except VLLMValidationError as error:
            raise InvalidField(error.parameter or "tools", str(error)) from None
        choice = request.tool_choice
        if self.parser_cls is None and choice not in (None, "none"):
            # vLLM's server answers these the same way (OnlineRenderer.render_chat).
            if choice == "auto":
                raise InvalidField("tool_choice", AUTO_TOOL_CHOICE_NEEDS_PARSER, Reason.TOOL_CHOICE_UNSUPPORTED)
            raise InvalidField("tool_choice", forced_tool_choice_needs_parser(_choice_text(choice)),
                               Reason.TOOL_CHOICE_UNSUPPORTED)
        if self.parser_cls is None or choice == "none" or not request.tools:
            return None
        adjusted = self.new_parser(request).adjust_request(request)
        assert isinstance(adjusted, ChatCompletionRequest)
        return ToolRequest(self, adjusted)

    def new_parser(self, request: ChatCompletionRequest) -> Parser:
        assert self.parser_cls is not None
        tools: list[Any] | None = request.tools
        return self.parser_cls(self.tokenizer, tools, model_config=self.model_config)


class ToolRequest:
    """One request's tool calling: its sampling adjustments and a parser per choice."""

    def __init__(self, calling: ToolCalling, request: ChatCompletionRequest):
        self.calling = calling
        self.request = request
        self.named = isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)
        self.required = request.tool_choice == "required"

    def sampling_overrides(self) -> dict[str, Any]:
        """What vLLM's parser changed for sampling: the forced call's constraint, and special tokens kept
        where tool-call markers are special tokens."""
        overrides: dict[str, Any] = {}
        if self.request.structured_outputs is not None:
            overrides["structured_outputs"] = self.request.structured_outputs
        if not self.request.skip_special_tokens:
            overrides["skip_special_tokens"] = False
        return overrides

    def choice_parser(self) -> ChoiceToolParser:
        return ChoiceToolParser(self)


def _tool_call_deltas(message: DeltaMessage | None) -> list[engine_pb2.ToolCallDelta]:
    if message is None:
        return []
    out = []
    for call in message.tool_calls:
        function = call.function
        out.append(engine_pb2.ToolCallDelta(
            index=call.index, id=call.id or "", type=call.type or "",
            function_name=(function.name or "") if function else "",
            function_arguments=(function.arguments or "") if function else "",
        ))
    return out


class ChoiceToolParser:
    """Parses one choice: per delta (vLLM's stream path) and, at the end, in whole (its full path)."""

    def __init__(self, tools: ToolRequest):
        self.tools = tools
        self.stream_parser = tools.calling.new_parser(tools.request)
        self.text = ""
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.streamed_calls = False

    def delta(self, delta: engine_pb2.ChoiceDelta, prompt_token_ids: list[int] | None, finished: bool) -> None:
        """Turns the delta's `text` into its `parsed` variant: the raw text, its content and tool-call
        fragments, and, when finished, the whole text parsed at once."""
        text = delta.text
        parsed = delta.parsed
        parsed.raw_text = text  # sets the `output` oneof to `parsed`, even for empty text
        message = self._advance(text, list(delta.token_ids), prompt_token_ids, finished=finished)
        if message is not None:
            if message.content:
                parsed.content = message.content
            parsed.tool_calls.extend(_tool_call_deltas(message))
        if finished:
            raw = delta.finish_reason or engine_pb2.FINISH_REASON_STOP
            parsed.whole.CopyFrom(self.parse_whole(raw))
            # As vLLM streams it: "tool_calls" when calls were streamed, but "stop" for a named choice.
            if self.streamed_calls and not self.tools.named and raw == engine_pb2.FINISH_REASON_STOP:
                delta.finish_reason = engine_pb2.FINISH_REASON_TOOL_CALLS

    def replay(self, pieces: Iterable[tuple[str, list[int]]], prompt_token_ids: list[int] | None) -> None:
        """Feeds the output another worker already streamed (GenerateRequest.resume), as pieces of text with
        the ids that completed them, through the parser, emitting nothing: a tool call that worker began
        continues here as it would have there."""
        for text, ids in pieces:
            self._advance(text, ids, prompt_token_ids, finished=False)

    def _advance(self, text: str, token_ids: list[int], prompt_token_ids: list[int] | None, *,
                 finished: bool) -> DeltaMessage | None:
        """Parses one more piece of the choice's output (vLLM's stream path)."""
        if prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = prompt_token_ids
        self.text += text
        self.token_ids.extend(token_ids)
        message = self.stream_parser.parse_delta(
            delta_text=text, delta_token_ids=token_ids, request=self.tools.request,
            prompt_token_ids=self.prompt_token_ids, finished=finished,
        )
        if message is None:
            return None
        message = maybe_filter_parallel_tool_calls(message, self.tools.request)
        if message.tool_calls:
            self.streamed_calls = True
        return message

    def parse_whole(self, finish_reason: engine_pb2.FinishReason) -> engine_pb2.ParsedChoice:
        """The choice as vLLM's non-streaming chat completion builds it."""
        tools = self.tools
        parser = tools.calling.new_parser(tools.request)
        if self.prompt_token_ids is not None:
            parser.set_prompt_token_ids(self.prompt_token_ids)
        _, content, calls = parser.parse(self.text, tools.request, enable_auto_tools=tools.calling.enable_auto_tools,
                                         model_output_token_ids=self.token_ids)
        calls = maybe_filter_parallel_tool_calls(list(calls or []), tools.request)
        parsed = engine_pb2.ParsedChoice(finish_reason=finish_reason)
        if tools.named or tools.required:
            parsed.content = content or ""
        elif content is not None:
            parsed.content = content
        for call in calls:
            parsed.tool_calls.append(engine_pb2.ToolCall(
                id=call.id or make_tool_call_id(), type="function",
                function_name=call.name, function_arguments=call.arguments,
            ))
        auto_called = not (tools.named or tools.required) and bool(calls)
        if auto_called or (tools.required and finish_reason == engine_pb2.FINISH_REASON_STOP):
            parsed.finish_reason = engine_pb2.FINISH_REASON_TOOL_CALLS
        return parsed
