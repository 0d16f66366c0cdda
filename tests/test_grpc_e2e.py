"""A gRPC client on the stubs from protos/, calling the engine worker directly."""

from __future__ import annotations

import itertools
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from taco_llm.protos import engine_pb2, engine_pb2_grpc, rich_status

from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"


def _chat(text: str, **sampling: object) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        model=MODEL,
        chat=engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content=text)]),
        sampling=engine_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def _status(call: object) -> tuple[grpc.StatusCode, str, rich_status.ErrorDetails]:
    with pytest.raises(grpc.RpcError) as excinfo:
        list(call)  # type: ignore[call-overload]
    error = excinfo.value
    return error.code(), error.details(), rich_status.details_of(error)


def _choices(messages: list[engine_pb2.GenerateResponse]) -> list[engine_pb2.ChoiceDelta]:
    return [d for m in messages if m.WhichOneof("phase") == "delta" for d in m.delta.choices]


def _wait_load(engine: engine_pb2_grpc.EngineStub, running: int, streams: int,
               timeout: float = 20.0) -> engine_pb2.Load:
    """Polls GetLoad until it shows `running` requests in the scheduler and `streams` open Generate calls.
    The scheduler's counts are the ones of its latest step, so a request can show a step late."""
    deadline = time.monotonic() + timeout
    while True:
        load = engine.GetLoad(engine_pb2.GetLoadRequest())
        if (load.num_running_requests == running and load.num_waiting_requests == 0
                and load.num_active_streams == streams) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def _wait_idle(engine: engine_pb2_grpc.EngineStub) -> engine_pb2.Load:
    return _wait_load(engine, running=0, streams=0)


def test_generate_streams_tokens(engine: engine_pb2_grpc.EngineStub) -> None:
    messages = list(engine.Generate(_chat("What is the capital of France?", temperature=0, max_tokens=20)))
    assert len(messages) > 2 + 2, "one message per engine step, not one at the end"
    phases = [m.WhichOneof("phase") for m in messages]
    assert phases[0] == "started" and phases[-1] == "finished" and set(phases[1:-1]) == {"delta"}, phases
    text = "".join(d.text for d in _choices(messages))
    tokens = [t for d in _choices(messages) for t in d.token_ids]
    assert "Paris" in text
    assert messages[0].started.prompt_token_ids, "the first message carries the prompt's token ids"
    assert not messages[0].started.prompt_logprobs, "prompt logprobs only when asked for"
    last = messages[-1]
    assert last.finished.usage.completion_tokens == len(tokens)
    assert _choices(messages)[-1].finish_reason == engine_pb2.FINISH_REASON_STOP
    assert last.finished.usage.prompt_tokens == len(messages[0].started.prompt_token_ids)


