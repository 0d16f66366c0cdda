"""/v1/chat/completions and /v1/completions: OpenAI bodies in, engine streams out."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from protos import engine_pb2

from . import to_engine
from .engine_pool import EnginePool
from .errors import APIError, bad_request, from_grpc
from .from_engine import (
    ChoiceState,
    EngineStream,
    TokenText,
    add_usage,
    chat_logprobs,
    collect,
    completion_logprobs,
    finish_reason,
    prompt_logprobs_json,
    stop_reason,
    usage_json,
)
from .protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


def _pool(request: Request) -> EnginePool:
    return request.app.state.pool  # type: ignore[no-any-return]


def _token_text(request: Request) -> TokenText:
    return TokenText(request.app.state.settings.return_tokens_as_token_ids)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _sse_error(error: APIError) -> bytes:
    return _sse(error.body())


def _chunk(kind: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
           include_usage: bool, usage: dict[str, Any] | None = None) -> bytes:
    """One SSE event; with include_usage every chunk has a `usage` key, null but on the last, as OpenAI's."""
    payload: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model,
                               "choices": choices}
    if include_usage:
        payload["usage"] = usage
    return _sse(payload)


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


def _chat_message(role: str, c: ChoiceState) -> tuple[dict[str, Any], str | None]:
    """The reply message and its finish reason; where the worker parsed tool calls, its parse."""
    if c.parsed is None:
        return {"role": role, "content": c.text, "tool_calls": []}, c.finish_reason
    content = c.parsed.content if c.parsed.HasField("content") else None
    message = {"role": role, "content": content, "tool_calls": [_tool_call(t) for t in c.parsed.tool_calls]}
    return message, finish_reason(c.parsed.finish_reason) or c.finish_reason


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Runs a non-streaming request, cancelling it (and so the engine request) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return JSONResponse({"error": {"message": "client disconnected", "type": "request_cancelled",
                                       "param": None, "code": 499}}, status_code=499)
    return task.result()


def engine_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    key = request.app.state.settings.engine_api_key
    return (("authorization", f"Bearer {key}"),) if key else ()


async def _open(request: Request, engine_request: engine_pb2.GenerateRequest,
                param_names: dict[str, str]) -> EngineStream:
    client = _pool(request).pick(engine_request.model or None)
    if not engine_request.model:
        assert client.info is not None
        engine_request.model = client.info.served_model_names[0]
    stream = EngineStream(client, engine_request, param_names, engine_metadata(request))
    try:
        await stream.first()
    except BaseException:
        stream.close()
        raise
    return stream


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    options = body.stream_options
    if options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


