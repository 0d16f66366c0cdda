"""The engine's Generate messages to OpenAI response objects, whole or as stream chunks (the stream itself,
with its retries and migrations, is failover.EngineStream)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from taco_llm.protos import engine_pb2

from .errors import APIError

if TYPE_CHECKING:
    from .failover import EngineStream

# JSON has no -inf; vLLM's server clamps to the same value.
_LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return _LOGPROB_FLOOR if math.isnan(value) or value < _LOGPROB_FLOOR else value


# The proto's finish reasons as OpenAI (and vLLM) spell them; UNSPECIFIED (still running) is absent.
FINISH_REASONS: dict[int, str] = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    engine_pb2.FINISH_REASON_ERROR: "error",
    engine_pb2.FINISH_REASON_REPETITION: "repetition",
}


def finish_reason(value: int) -> str | None:
    """None while the choice runs."""
    return FINISH_REASONS.get(value)


def delta_text(delta: engine_pb2.ChoiceDelta) -> str:
    """The model's own text in a delta, whichever output variant carries it."""
    match delta.WhichOneof("output"):
        case "text":
            return delta.text
        case "parsed":
            return delta.parsed.raw_text
        case _:
            return ""


@dataclass
class ChoiceState:
    """What has been generated so far for one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # The worker's whole-text parse, where it parsed tool calls.
    parsed: engine_pb2.ParsedChoice | None = None

    def add(self, delta: engine_pb2.ChoiceDelta) -> None:
        self.text += delta_text(delta)
        if delta.WhichOneof("output") == "parsed" and delta.parsed.HasField("whole"):
            self.parsed = delta.parsed.whole
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason:
            self.finish_reason = finish_reason(delta.finish_reason)
            self.stop_reason = stop_reason(delta)


def stop_reason(delta: engine_pb2.ChoiceDelta) -> str | int | None:
    kind = delta.WhichOneof("stop_reason")
    if kind == "stop_string":
        return delta.stop_string
    if kind == "stop_token_id":
        return delta.stop_token_id
    return None


def usage_json(usage: engine_pb2.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def add_usage(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a or b
    total = {k: a[k] + b[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {
        "cached_tokens": a["prompt_tokens_details"]["cached_tokens"] + b["prompt_tokens_details"]["cached_tokens"]
    }
    return total


@dataclass(frozen=True, kw_only=True)
class TokenText:
    """How a token appears in logprobs: its text, or `token_id:N` with --return-tokens-as-token-ids."""

    as_token_ids: bool = False

    def __call__(self, token_id: int, token: str) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else token


def chat_logprobs(items: list[engine_pb2.TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    def entry(token_id: int, token: str, logprob: float) -> dict[str, Any]:
        shown = text_of(token_id, token)
        return {"token": shown, "logprob": _logprob(logprob), "bytes": list(shown.encode("utf-8"))}

    content = []
    for item in items:
        top = [entry(t.token_id, t.token, t.logprob) for t in item.top]
        content.append({**entry(item.token_id, item.token, item.logprob), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(items: list[engine_pb2.TokenLogprob], text_of: TokenText,
                        start_offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = start_offset
    for item in items:
        shown = text_of(item.token_id, item.token)
        tokens.append(shown)
        token_logprobs.append(_logprob(item.logprob))
        top_logprobs.append({text_of(t.token_id, t.token): _logprob(t.logprob) for t in item.top} or None)
        offsets.append(offset)
        offset += len(item.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprobs_json(entries: Iterable[engine_pb2.PromptTokenLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first, which has no context) or
    {token_id: {"logprob", "rank", "decoded_token"}}, -inf clamped as vLLM's server does."""
    return [
        {str(c.token_id): {"logprob": _logprob(c.logprob), "rank": c.rank, "decoded_token": c.token}
         for c in entry.candidates} or None
        for entry in entries
    ]


@dataclass
class Collected:
    choices: list[ChoiceState]
    usage: engine_pb2.Usage | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[engine_pb2.PromptTokenLogprobs] = field(default_factory=list)


async def collect(stream: EngineStream, n: int) -> Collected:
    """Reads a whole stream into its choices, usage, prompt tokens and prompt logprobs."""
    result = Collected([ChoiceState(i) for i in range(n)], None, [])
    async for message in stream.messages():
        match message.WhichOneof("phase"):
            case "started":
                result.prompt_token_ids = list(message.started.prompt_token_ids)
                result.prompt_logprobs = list(message.started.prompt_logprobs)
            case "delta":
                for delta in message.delta.choices:
                    if delta.index >= n:
                        raise APIError(500, f"the engine sent choice {delta.index} of {n}")
                    result.choices[delta.index].add(delta)
            case "finished":
                result.usage = message.finished.usage
            case _:
                # A phase this gateway does not know: a newer worker; failing loudly beats a wrong answer.
                raise APIError(500, "the engine sent a message of no phase this gateway knows")
    return result
