"""The bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as its SDK sends them.

Only types are checked here, as in protocol.py: ranges are the worker's to check. Unknown fields are
accepted and ignored, as Anthropic's API does with the ones it adds later.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ImageSource(_Lenient):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Lenient):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Lenient):
    """A reasoning block of an earlier assistant turn, which clients send back; not shown to the model."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class InputMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Anthropic's server tools (web search, ...) carry a type; custom tools have none or "custom".
    type: str | None = None
    # The input must follow input_schema exactly (Anthropic's strict tool use).
    strict: bool | None = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Conversation(_Lenient):
    model: str
    messages: list[InputMessage] = Field(json_schema_extra={"minItems": 1})
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(_Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(_Conversation):
    pass


# -- answers (documented in /openapi.json) --------------------------------------------------------


class Usage(_Lenient):
    input_tokens: int
    output_tokens: int


class MessagesResponse(_Lenient):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    # text blocks {"type": "text", "text"} and tool_use blocks {"type": "tool_use", "id", "name", "input"}
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(_Lenient):
    input_tokens: int


class AnthropicErrorDetail(_Lenient):
    type: str
    message: str


class AnthropicErrorResponse(_Lenient):
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessagesStreamEvent(_Lenient):
    """One server-sent event of a streamed message: message_start, content_block_start,
    content_block_delta, content_block_stop, message_delta, message_stop, ping or error."""

    type: str
