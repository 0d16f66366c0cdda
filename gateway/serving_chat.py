"""/v1/chat/completions: an OpenAI chat body in, the engine's stream out as one reply or as chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from taco_llm.protos import engine_pb2

from . import sse, to_engine
from .errors import APIError, bad_request
from .failover import EngineStream
from .from_engine import (
    ChoiceState,
    TokenText,
    chat_logprobs,
    collect,
    finish_reason,
    prompt_logprobs_json,
    stop_reason,
    usage_json,
)
from .protocol import ChatCompletionRequest, ChatMessageParam
from .request_context import OutputOptions, RequestContext
from .routing import RouteKey
from .serving import EngineCalls, unless_disconnected, usage_options


class ServingChat:
    """Made once per app, with the workers and the server's output options (from flags)."""

    def __init__(self, engines: EngineCalls, *, response_role: str, token_text: TokenText) -> None:
        self.engines = engines
        self.response_role = response_role
        self.token_text = token_text

    async def create(self, body: ChatCompletionRequest,
                     request: Request) -> StreamingResponse | JSONResponse | dict[str, Any]:
        arrival = time.perf_counter()
        if body.echo:
            raise bad_request("echo is not supported for chat completions", "echo")
        request_id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        engine_request = to_engine.chat_request(body, request_id)
        route_key = RouteKey(model=body.model, prefix_text=_prefix_text(body.messages),
                             cache_salt=body.cache_salt or "")
        stream = await self.engines.generate(engine_request, to_engine.CHAT_PARAMS, route_key, arrival=arrival)
        include_usage, continuous_usage = usage_options(body.stream_options)
        context = RequestContext(
            request_id=request_id, model=stream.model_name, created=int(time.time()),
            n=engine_request.sampling.n or 1,
            options=OutputOptions(include_usage=include_usage, continuous_usage=continuous_usage,
                                  logprobs=bool(body.logprobs), return_token_ids=bool(body.return_token_ids),
                                  prompt_logprobs=body.prompt_logprobs is not None),
        )
        if body.stream:
            return StreamingResponse(self._chunks(context, stream), media_type="text/event-stream")
        return await unless_disconnected(request, self._whole(context, stream))

    async def _whole(self, context: RequestContext, stream: EngineStream) -> dict[str, Any]:
        options = context.options
        result = await collect(stream, context.n)
        choices = []
        for c in result.choices:
            message, reason = self._message(c)
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs, self.token_text) if options.logprobs else None,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
            if options.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        response = {**context.head("chat.completion"), "choices": choices, "usage": usage_json(result.usage)}
        if options.return_token_ids:
            response["prompt_token_ids"] = result.prompt_token_ids
        if options.prompt_logprobs:
            # vLLM's server puts a chat's prompt logprobs on the response, not on a choice.
            response["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
        return response

    def _message(self, c: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The reply message and its finish reason; where the worker parsed tool calls, its parse."""
        if c.parsed is None:
            return {"role": self.response_role, "content": c.text, "tool_calls": []}, c.finish_reason
        content = c.parsed.content if c.parsed.HasField("content") else None
        message = {"role": self.response_role, "content": content,
                   "tool_calls": [_tool_call(t) for t in c.parsed.tool_calls]}
        return message, finish_reason(c.parsed.finish_reason) or c.finish_reason

    async def _chunks(self, context: RequestContext, stream: EngineStream) -> AsyncIterator[bytes]:
        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            return sse.chunk(context, "chat.completion.chunk", choices, usage)

        options = context.options
        completion_tokens = 0
        prompt_tokens = 0
        try:
            for i in range(context.n):
                yield chunk([{"index": i, "delta": {"role": self.response_role, "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for message in stream.messages():
                match message.WhichOneof("phase"):
                    case "started":
                        prompt_tokens = len(message.started.prompt_token_ids)
                    case "finished":
                        if options.include_usage:
                            yield chunk([], usage_json(message.finished.usage))
                    case "delta":
                        choices = []
                        for delta in message.delta.choices:
                            completion_tokens += len(delta.token_ids)
                            choice = self._chunk_choice(context, delta)
                            if choice is not None:
                                choices.append(choice)
                        # continuous_usage_stats: every chunk carries the usage so far, as in vLLM's server.
                        running_usage = None
                        if options.continuous_usage:
                            running_usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                             "total_tokens": prompt_tokens + completion_tokens}
                        if choices:
                            yield chunk(choices, running_usage)
        except APIError as error:
            yield sse.error_event(error)
        yield sse.DONE

    def _chunk_choice(self, context: RequestContext, delta: engine_pb2.ChoiceDelta) -> dict[str, Any] | None:
        """One choice of a chunk; None for a delta that shows the client nothing."""
        content = _chat_delta(delta)
        if not content and not delta.finish_reason and not delta.logprobs:
            return None
        return {
            "index": delta.index,
            "delta": content,
            "logprobs": chat_logprobs(list(delta.logprobs), self.token_text) if delta.logprobs else None,
            "finish_reason": finish_reason(delta.finish_reason),
            **({"stop_reason": stop_reason(delta)} if delta.finish_reason else {}),
            **({"token_ids": list(delta.token_ids)} if context.options.return_token_ids else {}),
        }


def _prefix_text(messages: list[ChatMessageParam]) -> str:
    """What cache-aware routing matches a chat on: each message's role and text, in order. The template
    renders them in this order, so two chats that share their first messages share a prefix here too."""
    parts: list[str] = []
    for m in messages:
        parts.append(m.role)
        if isinstance(m.content, str):
            parts.append(m.content)
        elif m.content is not None:
            parts.extend(p.text or "" for p in m.content)
    return "\n".join(parts)


def _tool_call(call: engine_pb2.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": call.type or "function",
            "function": {"name": call.function_name, "arguments": call.function_arguments}}


def _tool_call_delta(call: engine_pb2.ToolCallDelta) -> dict[str, Any]:
    """As OpenAI streams a call: id, type and name on its first fragment, argument text on each."""
    out: dict[str, Any] = {"index": call.index}
    if call.id:
        out["id"] = call.id
    if call.type:
        out["type"] = call.type
    function: dict[str, Any] = {"arguments": call.function_arguments}
    if call.function_name:
        function["name"] = call.function_name
    out["function"] = function
    return out


def _chat_delta(delta: engine_pb2.ChoiceDelta) -> dict[str, Any]:
    """The OpenAI delta: the text as it is, or, where the worker parsed tool calls, its parse."""
    if delta.WhichOneof("output") != "parsed":
        return {"content": delta.text} if delta.text else {}
    parsed = delta.parsed
    out: dict[str, Any] = {}
    if parsed.HasField("content"):
        out["content"] = parsed.content
    if parsed.tool_calls:
        out["tool_calls"] = [_tool_call_delta(call) for call in parsed.tool_calls]
    return out
