"""The bodies of OpenAI's Responses API (/v1/responses), as the openai SDK sends them, and the models that
document its answers in /openapi.json.

Only types are checked here, as in protocol.py: ranges are the worker's to check. The input items and
tools are taken as plain objects and read by serving_responses.py, which names the item and field at
fault (`input.2.call_id`) where a typed union would name the union's members instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningOptions(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    # A user message's text, or a list of items: messages, function calls and their outputs, reasoning.
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    background: bool | None = False
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningOptions | None = None
    truncation: str | None = None
    user: str | None = None
    # vLLM's extra sampling and request fields, as on a chat completion.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None
    cache_salt: str | None = None
    request_id: str | None = None


# ---- What the routes answer, for /openapi.json only (see protocol.py).


class ResponseUsage(_Lenient):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(_Lenient):
    """A response: its output items (messages with output_text parts, function calls) and its status
    (queued, in_progress, completed, incomplete, failed or cancelled)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None


class ResponseStreamEvent(_Lenient):
    """One event of a streamed response (response.created, response.output_text.delta, ...,
    response.completed), numbered by sequence_number."""

    type: str
    sequence_number: int


class DeletedResponse(_Lenient):
    id: str
    object: Literal["response"]
    deleted: bool
