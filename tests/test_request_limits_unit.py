"""The gateway's request limits (gateway/request_limits.py) and its conversion of client values into the
worker's proto, without an engine: every hostile body is a 4xx with OpenAI error JSON naming the field,
and no error shows an internal address or a library message."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import grpc
import httpx
import pytest
from pydantic import ValidationError

from taco_llm.gateway import to_engine
from taco_llm.gateway.__main__ import parse
from taco_llm.gateway.app import GatewaySettings, create_app
from taco_llm.gateway.errors import APIError, client_param, from_grpc
from taco_llm.gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from taco_llm.gateway.request_limits import RequestLimits, RequestLimitsMiddleware, check_body
from taco_llm.protos import rich_status

from .support import free_port

LIMITS = RequestLimits(max_request_body_bytes=1000, max_header_bytes=2000, max_json_depth=8,
                       max_prompts_per_batch=4)


class EchoApp:
    """Answers 200 with the body it read: what the middleware let through, as the app would see it."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"".join(chunks)})


async def _call(body_chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None,
                method: str = "POST") -> tuple[int, bytes, int, EchoApp]:
    """Runs the middleware on one request; (status, response body, messages received, the app)."""
    app = EchoApp()
    middleware = RequestLimitsMiddleware(app, LIMITS)
    received = 0
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received > len(body_chunks):
            await asyncio.sleep(3600)  # a client that sends nothing more
        return {"type": "http.request", "body": body_chunks[received - 1],
                "more_body": received < len(body_chunks)}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": "/v1/completions",
             "headers": headers if headers is not None else [(b"content-type", b"application/json")]}
    await middleware(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, received, app


def _error(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


async def test_a_body_within_the_limits_reaches_the_app_unchanged() -> None:
    body = json.dumps({"prompt": "hi \U0001F600 \ud83d\ude00", "x": [[1, [2]]]}).encode()
    status, echoed, _, app = await _call([body[:10], body[10:]])
    assert status == 200 and echoed == body and app.calls == 1


async def test_headers_over_the_limit_are_a_431() -> None:
    status, body, received, app = await _call([b"{}"], headers=[(b"x-big", b"a" * 3000)])
    assert status == 431 and received == 0 and app.calls == 0
    assert "--max-header-bytes" in _error(body)["message"]


async def test_a_content_length_over_the_limit_is_refused_before_reading() -> None:
    status, body, received, app = await _call([b"x" * 10], headers=[(b"content-length", b"10000000000")])
    assert status == 413 and received == 0 and app.calls == 0
    assert _error(body)["code"] == "request_too_large"


async def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives() -> None:
    # 100 chunks of 300 bytes: refused at the 4th, never reading the rest.
    status, body, received, app = await _call([b"x" * 300] * 100, headers=[])
    assert status == 413 and received == 4 and app.calls == 0
    assert "--max-request-body-bytes" in _error(body)["message"]


@pytest.mark.parametrize(("body", "code", "param"), [
    (b'{"prompt": "\xff\xfe"}', "invalid_utf8", None),
    (b'{"prompt": ', "invalid_json", None),
    (b"[" * 9 + b"]" * 9, "json_too_deep", None),
    (b'{"messages": ' + b"[" * 9 + b"]" * 9 + b"}", "json_too_deep", "messages"),
])
async def test_bodies_that_are_not_text_or_json_or_too_deep_are_400s(body: bytes, code: str,
                                                                      param: str | None) -> None:
    status, reply, _, app = await _call([body])
    error = _error(reply)
    assert status == 400 and app.calls == 0 and error["code"] == code and error["param"] == param, error


def test_nesting_far_past_the_parser_s_own_limit_is_a_clean_400() -> None:
    with pytest.raises(APIError) as excinfo:
        check_body(b"[" * 200_000 + b"]" * 200_000, max_depth=64)
    assert excinfo.value.status == 400 and excinfo.value.code == "json_too_deep"


@pytest.mark.parametrize(("body", "param"), [
    ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ('{"stop": ["ok", "\\udfff"]}', "stop[1]"),
    ('{"tools": [{"\\ud800": 1}]}', "tools[0]"),
])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(body: str, param: str) -> None:
    with pytest.raises(APIError) as excinfo:
        check_body(body.encode(), max_depth=64)
    assert excinfo.value.status == 400 and excinfo.value.param == param
    check_body(b'{"content": "\\ud83d\\ude00"}', max_depth=64)  # a pair is a character


async def test_non_json_bodies_and_gets_are_left_to_the_app() -> None:
    status, echoed, _, _ = await _call([b"\xff"], headers=[(b"content-type", b"text/plain")])
    assert status == 200 and echoed == b"\xff"
    status, _, _, _ = await _call([b""], method="GET")
    assert status == 200


def test_limits_are_flags_with_their_defaults() -> None:
    settings = parse(["--engine", "a:1"])
    assert settings.request_limits == RequestLimits()
    assert settings.request_limits.max_request_body_bytes == 32 * 1024 * 1024
    assert settings.request_limits.max_header_bytes == 64 * 1024
    assert settings.request_limits.max_json_depth == 64
    assert settings.request_limits.max_prompts_per_batch == 128
    settings = parse(["--engine", "a:1", "--max-json-depth", "5", "--max-prompts-per-batch", "2"])
    assert settings.request_limits.max_json_depth == 5 and settings.request_limits.max_prompts_per_batch == 2
    with pytest.raises(SystemExit):
        parse(["--engine", "a:1", "--max-request-body-bytes", "0"])


def test_serve_hands_the_limits_to_the_gateway() -> None:
    from taco_llm.serve_args import parse as parse_serve

    args = parse_serve(["some/model", "--max-header-bytes", "1234", "--max-prompts-per-batch", "3"])
    assert args.gateway_argv[-4:] == ["--max-header-bytes", "1234", "--max-prompts-per-batch", "3"]
    assert "--max-header-bytes" not in args.worker_argv


# --- client values the proto cannot carry -----------------------------------------------------------

def _chat(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})


@pytest.mark.parametrize(("extra", "param"), [
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"n": 2**32}, "n"),
    ({"top_k": 2**31}, "top_k"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_completion_tokens": 10**40}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
    ({"prompt_logprobs": -(2**40)}, "prompt_logprobs"),
    ({"min_tokens": 2**31}, "min_tokens"),
    ({"priority": 2**31}, "priority"),
    ({"temperature": 1e39}, "temperature"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"logit_bias": {str(2**32): 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1e39}}, "logit_bias"),
    ({"chat_template_kwargs": {"a": 10**400}}, "chat_template_kwargs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 10**400}}}]}, "tools"),
])
def test_chat_values_the_proto_cannot_carry_are_400s_naming_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as excinfo:
        to_engine.chat_request(_chat(**extra), "id")
    assert excinfo.value.status == 400 and excinfo.value.param == param, excinfo.value.message


