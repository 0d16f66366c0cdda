"""/v1/chat/completions: an OpenAI chat body in, the engine's stream out as one reply or as chunks."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from taco_llm.protos import engine_pb2

from . import sse, to_engine
from .errors import APIError, bad_request
from .failover import EngineStream
from .from_engine import (
    ChoiceState,
    Sourced,
    TokenText,
    chat_logprobs,
    coalesced,
    collect,
    finish_reason,
    prompt_logprobs_json,
    stop_reason,
    usage_json,
)
from .protocol import BatchChatCompletionRequest, ChatCompletionRequest, ChatMessageParam
from .request_context import OutputOptions, RequestContext
from .routing import RouteKey
from .serving import EngineCalls, unless_disconnected, usage_options


class ServingChat:
    """Made once per app, with the workers and the server's output options (from flags)."""

    def __init__(self, engines: EngineCalls, *, response_role: str, token_text: TokenText,
                 stream_interval: int = 1, max_conversations_per_batch: int | None = None) -> None:
        self.engines = engines
        # --max-prompts-per-batch, for /v1/chat/completions/batch's conversations.
        self.max_conversations_per_batch = max_conversations_per_batch
        self.response_role = response_role
        self.token_text = token_text
        # vLLM's --stream-interval: at most one chunk per this many tokens (see from_engine.coalesced).
        self.stream_interval = stream_interval

    async def create(self, body: ChatCompletionRequest,
                     request: Request) -> StreamingResponse | JSONResponse | dict[str, Any]:
        opened = await self.open(body, request)
        if isinstance(opened, JSONResponse):
            return opened
        context, stream = opened
        if body.stream:
            return StreamingResponse(self._chunks(context, stream), media_type="text/event-stream")
        return await unless_disconnected(request, self._whole(context, stream))

    async def open(self, body: ChatCompletionRequest,
                   request: Request | None) -> tuple[RequestContext, EngineStream] | JSONResponse:
        """The request's engine stream, open on a worker (its first message read), and its context; the
        answer to send instead where the client left first. Other front ends (the Messages and Responses
        APIs) shape its output their own way. `request` None: no client waits on it (a background
        response), so nothing cancels it but its caller."""
        arrival = time.perf_counter()
        if body.echo:
            raise bad_request("echo is not supported for chat completions", "echo")
        request_id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        engine_request = to_engine.chat_request(body, request_id)
        route_key = RouteKey(model=body.model, prefix_text=_prefix_text(body.messages),
                             cache_salt=body.cache_salt or "")
        # The first message comes after the prefill, and the request may wait in the engine's queue before
        # it: a client that leaves meanwhile cancels it there, rather than having it prefilled for nobody.
        opening = self.engines.generate(
            engine_request, to_engine.request_params(to_engine.CHAT_PARAMS, body), route_key, arrival=arrival)
        stream = await (opening if request is None else unless_disconnected(request, opening))
        if isinstance(stream, JSONResponse):
            return stream
        include_usage, continuous_usage = usage_options(body.stream_options)
        context = RequestContext(
            request_id=request_id, model=stream.model_name, created=int(time.time()),
            n=engine_request.sampling.n or 1,
            options=OutputOptions(include_usage=include_usage, continuous_usage=continuous_usage,
                                  logprobs=bool(body.logprobs), return_token_ids=bool(body.return_token_ids),
                                  prompt_logprobs=body.prompt_logprobs is not None),
        )
        return context, stream

    async def create_batch(self, body: BatchChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
        """/v1/chat/completions/batch: each conversation a chat completion of its own (each routed on
        its own prefix), answered together: choice i for conversation i, the usage summed."""
        for field, refused in (("stream", bool(body.stream)), ("tools", bool(body.tools)),
                               ("n", body.n not in (None, 1))):
            if refused:
                raise bad_request(f"{field} is not supported by /v1/chat/completions/batch", field)
        limit = self.max_conversations_per_batch
        if limit is not None and len(body.messages) > limit:
            raise bad_request(f"{len(body.messages)} conversations is more than this server takes in one batch "
                              f"({limit}, its --max-prompts-per-batch)", "messages")
        shared = body.model_dump(exclude={"messages", "request_id"}, exclude_unset=True)
        batch_id = body.request_id or uuid.uuid4().hex
        conversations = [ChatCompletionRequest.model_validate(
            {**shared, "messages": [m.model_dump(exclude_unset=True) for m in messages],
             "request_id": f"{batch_id}-{i}"}) for i, messages in enumerate(body.messages)]
        tasks = [asyncio.ensure_future(self.create(conversation, request)) for conversation in conversations]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one refused: the others are not generated for nobody
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        replies = [answer for answer in answers if isinstance(answer, dict)]
        if len(replies) < len(answers):  # the client left: what create() answers for that
            return next(answer for answer in answers if not isinstance(answer, dict))
        usage = {key: sum(reply["usage"][key] for reply in replies)
                 for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        choices = [{**reply["choices"][0], "index": i} for i, reply in enumerate(replies)]
        return {**replies[0], "id": f"chatcmpl-{batch_id}", "choices": choices, "usage": usage}

    async def _whole(self, context: RequestContext, stream: EngineStream) -> dict[str, Any]:
        options = context.options
        result = await collect(stream, context.n)
        choices = []
        for c in result.choices:
            message, reason = self.message(c)
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

    def message(self, c: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The reply message and its finish reason; where the worker parsed tool calls, its parse."""
        if c.parsed is None:
            return {"role": self.response_role, "content": c.text, "tool_calls": []}, c.finish_reason
        content = c.parsed.content if c.parsed.HasField("content") else None
        message = {"role": self.response_role, "content": content,
                   "tool_calls": [_tool_call(t) for t in c.parsed.tool_calls]}
        return message, finish_reason(c.parsed.finish_reason) or c.finish_reason

    async def _chunks(self, context: RequestContext, stream: EngineStream) -> AsyncIterator[bytes]:
        options = context.options
        form = sse.ChunkFormat(context, "chat.completion.chunk")
        usage_so_far = _UsageSoFar() if options.continuous_usage and options.include_usage else None
        try:
            yield form.chunk(sse.dumps({"index": i, "delta": {"role": self.response_role, "content": ""},
                                        "logprobs": None, "finish_reason": None}) for i in range(context.n))
            # aclosing: a client that leaves stops the reading task (and so the engine request) at once.
            batches = coalesced([stream.messages()], stream_interval=self.stream_interval)
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    yield self._events(form, options, batch, usage_so_far)
        except APIError as error:
            yield sse.error_event(error)
        finally:
            # A client that leaves during the role chunk never starts messages(), whose own `finally`
            # would close the stream: close it here, or its worker keeps the stream on its books.
            stream.close()
        yield sse.DONE

    def _events(self, form: sse.ChunkFormat, options: OutputOptions, batch: list[Sourced],
                usage_so_far: _UsageSoFar | None) -> bytes:
        """The SSE events of the messages that came together: one chunk where their deltas merge safely
        (see _merges), more where they do not, and the usage chunk at the end."""
        out: list[str] = []
        # choice index -> the deltas merged into the chunk being built
        runs: dict[int, list[engine_pb2.ChoiceDelta]] = {}

        def flush() -> None:
            choices = [c for c in (self._choice_json(run, options) for run in runs.values()) if c is not None]
            if choices:
                out.append(form.text(choices) if usage_so_far is None else
                           form.usage_chunk(usage_so_far.json(), choices).decode())
            runs.clear()

        for _, message in batch:
            phase = message.WhichOneof("phase")
            if phase == "delta":
                for delta in message.delta.choices:
                    if usage_so_far is not None:
                        usage_so_far.completion_tokens += len(delta.token_ids)
                    run = runs.get(delta.index)
                    if run is None:
                        runs[delta.index] = [delta]
                    elif _merges(run[-1], delta):
                        run.append(delta)
                    else:
                        flush()
                        runs[delta.index] = [delta]
                # Without continuous usage, a chunk's content does not depend on where it is cut.
                if usage_so_far is not None:
                    flush()
            elif phase == "started":
                if usage_so_far is not None:
                    usage_so_far.prompt_tokens = len(message.started.prompt_token_ids)
            elif phase == "finished":
                flush()
                if options.include_usage:
                    out.append(form.usage_chunk(usage_json(message.finished.usage)).decode())
        flush()
        return "".join(out).encode()

    def _choice_json(self, run: list[engine_pb2.ChoiceDelta], options: OutputOptions) -> str | None:
        """One choice of a chunk, of one delta or several merged; None where it shows the client nothing."""
        last = run[-1]
        return_token_ids = options.return_token_ids
        if last.WhichOneof("output") != "parsed" and not last.finish_reason and not return_token_ids:
            # The common case, written without building a dict: text only, logprobs maybe.
            text = last.text if len(run) == 1 else "".join(d.text for d in run)
            logprobs = _run_logprobs(run)
            if not text and not logprobs:
                return None
            delta_json = '{"content":' + sse.string(text) + "}" if text else "{}"
            shown = sse.dumps(chat_logprobs(logprobs, self.token_text)) if logprobs else "null"
            return f'{{"index":{last.index},"delta":{delta_json},"logprobs":{shown},"finish_reason":null}}'
        content = _chat_delta(last) if len(run) == 1 else _merged_delta(run)
        logprobs = _run_logprobs(run)
        # A delta that shows no text yet (part of a character, tool-call markup held back) still carries
        # its token ids: sent with an empty delta, as vLLM's server does, or the client's ids would not add
        # up to the answer's.
        if (not content and not last.finish_reason and not logprobs
                and not (return_token_ids and any(d.token_ids for d in run))):
            return None
        choice: dict[str, Any] = {
            "index": last.index,
            "delta": content,
            "logprobs": chat_logprobs(logprobs, self.token_text) if logprobs else None,
            "finish_reason": finish_reason(last.finish_reason),
        }
        if last.finish_reason:
            choice["stop_reason"] = stop_reason(last)
        if return_token_ids:
            choice["token_ids"] = [t for d in run for t in d.token_ids]
        return sse.dumps(choice)


class _UsageSoFar:
    """continuous_usage_stats: every chunk carries the usage so far, as in vLLM's server."""

    __slots__ = ("completion_tokens", "prompt_tokens")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def json(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _merges(earlier: engine_pb2.ChoiceDelta, later: engine_pb2.ChoiceDelta) -> bool:
    """Whether two consecutive deltas of a choice say the same as one: text after text, or parsed
    content after parsed content, the earlier not the choice's last. Tool-call fragments are never
    merged: each keeps its own chunk, with its id and name where it starts a call."""
    if earlier.finish_reason:
        return False
    kind = earlier.WhichOneof("output")
    if kind != later.WhichOneof("output"):
        return False
    if kind != "parsed":
        return True
    return not (earlier.parsed.tool_calls or later.parsed.tool_calls or later.parsed.HasField("whole"))


def _merged_delta(run: list[engine_pb2.ChoiceDelta]) -> dict[str, Any]:
    """The OpenAI delta of deltas that _merges joined."""
    if run[-1].WhichOneof("output") != "parsed":
        text = "".join(d.text for d in run)
        return {"content": text} if text else {}
    if not any(d.parsed.HasField("content") for d in run):
        return {}
    return {"content": "".join(d.parsed.content for d in run)}


def _run_logprobs(run: list[engine_pb2.ChoiceDelta]) -> list[engine_pb2.TokenLogprob]:
    if len(run) == 1:
        return list(run[0].logprobs) if run[0].logprobs else []
    return [item for d in run for item in d.logprobs]


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
