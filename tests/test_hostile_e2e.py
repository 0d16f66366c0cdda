"""A hostile HTTP client against `taco_llm serve` on the default model: each bad request is a 4xx with
OpenAI error JSON naming the field (or 413/431 for sizes), never a 5xx nor a traceback; and an innocent
greedy stream, running through the whole hostile suite, gives exactly the text it gives alone."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152
MiB = 1024 * 1024
BYSTANDER_PROMPT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a short story about a lighthouse keeper."}]
# The bystander's length is sized from the suite's measured duration and the measured decode rate, so that it
# outlasts the suite on any machine: fixed lengths (48, then 384 tokens) each once ended first on CI's machine.
BYSTANDER_MARGIN = 3
BYSTANDER_MIN_TOKENS = 128
# 2048 (the stack's --max-model-len) less the prompt and a margin for the chat template.
BYSTANDER_MAX_TOKENS = 1900
PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _forty_megabytes() -> Iterator[bytes]:
    """A 40 MB JSON body sent in chunks, without a Content-Length."""
    yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
    for _ in range(40):
        yield b"x" * MiB
    yield b'"}'


def _broken_pattern_tool() -> dict[str, Any]:
    # strict: vLLM's hermes parser holds a non-strict tool's arguments to any JSON, so only a strict tool's
    # schema is ever compiled (and could fail in the engine); a non-strict one's pattern never reaches it.
    return {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "([a-z"}}, "required": ["code"]}}}


@dataclass(frozen=True)
class Hostile:
    """One hostile request and the refusal it must get."""

    name: str
    path: str
    status: int
    # The `param` the error must name; None where the whole body is at fault.
    param: str | None
    body: Callable[[], bytes | Iterator[bytes]]
    headers: dict[str, str] = field(default_factory=dict)
    # Where the param may carry a position or sub-field after it (a tool's schema: `tools[0]...`).
    param_prefix: bool = False

    def send(self, http: httpx.Client) -> httpx.Response:
        return http.post(self.path, content=self.body(),
                         headers={"content-type": "application/json", **self.headers})


CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


def _response(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}


CASES = [
    Hostile("absurd_n", CHAT, 400, "n", lambda: _json(_chat(n=100_000))),
    Hostile("n_beyond_uint32", CHAT, 400, "n", lambda: _json(_chat(n=2**40))),
    Hostile("max_tokens_past_context", COMPLETIONS, 400, "max_tokens", lambda: _json(_completion(max_tokens=10**6))),
    Hostile("max_tokens_beyond_int32", COMPLETIONS, 400, "max_tokens", lambda: _json(_completion(max_tokens=2**40))),
    Hostile("huge_prompt_logprobs", COMPLETIONS, 400, "prompt_logprobs",
            lambda: _json(_completion(prompt_logprobs=100_000))),
    Hostile("stop_strings_100000", CHAT, 400, "stop", lambda: _json(_chat(stop=[f"s{i}" for i in range(100_000)]))),
    Hostile("image_content_part", CHAT, 400, "messages[0].content[0].type", lambda: _json(_chat(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]},
    ]))),
    Hostile("unknown_role", CHAT, 400, "messages[1].role", lambda: _json(_chat(messages=[
        {"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]))),
    Hostile("negative_token_id", COMPLETIONS, 400, "prompt", lambda: _json(_completion(prompt=[1, 2, -5]))),
    Hostile("token_id_past_vocabulary", COMPLETIONS, 400, "prompt",
            lambda: _json(_completion(prompt=[1, VOCAB_SIZE + 10]))),
    Hostile("stop_token_id_past_vocabulary", COMPLETIONS, 400, "stop_token_ids",
            lambda: _json(_completion(stop_token_ids=[VOCAB_SIZE + 10]))),
    Hostile("seed_out_of_range", CHAT, 400, "seed", lambda: _json(_chat(seed=2**64))),
    Hostile("nan_temperature", CHAT, 400, "temperature",
            lambda: _json(_chat()).replace(b'"max_tokens"', b'"temperature": NaN, "max_tokens"')),
    Hostile("infinite_top_p", COMPLETIONS, 400, "top_p",
            lambda: _json(_completion()).replace(b'"max_tokens"', b'"top_p": Infinity, "max_tokens"')),
    Hostile("top_logprobs_past_vocabulary", CHAT, 400, "top_logprobs",
            lambda: _json(_chat(logprobs=True, top_logprobs=VOCAB_SIZE + 1))),
    Hostile("logit_bias_out_of_vocabulary", CHAT, 400, "logit_bias",
            lambda: _json(_chat(logit_bias={str(VOCAB_SIZE + 7): 5.0}))),
    Hostile("logit_bias_negative_key", CHAT, 400, "logit_bias", lambda: _json(_chat(logit_bias={"-3": 5.0}))),
    Hostile("invalid_regex", CHAT, 400, "structured_outputs.regex",
            lambda: _json(_chat(structured_outputs={"regex": "(unclosed[a-"}))),
    Hostile("json_schema_malformed_pattern", CHAT, 400, "response_format", lambda: _json(_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "([a-z"}}}}}))),
    # This stack has no --tool-call-parser, so a forced tool call is refused by `tool_choice` before its
    # schema is compiled; test_tool_schema_with_a_malformed_pattern_is_refused_by_name has the parser.
    Hostile("tool_schema_malformed_pattern", CHAT, 400, "tool_choice",
            lambda: _json(_chat(tools=[_broken_pattern_tool()], tool_choice="required"))),
    Hostile("empty_prompt", COMPLETIONS, 400, "prompt", lambda: _json(_completion(prompt=""))),
    Hostile("empty_prompt_list", COMPLETIONS, 400, "prompt", lambda: _json(_completion(prompt=[]))),
    Hostile("prompts_per_batch", COMPLETIONS, 400, "prompt", lambda: _json(_completion(prompt=["hi"] * 129))),
    Hostile("lone_surrogate", CHAT, 400, "messages[0].content",
            lambda: b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    Hostile("invalid_utf8", CHAT, 400, None,
            lambda: b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xc3\x28"}]}'),
    Hostile("deep_nesting", CHAT, 400, None, lambda: b"[" * 100_000 + b"]" * 100_000),
    Hostile("deep_nesting_in_a_field", CHAT, 400, "tools",
            lambda: _json(_chat()).replace(b'"max_tokens"', b'"tools": ' + b"[" * 70 + b"]" * 70 + b', "max_tokens"')),
    Hostile("responses_max_output_tokens_past_context", RESPONSES, 400, "max_output_tokens",
            lambda: _json(_response(max_output_tokens=10**6))),
    Hostile("responses_unknown_item", RESPONSES, 400, "input[1].type",
            lambda: _json(_response(input=[{"role": "user", "content": "hi"}, {"type": "computer_call"}]))),
    Hostile("responses_hosted_tool", RESPONSES, 400, "tools[0].type",
            lambda: _json(_response(tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]))),
    Hostile("responses_lone_surrogate", RESPONSES, 400, "input",
            lambda: b'{"model": "' + MODEL.encode() + b'", "input": "a\\ud800b", "max_output_tokens": 4}'),
    Hostile("responses_deep_nesting_in_input", RESPONSES, 400, "input",
            lambda: _json(_response()).replace(b'"input": "hi"', b'"input": ' + b"[" * 70 + b"]" * 70)),
    Hostile("huge_headers", CHAT, 431, None, lambda: _json(_chat()), headers={"x-filler": "a" * (128 * 1024)}),
    Hostile("body_40_mb", COMPLETIONS, 413, None, lambda: b'{"prompt": "' + b"x" * (40 * MiB) + b'"}'),
    Hostile("body_40_mb_chunked", COMPLETIONS, 413, None, _forty_megabytes),
]


def check_refusal(case: Hostile, reply: httpx.Response) -> None:
    assert reply.status_code == case.status, f"{case.name}: {reply.status_code} {reply.text[:500]}"
    assert "Traceback" not in reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["type"] == "invalid_request_error", error
    if case.param_prefix:
        assert str(error["param"]).startswith(str(case.param)), f"{case.name}: {error}"
    else:
        assert error["param"] == case.param, f"{case.name}: {error}"


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request_is_refused_by_name(http: httpx.Client, case: Hostile) -> None:
    check_refusal(case, case.send(http))


def test_detokenize_with_a_negative_token_is_refused_by_name(http: httpx.Client) -> None:
    reply = http.post("/detokenize", json={"model": MODEL, "tokens": [1, -1]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens", reply.text


def test_tool_schema_with_a_malformed_pattern_is_refused_by_name(frontend_client: openai.OpenAI) -> None:
    """The stack with a tool-call parser: a forced call compiles the tool's schema at admission."""
    for tool_choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            frontend_client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "look up abc"}], max_tokens=8,
                tools=[_broken_pattern_tool()], tool_choice=tool_choice)  # type: ignore[call-overload]
        body = caught.value.body
        assert isinstance(body, dict) and str(body["param"]).startswith("tools"), body