@pytest.mark.parametrize("prompt", [[1, -1], [[5], [2**32]]])
def test_token_ids_outside_uint32_are_400s_naming_prompt(prompt: list[Any]) -> None:
    body = CompletionRequest.model_validate({"prompt": prompt})
    with pytest.raises(APIError) as excinfo:
        for one in to_engine.completion_prompts(body.prompt):
            to_engine.completion_request(body, one, "id")
    assert excinfo.value.status == 400 and excinfo.value.param == "prompt"


def test_detokenize_ids_outside_uint32_are_400s_naming_tokens() -> None:
    with pytest.raises(APIError) as excinfo:
        to_engine.detokenize_request(DetokenizeRequest(tokens=[3, -5]))
    assert excinfo.value.param == "tokens" and "-5" in excinfo.value.message
    assert list(to_engine.detokenize_request(DetokenizeRequest(tokens=[3, 5])).token_ids) == [3, 5]


def test_prompts_per_batch_are_limited() -> None:
    assert len(to_engine.completion_prompts(["a"] * 4, max_prompts=4)) == 4
    assert to_engine.completion_prompts(list(range(1000)), max_prompts=4) == [list(range(1000))], \
        "one prompt of token ids is not a batch"
    for batch in (["a"] * 5, [[1]] * 5):
        with pytest.raises(APIError) as excinfo:
            to_engine.completion_prompts(batch, max_prompts=4)  # type: ignore[arg-type]
        assert excinfo.value.param == "prompt" and "--max-prompts-per-batch" in excinfo.value.message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_are_no_value_of_a_float_field(value: float) -> None:
    with pytest.raises(ValidationError):
        _chat(temperature=value)
    with pytest.raises(ValidationError):
        _chat(logit_bias={"5": value})