def _response_model(request: Request, body_model: str | None, stream: EngineStream) -> str:
    # As vLLM's: responses carry the worker's first served name whichever of its names was asked for
    # (--served-model-name A B); a LoRA adapter's name is carried as asked.
    info = stream.client.info
    assert info is not None
    adapters = {a.name for a in info.lora_adapters}
    base_names = [n for n in info.served_model_names if n not in adapters]
    return body_model if body_model and body_model not in base_names else base_names[0]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    if body.echo:
        raise bad_request("echo is not supported for chat completions", "echo")
    request_id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
    engine_request = to_engine.chat_request(body, request_id)
    n = engine_request.sampling.n or 1
    stream = await _open(request, engine_request, to_engine.CHAT_PARAMS)
    model = _response_model(request, body.model, stream)
    created = int(time.time())
    role = request.app.state.settings.response_role
    text_of = _token_text(request)
    if body.stream:
        include_usage, continuous = _include_usage(body)
        return StreamingResponse(
            _chat_chunks(stream, request_id, model, created, n, role, text_of, include_usage, continuous,
                         bool(body.return_token_ids)),
            media_type="text/event-stream",
        )

    async def whole() -> dict[str, Any]:
        result = await collect(stream, n)
        choices = []
        for c in result.choices:
            message, finish_reason = _chat_message(role, c)
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs, text_of) if body.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        response: dict[str, Any] = {"id": request_id, "object": "chat.completion", "created": created,
                                    "model": model, "choices": choices, "usage": usage_json(result.usage)}
        if body.return_token_ids:
            response["prompt_token_ids"] = result.prompt_token_ids
        if body.prompt_logprobs is not None:
            # vLLM's server puts a chat's prompt logprobs on the response, not on a choice.
            response["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
        return response

    return await _unless_disconnected(request, whole())


async def _chat_chunks(stream: EngineStream, request_id: str, model: str, created: int, n: int, role: str,
                       text_of: TokenText, include_usage: bool, continuous: bool,
                       token_ids: bool) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        return _chunk("chat.completion.chunk", request_id, created, model, choices, include_usage, usage)

    completion_tokens = 0
    prompt_tokens = 0
    try:
        for i in range(n):
            yield chunk([{"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for message in stream.messages():
            match message.WhichOneof("phase"):
                case "started":
                    prompt_tokens = len(message.started.prompt_token_ids)
                case "finished":
                    if include_usage:
                        yield chunk([], usage_json(message.finished.usage))
                case "delta":
                    choices = []
                    for delta in message.delta.choices:
                        completion_tokens += len(delta.token_ids)
                        content = _chat_delta(delta)
                        if not content and not delta.finish_reason and not delta.logprobs:
                            continue
                        choices.append({
                            "index": delta.index,
                            "delta": content,
                            "logprobs": chat_logprobs(list(delta.logprobs), text_of) if delta.logprobs else None,
                            "finish_reason": finish_reason(delta.finish_reason),
                            **({"stop_reason": stop_reason(delta)} if delta.finish_reason else {}),
                            **({"token_ids": list(delta.token_ids)} if token_ids else {}),
                        })
                    # continuous_usage_stats: every chunk carries the usage so far, as in vLLM's server.
                    running_usage = None
                    if continuous:
                        running_usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                         "total_tokens": prompt_tokens + completion_tokens}
                    if choices:
                        yield chunk(choices, running_usage)
    except APIError as error:
        yield _sse_error(error)
    yield _DONE


async def _completion_streams(request: Request, body: CompletionRequest, request_id: str
                              ) -> tuple[list[EngineStream], list[str | list[int]]]:
    prompts = to_engine.completion_prompts(body.prompt)
    engine_requests = [
        to_engine.completion_request(body, p, f"{request_id}-{i}" if len(prompts) > 1 else request_id)
        for i, p in enumerate(prompts)
    ]
    opened = await asyncio.gather(
        *(_open(request, r, to_engine.COMPLETION_PARAMS) for r in engine_requests), return_exceptions=True
    )
    streams = [s for s in opened if isinstance(s, EngineStream)]
    for s in opened:
        if isinstance(s, BaseException):
            for stream in streams:
                stream.close()
            raise s
    return streams, prompts


async def _echo_texts(request: Request, stream: EngineStream, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    try:
        reply = await stream.client.stub.Detokenize(
            engine_pb2.DetokenizeRequest(model=stream.model, token_ids=prompt),
            metadata=engine_metadata(request),
        )
    except grpc.aio.AioRpcError as error:
        raise from_grpc(error, to_engine.COMPLETION_PARAMS) from None
    return reply.text  # type: ignore[no-any-return]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported", "echo")
    request_id = f"cmpl-{body.request_id or uuid.uuid4().hex}"
    streams, prompts = await _completion_streams(request, body, request_id)
    n = body.n or 1
    model = _response_model(request, body.model, streams[0])
    created = int(time.time())
    text_of = _token_text(request)
    echoes = [""] * len(prompts)
    if body.echo:
        for i, (s, p) in enumerate(zip(streams, prompts, strict=True)):
            echoes[i] = await _echo_texts(request, s, p)
    if body.stream:
        include_usage, _ = _include_usage(body)
        return StreamingResponse(
            _completion_chunks(streams, echoes, request_id, model, created, n, text_of, include_usage,
                               body.logprobs is not None, bool(body.return_token_ids)),
            media_type="text/event-stream",
        )

    async def whole() -> dict[str, Any]:
        results = await asyncio.gather(*(collect(s, n) for s in streams))
        choices: list[dict[str, Any]] = []
        usage: dict[str, Any] | None = None
        for prompt_index, result in enumerate(results):
            usage = add_usage(usage, usage_json(result.usage))
            for c in result.choices:
                text = echoes[prompt_index] + c.text
                choice = _completion_choice(prompt_index * n + c.index, text, c, text_of,
                                            body.logprobs is not None, len(echoes[prompt_index]))
                if body.return_token_ids:
                    choice["token_ids"] = c.token_ids
                    choice["prompt_token_ids"] = result.prompt_token_ids
                if body.prompt_logprobs is not None:
                    # vLLM's server puts a completion's prompt logprobs on each choice.
                    choice["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
                choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage}

    return await _unless_disconnected(request, whole())


def _completion_choice(index: int, text: str, c: ChoiceState, text_of: TokenText, logprobs: bool,
                       offset: int) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(c.logprobs, text_of, offset) if logprobs else None,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


async def _completion_chunks(streams: list[EngineStream], echoes: list[str], request_id: str, model: str,
                             created: int, n: int, text_of: TokenText, include_usage: bool,
                             logprobs: bool, token_ids: bool) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[tuple[int, engine_pb2.GenerateResponse | APIError | None]] = asyncio.Queue()

    async def pump(prompt_index: int, stream: EngineStream) -> None:
        try:
            async for message in stream.messages():
                await queue.put((prompt_index, message))
        except APIError as error:
            await queue.put((prompt_index, error))
        finally:
            await queue.put((prompt_index, None))

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        return _chunk("text_completion", request_id, created, model, choices, include_usage, usage)

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    offsets = {(p, i): len(echoes[p]) for p in range(len(streams)) for i in range(n)}
    usage: dict[str, Any] | None = None
    running = len(streams)
    try:
        for p, echo in enumerate(echoes):
            if echo:
                yield chunk([{"index": p * n + i, "text": echo, "logprobs": None, "finish_reason": None}
                             for i in range(n)])
        while running:
            prompt_index, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, APIError):
                yield _sse_error(item)
                continue
            match item.WhichOneof("phase"):
                case "finished":
                    usage = add_usage(usage, usage_json(item.finished.usage))
                case "delta":
                    choices = []
                    for delta in item.delta.choices:
                        key = (prompt_index, delta.index)
                        state = ChoiceState(delta.index)
                        state.add(delta)
                        choice = _completion_choice(prompt_index * n + delta.index, state.text, state, text_of,
                                                    logprobs, offsets[key])
                        if token_ids:
                            choice["token_ids"] = list(delta.token_ids)
                        choices.append(choice)
                        offsets[key] += len(state.text)
                    if choices:
                        yield chunk(choices)
                case _:
                    pass  # `started`: nothing a completion stream shows (prompt logprobs are refused there)
        if include_usage:
            yield chunk([], usage)
        yield _DONE
    finally:
        for task in pumps:
            task.cancel()
        for stream in streams:
            stream.close()