class Bystander(threading.Thread):
    """A greedy chat stream through the openai SDK, read as it comes."""

    def __init__(self, client: openai.OpenAI, max_tokens: int):
        super().__init__(daemon=True)
        self.client = client
        self.max_tokens = max_tokens
        self.chunks: list[str] = []
        self.first_chunk = threading.Event()
        self.finished_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=MODEL, messages=BYSTANDER_PROMPT, temperature=0, max_tokens=self.max_tokens, stream=True,
                extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.chunks.append(chunk.choices[0].delta.content)
                    self.first_chunk.set()
        except BaseException as error:  # reported by the test
            self.error = error
        finally:
            self.finished_at = time.monotonic()
            self.first_chunk.set()


def _refusal_failure(http: httpx.Client, case: Hostile) -> str:
    try:
        check_refusal(case, case.send(http))
    except AssertionError as error:
        return str(error)
    return ""


def _run_suite(http: httpx.Client) -> list[str]:
    # Four at a time, as a client with a small pool would send them.
    with ThreadPoolExecutor(max_workers=4) as pool:
        return [failure for failure in pool.map(_refusal_failure, [http] * len(CASES), CASES) if failure]


def _alone(client: openai.OpenAI, max_tokens: int) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=BYSTANDER_PROMPT, temperature=0,
                                           max_tokens=max_tokens, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == max_tokens
    return reply.choices[0].message.content or ""


