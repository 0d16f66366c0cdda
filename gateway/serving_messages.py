"""Anthropic's Messages API (/v1/messages and /v1/messages/count_tokens) over the same engine calls as
chat completions: a request becomes a chat completion's (system prompt, turns, tool uses and results,
tools and tool_choice, sampling), routed, retried and migrated as one; its answer is written in
Anthropic's shape, whole or as Anthropic's stream of events. Errors take Anthropic's shape too, by route
(errors.py).

Where the two APIs differ:
- a user turn's tool_result blocks become `tool` messages before the rest of that turn;
- Anthropic's `any` tool_choice is OpenAI's `required`, `disable_parallel_tool_use` the opposite of
  `parallel_tool_calls`;
- stop reasons: stop (a stop sequence: `stop_sequence`, else `end_turn`), length (`max_tokens`),
  tool_calls (`tool_use`);
- `thinking` is refused by name: no reasoning parser is wired to the Messages API yet.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from taco_llm.protos import engine_pb2

from . import sse
from .anthropic_protocol import (
    CountTokensRequest,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from .errors import APIError, bad_request
from .failover import EngineStream
from .from_engine import ChoiceState, collect, finish_reason, stop_reason
from .protocol import ChatCompletionRequest, TokenizeRequest
from .request_context import RequestContext
from .serving import unless_disconnected
from .serving_chat import ServingChat
from .serving_tokenization import ServingTokenization

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def chat_fields(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat completion fields of a Messages API conversation: messages, tools and tool_choice."""
    messages: list[dict[str, Any]] = []
    system = _text_of(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages.extend(_turn(message, i))
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields.update(_tool_choice(body.tool_choice))
    return fields


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise bad_request("extended thinking is not supported by this server", "thinking")
    fields = chat_fields(body)
    fields.update(max_tokens=body.max_tokens, stream=bool(body.stream))
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # a block whose content the chat form cannot hold
        raise bad_request(str(error.errors()[0].get("msg", error)), "messages") from None


def _text_of(content: str | list[TextBlock] | list[TextBlock | ImageBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(block.text for block in content if isinstance(block, TextBlock))


def _turn(message: InputMessage, index: int) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results first (as `tool` messages), then
    its text and images; an assistant turn's text with its tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
        calls = [{"id": block.id, "type": "function",
                  "function": {"name": block.name, "arguments": json.dumps(block.input)}}
                 for block in message.content if isinstance(block, ToolUseBlock)]
        for j, block in enumerate(message.content):
            if isinstance(block, ImageBlock | ToolResultBlock):
                raise bad_request(f"an assistant turn cannot hold a {block.type} block",
                                  f"messages.{index}.content.{j}")
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            result = _text_of(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {result}" if block.is_error else result})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            url = _image_url(block, f"messages.{index}.content.{j}")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(block, ToolUseBlock):
            raise bad_request("a user turn cannot hold a tool_use block", f"messages.{index}.content.{j}")
        elif isinstance(block, ThinkingBlock):
            continue
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _image_url(block: ImageBlock, param: str) -> str:
    source = block.source
    if source.type == "url":
        if not source.url:
            raise bad_request("an image of type url needs its url", f"{param}.source.url")
        return source.url
    if not source.data or not source.media_type:
        raise bad_request("a base64 image needs its media_type and data", f"{param}.source")
    return f"data:{source.media_type};base64,{source.data}"


def _tool(tool: Any, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(f"server tools ({tool.type}) are not supported: only custom tools with an "
                          "input_schema", f"tools.{index}.type")
    if tool.input_schema is None:
        raise bad_request("a custom tool needs its input_schema", f"tools.{index}.input_schema")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    if getattr(tool, "strict", None) is not None:  # Anthropic's strict tool use: the schema is enforced
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("a tool_choice of type tool names the tool", "tool_choice.name")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _stop(finish: str | None, stop: str | int | None, *, called_tools: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice. A choice that called tools stopped for them
    (`tool_use`), even where OpenAI's form says `stop` (a named tool_choice)."""
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    if called_tools and finish in ("stop", "tool_calls"):
        return "tool_use", None
    return _STOP_REASONS.get(finish or "", "end_turn"), None


def _tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as Anthropic's `input` object (the model's text where it is no JSON
    object, under `arguments`, so that nothing it wrote is lost)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class ServingMessages:
    def __init__(self, chat: ServingChat, tokenization: ServingTokenization) -> None:
        self.chat = chat
        self.tokenization = tokenization

    async def create(self, body: MessagesRequest, request: Request, *,
                     cache_salt: str | None) -> Response | dict[str, Any]:
        chat = chat_request(body)
        chat.cache_salt = cache_salt
        opened = await self.chat.open(chat, request)
        if isinstance(opened, JSONResponse):
            return opened
        context, stream = opened
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(self._events(message_id, context, stream), media_type="text/event-stream")
        return await unless_disconnected(request, self._whole(message_id, context, stream))

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, Any]:
        fields = chat_fields(body)
        tokenized = await self.tokenization.tokenize(TokenizeRequest.model_validate(
            {"model": fields["model"], "messages": fields["messages"], "tools": fields.get("tools")}))
        return {"input_tokens": tokenized["count"]}

    async def _whole(self, message_id: str, context: RequestContext, stream: EngineStream) -> dict[str, Any]:
        result = await collect(stream, 1)
        choice: ChoiceState = result.choices[0]
        message, finish = self.chat.message(choice)
        content: list[dict[str, Any]] = []
        if message["content"]:
            content.append({"type": "text", "text": message["content"]})
        for call in message["tool_calls"]:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": _tool_input(call["function"]["arguments"])})
        reason, sequence = _stop(finish, choice.stop_reason, called_tools=bool(message["tool_calls"]))
        usage = result.usage or engine_pb2.Usage()
        return {"id": message_id, "type": "message", "role": "assistant", "model": context.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}}

    async def _events(self, message_id: str, context: RequestContext, stream: EngineStream) -> AsyncIterator[bytes]:
        blocks = _Blocks()
        started = False
        try:
            async for message in stream.messages():
                phase = message.WhichOneof("phase")
                if not started:  # the worker's first message is `started`, with the prompt's tokens
                    started = True
                    prompt_tokens = len(message.started.prompt_token_ids) if phase == "started" else 0
                    yield sse.typed_event({"type": "message_start", "message": {
                        "id": message_id, "type": "message", "role": "assistant", "model": context.model,
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
                if phase == "delta":
                    for delta in message.delta.choices:
                        for event in blocks.add(delta):
                            yield sse.typed_event(event)
                elif phase == "finished":
                    for event in blocks.close():
                        yield sse.typed_event(event)
                    reason, sequence = _stop(blocks.finish, blocks.stop, called_tools=bool(blocks.tool_blocks))
                    yield sse.typed_event({
                        "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {"output_tokens": message.finished.usage.completion_tokens}})
                    yield sse.typed_event({"type": "message_stop"})
        except APIError as error:
            yield sse.typed_event(error.anthropic_body())
        finally:
            stream.close()


class _Blocks:
    """The content blocks of a streamed message, opened and closed as the deltas come: text, then a
    tool_use block per tool call (its arguments as input_json_delta events)."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None
        self.tool_blocks: dict[int, int] = {}  # the worker's tool call index -> block index
        self.finish: str | None = None
        self.stop: str | int | None = None

    def add(self, delta: engine_pb2.ChoiceDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.WhichOneof("output") == "parsed":
            if delta.parsed.HasField("content") and delta.parsed.content:
                events += self._text(delta.parsed.content)
            for call in delta.parsed.tool_calls:
                events += self._tool_call(call)
        elif delta.text:
            events += self._text(delta.text)
        if delta.finish_reason:
            self.finish = finish_reason(delta.finish_reason)
            self.stop = stop_reason(delta)
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = [] if self.open_kind == "text" else self._open({"type": "text", "text": ""}, "text")
        return [*events, {"type": "content_block_delta", "index": self.index,
                          "delta": {"type": "text_delta", "text": text}}]

    def _tool_call(self, call: engine_pb2.ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.index not in self.tool_blocks:
            events += self._open({"type": "tool_use", "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
                                  "name": call.function_name, "input": {}}, "tool_use")
            self.tool_blocks[call.index] = self.index
        if call.function_arguments:
            events.append({"type": "content_block_delta", "index": self.tool_blocks[call.index],
                           "delta": {"type": "input_json_delta", "partial_json": call.function_arguments}})
        return events
