"""OpenAI's Responses API (/v1/responses) over the same engine calls as chat completions: a request's
items become a chat completion's messages (routed, retried and migrated as one), its answer becomes
output items (a message with output_text, function calls), whole or as the typed stream of events.

Stored responses (`store`, on by default as in OpenAI's API) go to the response store (response_store.py):
Redis where the fleet has one, so that `previous_response_id`, GET, cancel and DELETE work whichever
gateway replica takes the call; scoped by tenant; bounded by a TTL and a byte cap.

`background` responses run in the gateway that took them, as a task of their own, tied to no client;
their status is in the store. A cancel taken by another replica is seen by the running one within
CANCEL_POLL_SECONDS. A worker that fails under a background response is a worker failure like any
other: the request is retried or its stream migrated (failover.py). A gateway that shuts down marks
the ones it was running `failed`.

Where it differs from OpenAI's API: no hosted tools (web search, file search, ...), only function tools;
no `truncation: auto`; no reasoning items (no reasoning parser is wired to the engine contract yet), so
`reasoning` is accepted and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from taco_llm.protos import engine_pb2

from . import sse
from .auth import tenant_of
from .errors import APIError, bad_request
from .failover import EngineStream
from .from_engine import TokenText, chat_logprobs, collect, finish_reason
from .protocol import ChatCompletionRequest
from .request_context import RequestContext
from .response_store import ResponseStore, StoredResponse
from .responses_protocol import ResponsesRequest
from .serving import unless_disconnected
from .serving_chat import ServingChat

logger = logging.getLogger(__name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What `include` may ask for: logprobs; and reasoning.encrypted_content, which agents send with every
# request and which asks for nothing here (no reasoning items are made).
INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})
# A response still being generated; only these may be cancelled, or overwritten by their runner.
LIVE = frozenset({"queued", "in_progress"})
CANCEL_POLL_SECONDS = 0.5
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Chat completion fields a Responses request passes on under the same name (vLLM's extras among them).
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "priority", "request_id", "parallel_tool_calls", "user")


def store_scope(request: Request) -> str:
    """Whose responses a request may see: its tenant's (tenants.py); "" for the default tenant, and for
    a gateway that wants no key."""
    tenant = tenant_of(request)
    return tenant.name if tenant is not None else ""


# ---- a request as a chat completion


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's input: messages, function calls (as the assistant's tool calls,
    consecutive calls in one message) and their outputs (as `tool` messages). Reasoning items are dropped:
    they are the model's own notes, never shown to it again here."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, f"input[{i}]"))
        elif kind == "function_call":
            call = _function_call(item, f"input[{i}]")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("_open_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call], "_open_calls": True})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", f"input[{i}]"),
                             "content": _output_text(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input items of type {kind!r} are not supported: only message, function_call, "
                              "function_call_output and reasoning", f"input[{i}].type")
    for message in messages:
        message.pop("_open_calls", None)
    return messages


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} is required, as a string", f"{param}.{name}")
    return value


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad_request(f"role {role!r} is not one of {', '.join(_ROLES)}", f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad_request("content is a string or a list of content parts", f"{param}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _string(part, "text", f"{param}.content[{j}]")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad_request("an input_image needs its image_url (file ids are not supported)",
                                  f"{param}.content[{j}].image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_request(f"content parts of type {kind!r} are not supported: only input_text, output_text, "
                              "refusal and input_image", f"{param}.content[{j}].type")
    if role != "user" or not any(p["type"] == "image_url" for p in parts):
        return {"role": _ROLES[role], "content": "".join(p["text"] for p in parts)}
    return {"role": "user", "content": parts}


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise bad_request("arguments is a string (the call's JSON arguments)", f"{param}.arguments")
    return {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param), "arguments": arguments}}


def _output_text(output: Any, param: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
    raise bad_request("output is a string or a list of input_text parts", param)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools of type {tool.get('type')!r} are not supported: only function tools",
                              f"tools[{i}].type")
        function: dict[str, Any] = {"name": _string(tool, "name", f"tools[{i}]"),
                                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: the worker names any other value
    if choice.get("type") != "function":
        raise bad_request(f"a tool_choice of type {choice.get('type')!r} is not supported: auto, none, "
                          "required, or a function by name", "tool_choice.type")
    return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}


def chat_request(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                                  list[dict[str, Any]]]:
    """The chat completion of a request, and its conversation without the instructions (what a later
    `previous_response_id` continues from): the earlier conversation, then this input."""
    for i, name in enumerate(body.include or []):
        if name not in INCLUDES:
            raise bad_request(f"{name!r} cannot be included: only {', '.join(sorted(INCLUDES))}", f"include[{i}]")
    if body.truncation not in (None, "disabled"):
        raise bad_request("only truncation 'disabled' is supported: a conversation longer than the model's "
                          "context is refused", "truncation")
    conversation = [*earlier, *input_messages(body.input)]
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens}
    for name in _PASSED:
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.tools:
        fields["tools"] = chat_tools(body.tools)
    if body.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(body.tool_choice)
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        fmt = body.text.format
        if fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        else:
            if fmt.json_schema is None:
                raise bad_request("a json_schema format needs its schema", "text.format.schema")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict,
                "description": fmt.description}}
    if LOGPROBS_INCLUDE in (body.include or []):
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    try:
        return ChatCompletionRequest.model_validate(fields), conversation
    except ValidationError as error:
        raise bad_request(str(error.errors()[0].get("msg", error)), "input") from None


# ---- output items


class OutputItems:
    """A response's output items as the deltas come: a message item with one output_text part, then a
    function_call item per tool call; each change also as the stream event that tells it (without its
    sequence_number, which the stream adds). Whole answers go through the same path, their events unread."""

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text
        self.items: list[dict[str, Any]] = []
        self._message: int | None = None  # the output index of the open message item
        self._calls: dict[int, int] = {}  # the worker's tool call index -> output index
        self._closed: set[int] = set()
        self.finish: str | None = None

    @property
    def incomplete(self) -> bool:
        return self.finish == "length"

    def add(self, delta: engine_pb2.ChoiceDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        logprobs = chat_logprobs(list(delta.logprobs), self.token_text)["content"] if delta.logprobs else []
        if delta.WhichOneof("output") == "parsed":
            if delta.parsed.HasField("content") and delta.parsed.content:
                events += self.text(delta.parsed.content, logprobs)
            for call in delta.parsed.tool_calls:
                events += self.call(call.index, call_id=call.id, name=call.function_name,
                                    arguments=call.function_arguments)
        elif delta.text or logprobs:
            events += self.text(delta.text, logprobs)
        if delta.finish_reason:
            self.finish = finish_reason(delta.finish_reason)
        return events

    def text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._message is None:
            self._message = len(self.items)
            new: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                                   "role": "assistant", "content": []}
            self.items.append(new)
            events.append({"type": "response.output_item.added", "output_index": self._message,
                           "item": copy.deepcopy(new)})
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            new["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": new["id"],
                           "output_index": self._message, "content_index": 0, "part": copy.deepcopy(part)})
        item = self.items[self._message]
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": self._message,
                       "content_index": 0, "delta": text, "logprobs": logprobs})
        return events

    def call(self, index: int, *, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if index not in self._calls:
            events += self._close_message()
            self._calls[index] = len(self.items)
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": ""}
            self.items.append(item)
            events.append({"type": "response.output_item.added", "output_index": self._calls[index],
                           "item": copy.deepcopy(item)})
        item = self.items[self._calls[index]]
        if arguments:
            item["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": self._calls[index], "delta": arguments})
        return events

    def close(self) -> list[dict[str, Any]]:
        """The .done events of every item still open, in output order."""
        events = self._close_message()
        for output_index in sorted(self._calls.values()):
            if output_index in self._closed:
                continue
            self._closed.add(output_index)
            item = self.items[output_index]
            item["status"] = "completed"
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": output_index, "name": item["name"], "arguments": item["arguments"]})
            events.append({"type": "response.output_item.done", "output_index": output_index,
                           "item": copy.deepcopy(item)})
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        output_index, self._message = self._message, None
        self._closed.add(output_index)
        item = self.items[output_index]
        item["status"] = "incomplete" if self.incomplete else "completed"
        part = item["content"][0]
        common = {"item_id": item["id"], "output_index": output_index, "content_index": 0}
        return [{"type": "response.output_text.done", **common, "text": part["text"], "logprobs": part["logprobs"]},
                {"type": "response.content_part.done", **common, "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": output_index, "item": copy.deepcopy(item)}]

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a later turn shows the model."""
        text = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return message