def _bystander_tokens(client: openai.OpenAI, suite_seconds: float) -> int:
    """Enough tokens to outlast the suite BYSTANDER_MARGIN times over at this machine's unloaded decode rate
    (the suite's load only slows the stream further)."""
    probe_tokens = 64
    started = time.monotonic()
    _alone(client, probe_tokens)
    tokens_per_second = probe_tokens / (time.monotonic() - started)
    wanted = int(BYSTANDER_MARGIN * suite_seconds * tokens_per_second)
    return max(BYSTANDER_MIN_TOKENS, min(BYSTANDER_MAX_TOKENS, wanted))


def test_an_innocent_stream_survives_the_hostile_suite(client: openai.OpenAI, http: httpx.Client) -> None:
    started = time.monotonic()
    failures = _run_suite(http)
    assert not failures, failures
    max_tokens = _bystander_tokens(client, time.monotonic() - started)
    expected = _alone(client, max_tokens)

    bystander = Bystander(client, max_tokens)
    bystander.start()
    assert bystander.first_chunk.wait(60) and bystander.error is None
    # The whole suite lands while the stream is generating, on the same worker.
    failures = _run_suite(http)
    last_answered = time.monotonic()
    bystander.join(600)
    assert bystander.error is None, bystander.error
    assert bystander.finished_at is not None and bystander.finished_at > last_answered, \
        f"the {max_tokens}-token stream ended before the hostile suite did: it did not run through it"
    assert not failures, failures
    # The same text as alone; and the server still serves normally after the suite.
    assert "".join(bystander.chunks) == expected
    assert _alone(client, 8)