# --- errors in the client's terms -------------------------------------------------------------------

def _rpc_error(code: grpc.StatusCode, details: str, field: str | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if field is not None:
        rich = rich_status.status(code, details, rich_status.Reason.FIELD_INVALID, field)
        trailing = grpc.aio.Metadata(*rich.trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


LIBRARY_MESSAGE = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.1.2.3:50051: "
                   "Failed to connect to remote host: Connection refused")


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNKNOWN, 500),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 408), (grpc.StatusCode.DATA_LOSS, 500),
])
def test_server_side_grpc_errors_show_no_address_nor_library_message(code: grpc.StatusCode, status: int) -> None:
    error = from_grpc(_rpc_error(code, LIBRARY_MESSAGE))
    assert error.status == status
    for leak in ("10.1.2.3", "50051", "Connection refused", "ipv4", "failed to connect"):
        assert leak not in error.message
    assert error.message


def test_grpcs_own_size_refusal_is_not_shown_but_a_workers_is() -> None:
    own = from_grpc(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger than max (9 vs. 4)"))
    assert own.status == 400 and "larger than max" not in own.message
    worker = from_grpc(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "the prompt is 5000 tokens", "prompt"))
    assert worker.message == "the prompt is 5000 tokens" and worker.param == "prompt"


def test_a_workers_refusal_is_shown_with_the_clients_field_name() -> None:
    error = from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "messages[1].role 'robot' is not a role",
                                 "chat.messages[1].role"), to_engine.CHAT_PARAMS)
    assert error.status == 400 and error.param == "messages[1].role"
    assert error.message == "messages[1].role 'robot' is not a role"
    assert client_param("chat.messages[0].content_parts[2].type", to_engine.CHAT_PARAMS) == \
        "messages[0].content[2].type"
    assert client_param("logprobs", to_engine.CHAT_PARAMS) == "top_logprobs"
    assert client_param("seed", to_engine.CHAT_PARAMS) == "seed"


@pytest.fixture
async def gateway_without_workers() -> AsyncIterator[httpx.AsyncClient]:
    """The real app, limits and all, whose only worker address answers nothing."""
    address = f"127.0.0.1:{free_port()}"
    app = create_app(GatewaySettings(engines=[address], health_interval=0.05, request_limits=LIMITS))
    async with app.router.lifespan_context(app):
        await asyncio.sleep(0.3)  # a few failed health checks
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=10) as client:
            client.headers["x-worker-address"] = address
            yield client


async def test_no_worker_is_a_503_in_the_clients_terms(gateway_without_workers: httpx.AsyncClient) -> None:
    client = gateway_without_workers
    address = client.headers["x-worker-address"]
    reply = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 503 and reply.headers["retry-after"]
    message = reply.json()["error"]["message"]
    assert address not in message and address.rpartition(":")[2] not in message
    assert "UNAVAILABLE" not in message and "connect" not in message.lower()
    assert "worker 1 of 1: not ready" in message and "retry later" in message


@pytest.mark.parametrize(("content", "status", "param"), [
    (b'{"messages": "\xff"}', 400, None),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages[0].content"),
    (b"[" * 20 + b"]" * 20, 400, None),
    (b'{"prompt": "' + b"x" * 2000 + b'"}', 413, None),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": "x", "seed": 99999999999999999999999}', 400, "seed"),
    (b'{"prompt": ["a", "b", "c", "d", "e"]}', 400, "prompt"),
])
async def test_the_app_refuses_hostile_bodies_before_any_worker(gateway_without_workers: httpx.AsyncClient,
                                                                 content: bytes, status: int,
                                                                 param: str | None) -> None:
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    reply = await gateway_without_workers.post(path, content=content, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    assert _error(reply.content)["param"] == param


async def test_huge_headers_through_the_app_are_a_431(gateway_without_workers: httpx.AsyncClient) -> None:
    reply = await gateway_without_workers.get("/v1/models", headers={"x-big": "a" * 5000})
    assert reply.status_code == 431 and _error(reply.content)["code"] == "headers_too_large"