def usage_of(usage: engine_pb2.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class _Response:
    """One response's fixed fields (from its request) and how it is written at each status."""

    def __init__(self, body: ResponsesRequest, conversation: list[dict[str, Any]], *, model: str) -> None:
        self.body = body
        self.conversation = conversation
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model

    def json(self, status: str, output: OutputItems | None = None, *, usage: dict[str, Any] | None = None,
             error: APIError | None = None) -> dict[str, Any]:
        body = self.body
        text_format = (body.text.format.model_dump(by_alias=True, exclude_none=True)
                       if body.text is not None and body.text.format is not None else {"type": "text"})
        incomplete = output is not None and output.incomplete
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output.items if output is not None else [],
            "usage": usage, "error": None if error is None else {"code": str(error.code or error.status),
                                                                 "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "previous_response_id": body.previous_response_id,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "text": {"format": text_format}, "truncation": "disabled",
            "store": body.store is not False, "background": bool(body.background),
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "user": body.user,
        }

    def finished(self, output: OutputItems, usage: engine_pb2.Usage | None) -> StoredResponse:
        status = "incomplete" if output.incomplete else "completed"
        return StoredResponse(self.json(status, output, usage=usage_of(usage)),
                              [*self.conversation, output.assistant_message()])

    def failed(self, error: APIError, output: OutputItems | None = None) -> StoredResponse:
        return StoredResponse(self.json("failed", output, error=error), self.conversation)


class ServingResponses:
    def __init__(self, chat: ServingChat, store: ResponseStore, token_text: TokenText) -> None:
        self.chat = chat
        self.store = store
        self.token_text = token_text
        # The background responses this gateway is running, by id.
        self._background: dict[str, asyncio.Task[None]] = {}
        self._closing = False

    async def create(self, body: ResponsesRequest, request: Request, *,
                     cache_salt: str | None) -> Response | dict[str, Any]:
        scope = store_scope(request)
        earlier = await self._earlier(scope, body.previous_response_id)
        chat, conversation = chat_request(body, earlier)
        chat.cache_salt = cache_salt
        stored = body.store is not False
        if body.background:
            if not stored:
                raise bad_request("a background response is stored: it cannot have store false", "background")
            if body.stream:
                raise bad_request("a background response is not streamed: poll GET /v1/responses/{id}", "stream")
            return await self._start_background(scope, body, chat, conversation)
        try:
            opened = await self.chat.open(chat, request)
        except APIError as error:
            raise _in_responses_terms(error) from None
        if isinstance(opened, JSONResponse):
            return opened
        context, stream = opened
        response = _Response(body, conversation, model=context.model)
        if body.stream:
            return StreamingResponse(self._events(scope, response, context, stream),
                                     media_type="text/event-stream")
        return await unless_disconnected(request, self._whole(scope if stored else None, response, stream))

    async def retrieve(self, response_id: str, request: Request) -> dict[str, Any]:
        return (await self._stored(store_scope(request), response_id)).response

    async def cancel(self, response_id: str, request: Request) -> dict[str, Any]:
        """Cancels a background response under way (its runner stops its engine request); a finished one
        is answered as it is."""
        scope = store_scope(request)
        record = await self._stored(scope, response_id)
        if not record.response.get("background"):
            raise bad_request("only background responses can be cancelled", "response_id")
        if record.status in LIVE:
            record.response["status"] = "cancelled"
            if not await self.store.put(scope, record, only_from=LIVE):  # it finished meanwhile
                record = await self._stored(scope, response_id)
            task = self._background.get(response_id)
            if task is not None:
                task.cancel()
        return record.response

    async def delete(self, response_id: str, request: Request) -> dict[str, Any]:
        if not await self.store.delete(store_scope(request), response_id):
            raise _not_found(response_id)
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
        return {"id": response_id, "object": "response", "deleted": True}

    async def close(self) -> None:
        """Shutdown: the background responses under way end `failed` (their runners write it)."""
        self._closing = True
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.close()

    async def _earlier(self, scope: str, previous_id: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        record = await self.store.get(scope, previous_id)
        if record is None:
            raise bad_request(f"no stored response {previous_id!r} (never stored, expired or deleted)",
                              "previous_response_id")
        if record.status in LIVE:
            raise bad_request(f"response {previous_id!r} is still {record.status}", "previous_response_id")
        return record.messages

    async def _stored(self, scope: str, response_id: str) -> StoredResponse:
        record = await self.store.get(scope, response_id)
        if record is None:
            raise _not_found(response_id)
        return record

    async def _put(self, scope: str | None, record: StoredResponse, *,
                   only_from: frozenset[str] | None = None) -> None:
        """Stores `record`. One larger than the store takes is logged and not stored; a background one
        (`only_from`: it replaces its own record) is stored as `failed`, saying so, so that a client
        polling it learns why rather than finding it gone."""
        if scope is None:
            return
        if len(record.body()) > self.store.max_bytes:
            logger.warning("response %s is larger than --responses-max-bytes (%d)%s", record.response["id"],
                           self.store.max_bytes, ": stored as failed" if only_from else ": not stored")
            if only_from is None:
                return
            too_large = APIError(400, f"the response is larger than this server stores ({self.store.max_bytes} "
                                      "bytes, its --responses-max-bytes)", code="response_too_large")
            record = StoredResponse({**record.response, "status": "failed", "output": [], "usage": None,
                                     "error": {"code": too_large.code, "message": too_large.message}}, [])
        await self.store.put(scope, record, only_from=only_from)

    async def _whole(self, scope: str | None, response: _Response, stream: EngineStream) -> dict[str, Any]:
        result = await collect(stream, 1)
        message, finish = self.chat.message(result.choices[0])
        output = OutputItems(self.token_text)
        logprobs = (chat_logprobs(result.choices[0].logprobs, self.token_text)["content"]
                    if result.choices[0].logprobs else [])
        if message["content"]:
            output.text(message["content"], logprobs)
        for i, call in enumerate(message["tool_calls"]):
            output.call(i, call_id=call["id"], name=call["function"]["name"],
                        arguments=call["function"]["arguments"])
        output.finish = finish
        output.close()
        record = response.finished(output, result.usage)
        await self._put(scope, record)
        return record.response

    async def _events(self, scope: str, response: _Response, context: RequestContext,
                      stream: EngineStream) -> AsyncIterator[bytes]:
        stored = response.body.store is not False
        sequence = 0

        def event(fields: dict[str, Any]) -> bytes:
            nonlocal sequence
            sequence += 1
            return sse.typed_event({**fields, "sequence_number": sequence - 1})

        output = OutputItems(self.token_text)
        try:
            yield event({"type": "response.created", "response": response.json("in_progress")})
            yield event({"type": "response.in_progress", "response": response.json("in_progress")})
            async for message in stream.messages():
                phase = message.WhichOneof("phase")
                if phase == "delta":
                    for delta in message.delta.choices:
                        for fields in output.add(delta):
                            yield event(fields)
                elif phase == "finished":
                    for fields in output.close():
                        yield event(fields)
                    record = response.finished(output, message.finished.usage)
                    await self._put(scope if stored else None, record)
                    kind = "response.incomplete" if output.incomplete else "response.completed"
                    yield event({"type": kind, "response": record.response})
        except APIError as error:
            record = response.failed(error, output)
            with contextlib.suppress(APIError):
                await self._put(scope if stored else None, record)
            yield event({"type": "response.failed", "response": record.response})
        finally:
            stream.close()

    async def _start_background(self, scope: str, body: ResponsesRequest, chat: ChatCompletionRequest,
                                conversation: list[dict[str, Any]]) -> dict[str, Any]:
        response = _Response(body, conversation, model=body.model or "")
        queued = StoredResponse(response.json("queued"), conversation)
        if not await self.store.put(scope, queued):
            raise bad_request("the response would be larger than this server stores (--responses-max-bytes)",
                              "input")
        task = asyncio.create_task(self._run(scope, response, chat))
        self._background[response.id] = task
        task.add_done_callback(lambda _: self._background.pop(response.id, None))
        return queued.response

    async def _run(self, scope: str, response: _Response, chat: ChatCompletionRequest) -> None:
        """A background response, from queued to its end; stops where its status has left LIVE (a cancel,
        from any replica) or its record has gone (a DELETE). Its end is always written, if the store
        answers: a store that fails the last write leaves the record as it was, to expire."""
        runner = asyncio.current_task()
        assert runner is not None
        watcher = asyncio.create_task(self._watch(scope, response.id, runner))
        output: OutputItems | None = None
        end: StoredResponse | None = None
        try:
            end = await self._generate(scope, response, chat, output := OutputItems(self.token_text))
        except APIError as error:
            end = response.failed(_in_responses_terms(error), output)
        except asyncio.CancelledError:
            if self._closing:
                end = response.failed(APIError(503, "the gateway shut down before the response was finished",
                                               code="gateway_shutdown"), output)
            raise
        except Exception:
            logger.exception("background response %s failed", response.id)
            end = response.failed(APIError(500, "the server failed while generating"), output)
        finally:
            watcher.cancel()
            if end is not None:
                with contextlib.suppress(APIError):
                    await self._put(scope, end, only_from=LIVE)

    async def _generate(self, scope: str, response: _Response, chat: ChatCompletionRequest,
                        output: OutputItems) -> StoredResponse | None:
        """A background response's generation into `output`: its finished record, or None where it was
        cancelled or deleted before it began."""
        opened = await self.chat.open(chat, None)
        assert not isinstance(opened, JSONResponse)  # no client to leave
        context, stream = opened
        try:
            response.model = context.model
            if not await self.store.put(scope, StoredResponse(response.json("in_progress"), response.conversation),
                                        only_from=LIVE):
                return None
            usage = None
            async for message in stream.messages():
                if message.WhichOneof("phase") == "delta":
                    for delta in message.delta.choices:
                        output.add(delta)
                elif message.WhichOneof("phase") == "finished":
                    usage = message.finished.usage
        finally:
            stream.close()  # whatever happened: the engine request ends with it
        output.close()
        return response.finished(output, usage)

    async def _watch(self, scope: str, response_id: str, runner: asyncio.Task[None]) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_SECONDS)
            try:
                record = await self.store.get(scope, response_id)
            except APIError:
                continue  # the store is out for now; the runner goes on
            if record is None or record.status not in LIVE:
                runner.cancel()
                return


# The worker names a chat completion's fields; the client sent these.
_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input",
           "logprobs": "include"}


def _in_responses_terms(error: APIError) -> APIError:
    """A refusal of the chat completion, naming the Responses request's field instead."""
    if error.param is not None:
        head = error.param.split(".", 1)[0]
        if head in _FIELDS:
            # An index into the messages is no index into the input (the instructions and the earlier
            # conversation come first): the input as a whole is named.
            error.param = _FIELDS[head] if head == "messages" else _FIELDS[head] + error.param[len(head):]
    return error


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r} (never stored, expired or deleted)",
                    param="response_id", code="response_not_found")