def test_token_ids_input_matches_text_input(engine: engine_pb2_grpc.EngineStub) -> None:
    ids = list(engine.Tokenize(engine_pb2.TokenizeRequest(model=MODEL, text="The capital of France is")).token_ids)
    sampling = engine_pb2.SamplingParams(temperature=0, max_tokens=8)
    by_text = list(engine.Generate(engine_pb2.GenerateRequest(text="The capital of France is", sampling=sampling)))
    by_ids = list(engine.Generate(engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=ids),
                                                             sampling=sampling)))
    tokens = [[t for d in _choices(run) for t in d.token_ids] for run in (by_text, by_ids)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
    detok = engine.Detokenize(engine_pb2.DetokenizeRequest(token_ids=tokens[0])).text
    assert detok == "".join(d.text for d in _choices(by_text))


def test_model_info_and_load(engine: engine_pb2_grpc.EngineStub) -> None:
    info = engine.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert list(info.served_model_names) == [MODEL]
    assert info.max_model_len == 2048 and info.vocab_size == 49152
    assert info.dtype == "float32" and info.has_chat_template
    assert 2 in info.eos_token_ids and info.engine_version.startswith("0.32")
    load = _wait_idle(engine)
    assert load.num_running_requests == 0 and 0.0 <= load.kv_cache_usage <= 1.0
    # An idle engine is not stalled; without prefix-KV offload there is no cache service to name.
    assert load.engine_stalled_ms == 0 and load.prefix_cache_incarnation == ""


def test_health_and_reflection(stack: Stack) -> None:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "taco_llm.engine.v1.Engine"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(reflection.ServerReflectionInfo(iter([ask])))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"taco_llm.engine.v1.Engine", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize(
    ("sampling", "field"),
    [({"temperature": -1.0}, "temperature"), ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
     ({"logprobs": 100}, "logprobs"), ({"n": 0}, "n"), ({"stop_token_ids": [10**7]}, "stop_token_ids")],
)
def test_bad_fields_are_invalid_argument_naming_the_field(engine: engine_pb2_grpc.EngineStub,
                                                          sampling: dict[str, object], field: str) -> None:
    code, details, typed = _status(engine.Generate(_chat("hi", **sampling)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert typed.field == field
    assert typed.reason == ("TOKEN_OUT_OF_VOCABULARY" if field == "stop_token_ids" else "FIELD_INVALID")
    assert field in details


@pytest.mark.parametrize(
    ("chunks", "field"),
    [(engine_pb2.PrefixChunks(digests=b"123", chunk_chars=64, text_chars=64), "prefix_chunks.digests"),
     (engine_pb2.PrefixChunks(digests=b"\0" * 8 * 4097, chunk_chars=64, text_chars=10**6), "prefix_chunks.digests"),
     (engine_pb2.PrefixChunks(digests=b"\0" * 8, chunk_chars=0, text_chars=64), "prefix_chunks.chunk_chars"),
     (engine_pb2.PrefixChunks(digests=b"\0" * 8, chunk_chars=64, text_chars=0), "prefix_chunks.text_chars")],
)
def test_malformed_prefix_chunks_are_invalid_argument_naming_the_field(
        engine: engine_pb2_grpc.EngineStub, chunks: engine_pb2.PrefixChunks, field: str) -> None:
    request = _chat("hi")
    request.prefix_chunks.CopyFrom(chunks)
    code, _details, typed = _status(engine.Generate(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and typed.field == field and typed.reason == "FIELD_INVALID"


def test_missing_input_unknown_model_and_too_long(engine: engine_pb2_grpc.EngineStub) -> None:
    code, details, typed = _status(engine.Generate(engine_pb2.GenerateRequest(model=MODEL)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and typed == rich_status.ErrorDetails("FIELD_REQUIRED", "input")
    code, details, typed = _status(engine.Generate(engine_pb2.GenerateRequest(model="other", text="hi")))
    assert code == grpc.StatusCode.NOT_FOUND and "other" in details and typed.field == "model"
    assert typed.reason == "MODEL_NOT_FOUND"
    code, details, typed = _status(engine.Generate(engine_pb2.GenerateRequest(text="hello " * 3000)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "context length" in details
    assert typed == rich_status.ErrorDetails("PROMPT_TOO_LONG", "text")
    code, _, typed = _status(engine.Generate(engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=[10**6]))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and typed.field == "token_ids"
    assert typed.reason == "TOKEN_OUT_OF_VOCABULARY"
    with pytest.raises(grpc.RpcError) as excinfo:
        engine.Detokenize(engine_pb2.DetokenizeRequest(token_ids=[5, 10**6]))
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[1]" in excinfo.value.details()
    assert rich_status.details_of(excinfo.value) == rich_status.ErrorDetails("TOKEN_OUT_OF_VOCABULARY", "token_ids")
    # Still serving.
    assert list(engine.Generate(_chat("hi", temperature=0, max_tokens=3)))


def test_cancelled_stream_is_aborted_in_the_engine(engine: engine_pb2_grpc.EngineStub) -> None:
    call = engine.Generate(_chat("Write a very long essay about the sea.", temperature=0, max_tokens=1500,
                                 ignore_eos=True))
    for received, _ in enumerate(call, start=1):
        if received == 5:
            load = _wait_load(engine, running=1, streams=1)
            assert load.num_running_requests == 1 and load.num_active_streams == 1, load
            call.cancel()
            break
    load = _wait_idle(engine)
    assert load.num_running_requests == 0 and load.num_active_streams == 0


def test_deadline_aborts_the_request(engine: engine_pb2_grpc.EngineStub) -> None:
    call = engine.Generate(_chat("Write a very long essay about the sea.", max_tokens=1500, ignore_eos=True),
                           timeout=1.5)
    with pytest.raises(grpc.RpcError) as excinfo:
        for _ in call:
            pass
    assert excinfo.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    load = _wait_idle(engine)
    assert load.num_running_requests == 0 and load.num_active_streams == 0


def test_abort_rpc_ends_a_running_request(engine: engine_pb2_grpc.EngineStub) -> None:
    request = _chat("Count to a thousand.", max_tokens=1500, ignore_eos=True)
    request.request_id = "abort-me"
    finish: list[int] = []

    def consume() -> None:
        for message in engine.Generate(request):
            finish.extend(d.finish_reason for d in message.delta.choices if d.finish_reason)

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 30
    while engine.GetLoad(engine_pb2.GetLoadRequest()).num_running_requests == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.Abort(engine_pb2.AbortRequest(request_id="abort-me")).aborted
    thread.join(30)
    assert finish == [engine_pb2.FINISH_REASON_ABORT]
    assert not engine.Abort(engine_pb2.AbortRequest(request_id="abort-me")).aborted


def test_http_client_disconnect_aborts_the_engine_request(stack: Stack,
                                                          engine: engine_pb2_grpc.EngineStub) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long essay."}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        # Held in a name: an abandoned line iterator is closed at once, and closing it disconnects.
        lines = reply.iter_lines()
        events = [line for line in itertools.islice(lines, 12) if line]
        assert len(events) == 6 and all(e.startswith('data: {"id":"chatcmpl-') for e in events), events
        load = _wait_load(engine, running=1, streams=1)
        assert load.num_running_requests == 1 and load.num_active_streams == 1, load
    load = _wait_idle(engine)
    assert load.num_running_requests == 0 and load.num_active_streams == 0


def test_prompt_logprobs_come_in_the_started_phase(engine: engine_pb2_grpc.EngineStub) -> None:
    request = engine_pb2.GenerateRequest(text="The capital of France is",
                                         sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=2,
                                                                            prompt_logprobs=2))
    messages = list(engine.Generate(request))
    started = messages[0].started
    prompt = list(started.prompt_token_ids)
    entries = list(started.prompt_logprobs)
    assert len(entries) == len(prompt) and not entries[0].candidates, "the first token has no context"
    for token, entry in zip(prompt[1:], entries[1:], strict=True):
        assert entry.candidates[0].token_id == token, "the prompt's own token comes first"
        assert entry.candidates[0].rank >= 1 and entry.candidates[0].logprob <= 0.0
        ranked = {c.rank for c in entry.candidates}
        assert {1, 2} <= ranked and len(entry.candidates) <= 3


def test_typed_errors_for_a_running_request_id_and_abort(engine: engine_pb2_grpc.EngineStub) -> None:
    request = _chat("Count to a thousand.", max_tokens=1500, ignore_eos=True)
    request.request_id = "twice"
    first = engine.Generate(request)
    try:
        assert next(first).WhichOneof("phase") == "started"
        code, details, typed = _status(engine.Generate(request))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "twice" in details
        assert typed == rich_status.ErrorDetails("REQUEST_ID_IN_USE", "request_id")
    finally:
        first.cancel()
    with pytest.raises(grpc.RpcError) as excinfo:
        engine.Abort(engine_pb2.AbortRequest())
    assert rich_status.details_of(excinfo.value) == rich_status.ErrorDetails("FIELD_REQUIRED", "request_id")
    _wait_idle(engine)
