"""/v1/completions: one prompt or a batch, each its own engine stream, merged into one response."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
    add_usage,
    coalesced,
    collect,
    completion_logprobs,
    delta_text,
    finish_reason,
    prompt_logprobs_json,
    stop_reason,
    usage_json,
)
from .protocol import CompletionRequest
from .request_context import OutputOptions, RequestContext
from .routing import RouteKey
from .serving import EngineCalls, unless_disconnected, usage_options


@dataclass(frozen=True)
class OpenPrompt:
    """One prompt of the batch: its running engine stream, and the text echoed before its choices."""

    stream: EngineStream
    echo: str


class ServingCompletion:
    """Made once per app, with the workers and the server's output options (from flags)."""

    def __init__(self, engines: EngineCalls, *, token_text: TokenText, stream_interval: int = 1,
                 max_prompts_per_batch: int | None = None) -> None:
        self.engines = engines
        # --max-prompts-per-batch: each prompt of a batch is an engine request of its own.
        self.max_prompts_per_batch = max_prompts_per_batch
        self.token_text = token_text
        # vLLM's --stream-interval: at most one chunk per this many tokens (see from_engine.coalesced).
        self.stream_interval = stream_interval

    async def create(self, body: CompletionRequest,
                     request: Request) -> StreamingResponse | JSONResponse | dict[str, Any]:
        arrival = time.perf_counter()
        if body.echo and body.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        request_id = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        # Each prompt's first message comes after its prefill (see ServingChat.create): a client that leaves
        # before then cancels them in the engine's queue.
        batch = await unless_disconnected(request, self._open(body, request_id, arrival))
        if isinstance(batch, JSONResponse):
            return batch
        include_usage, _ = usage_options(body.stream_options)
        context = RequestContext(
            request_id=request_id, model=batch[0].stream.model_name, created=int(time.time()),
            n=body.n or 1,
            options=OutputOptions(include_usage=include_usage, logprobs=body.logprobs is not None,
                                  return_token_ids=bool(body.return_token_ids),
                                  prompt_logprobs=body.prompt_logprobs is not None),
        )
        if body.stream:
            return StreamingResponse(self._chunks(context, batch), media_type="text/event-stream")
        return await unless_disconnected(request, self._whole(context, batch))

    async def _open(self, body: CompletionRequest, request_id: str, arrival: float) -> list[OpenPrompt]:
        """Opens every prompt's stream at once, with its echo. If a stream or an echo is refused (an
        out-of-vocabulary token id, say), every stream opened is closed: their engine requests would
        run on, and the worker would look busier than it is."""
        prompts = to_engine.completion_prompts(body.prompt, max_prompts=self.max_prompts_per_batch)
        param_names = to_engine.request_params(to_engine.COMPLETION_PARAMS, body)
        engine_requests = [
            to_engine.completion_request(body, p, f"{request_id}-{i}" if len(prompts) > 1 else request_id)
            for i, p in enumerate(prompts)
        ]
        opening = [asyncio.ensure_future(self.engines.generate(r, param_names, _route_key(body, p), arrival=arrival))
                   for r, p in zip(engine_requests, prompts, strict=True)]
        try:
            opened = await asyncio.gather(*opening, return_exceptions=True)
        except BaseException:
            # Cancelled (the client left while they waited in the engine's queue): the streams that had
            # opened are closed too, and those still opening cancelled.
            for task in opening:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().close()
                else:
                    task.cancel()
            raise
        streams = [s for s in opened if isinstance(s, EngineStream)]
        try:
            for s in opened:
                if isinstance(s, BaseException):
                    raise s
            return [OpenPrompt(s, await self._echo(s, p) if body.echo else "")
                    for s, p in zip(streams, prompts, strict=True)]
        except BaseException:
            for stream in streams:
                stream.close()
            raise

    async def _echo(self, stream: EngineStream, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return await self.engines.detokenize(engine_pb2.DetokenizeRequest(model=stream.model, token_ids=prompt),
                                             to_engine.COMPLETION_PARAMS, client=stream.client)

    async def _whole(self, context: RequestContext, batch: list[OpenPrompt]) -> dict[str, Any]:
        options = context.options
        try:
            results = await asyncio.gather(*(collect(p.stream, context.n) for p in batch))
        except BaseException:
            # One prompt failed: the others' engine requests would run on for an answer nobody gets.
            for prompt in batch:
                prompt.stream.close()
            raise
        choices: list[dict[str, Any]] = []
        usage: dict[str, Any] | None = None
        for prompt_index, (prompt, result) in enumerate(zip(batch, results, strict=True)):
            usage = add_usage(usage, usage_json(result.usage))
            # vLLM's server puts a completion's prompt logprobs on each choice: built once per prompt.
            prompt_logprobs = prompt_logprobs_json(result.prompt_logprobs) if options.prompt_logprobs else None
            for c in result.choices:
                choice = self._choice(context, c, index=prompt_index * context.n + c.index,
                                      text=prompt.echo + c.text, offset=len(prompt.echo))
                if options.return_token_ids:
                    choice["token_ids"] = c.token_ids
                    choice["prompt_token_ids"] = result.prompt_token_ids
                if options.prompt_logprobs:
                    choice["prompt_logprobs"] = prompt_logprobs
                choices.append(choice)
        return {**context.head("text_completion"), "choices": choices, "usage": usage}

    def _choice(self, context: RequestContext, state: ChoiceState, *, index: int, text: str,
                offset: int) -> dict[str, Any]:
        """`offset`: where the choice's new text starts in its whole text (after the echo and the text
        streamed before it), for the logprobs' text_offset."""
        logprobs = completion_logprobs(state.logprobs, self.token_text, offset) if context.options.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": state.finish_reason,
                "stop_reason": state.stop_reason}

    async def _chunks(self, context: RequestContext, batch: list[OpenPrompt]) -> AsyncIterator[bytes]:
        n = context.n
        form = sse.ChunkFormat(context, "text_completion")
        # Where each choice's next text starts in its whole text, for the logprobs' text_offset.
        offsets = {(p, i): len(prompt.echo) for p, prompt in enumerate(batch) for i in range(n)}
        usage: dict[str, Any] | None = None
        try:
            for p, prompt in enumerate(batch):
                if prompt.echo:
                    yield sse.chunk(context, "text_completion",
                                    [{"index": p * n + i, "text": prompt.echo, "logprobs": None,
                                      "finish_reason": None} for i in range(n)])
            # The prompts' streams run side by side; their messages come in the order they arrive.
            sources = coalesced([p.stream.messages() for p in batch], stream_interval=self.stream_interval)
            async with contextlib.aclosing(sources):
                async for messages in sources:
                    # (prompt, choice) -> the deltas merged into the chunk being built
                    runs: dict[tuple[int, int], list[engine_pb2.ChoiceDelta]] = {}
                    out: list[str] = []
                    for prompt_index, message in messages:
                        phase = message.WhichOneof("phase")
                        if phase == "delta":
                            for delta in message.delta.choices:
                                key = (prompt_index, delta.index)
                                run = runs.get(key)
                                if run is None:
                                    runs[key] = [delta]
                                elif run[-1].finish_reason:
                                    out.append(form.text(self._choices_json(context, runs, offsets)))
                                    runs = {key: [delta]}
                                else:
                                    run.append(delta)
                        elif phase == "finished":
                            usage = add_usage(usage, usage_json(message.finished.usage))
                        # `started`: nothing a completion stream shows (prompt logprobs are refused there)
                    if runs:
                        out.append(form.text(self._choices_json(context, runs, offsets)))
                    if out:
                        yield "".join(out).encode()
        except APIError as error:
            # As vLLM's server ends a stream that failed midway; leaving `coalesced` stops the other prompts.
            yield sse.error_event(error)
            yield sse.DONE
            return
        finally:
            for prompt in batch:
                prompt.stream.close()
        if context.options.include_usage:
            yield form.usage_chunk(usage)
        yield sse.DONE

    def _choices_json(self, context: RequestContext, runs: dict[tuple[int, int], list[engine_pb2.ChoiceDelta]],
                      offsets: dict[tuple[int, int], int]) -> list[str]:
        """The choices of one chunk, each of one delta or of several of its choice's merged; advances
        `offsets` past their text."""
        options = context.options
        choices = []
        for key, run in runs.items():
            index = key[0] * context.n + key[1]
            last = run[-1]
            text = delta_text(last) if len(run) == 1 else "".join(delta_text(d) for d in run)
            if not last.finish_reason and not options.logprobs and not options.return_token_ids:
                choices.append(f'{{"index":{index},"text":{sse.string(text)},"logprobs":null,'
                               f'"finish_reason":null,"stop_reason":null}}')
                offsets[key] += len(text)
                continue
            logprobs = None
            if options.logprobs:
                parts = []
                for delta in run:
                    parts.append(completion_logprobs(list(delta.logprobs), self.token_text, offsets[key]))
                    offsets[key] += len(delta_text(delta))
                logprobs = {field: [v for part in parts for v in part[field]] for field in parts[0]}
            else:
                offsets[key] += len(text)
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish_reason(last.finish_reason),
                                      "stop_reason": stop_reason(last) if last.finish_reason else None}
            if options.return_token_ids:
                choice["token_ids"] = [t for d in run for t in d.token_ids]
            choices.append(sse.dumps(choice))
        return choices


def _route_key(body: CompletionRequest, prompt: str | list[int]) -> RouteKey:
    # Token ids as text: prompts that share leading ids share a leading string, which is all routing needs.
    text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return RouteKey(model=body.model, prefix_text=text, cache_salt=body.cache_salt or "")
