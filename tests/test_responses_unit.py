"""The Responses API without an engine: items as chat messages, the output items and their events, and
the two response stores (the Redis one on a real redis-server) with their bounds: TTL, byte cap, tenant
scope, and the status guard that keeps a cancel from being overwritten."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from taco_llm.gateway.errors import APIError
from taco_llm.gateway.from_engine import TokenText
from taco_llm.gateway.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoredResponse,
    record_key,
)
from taco_llm.gateway.responses_protocol import ResponsesRequest
from taco_llm.gateway.serving_responses import LIVE, OutputItems, chat_request, input_messages
from taco_llm.protos import engine_pb2

from .support import RedisServer, free_port


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


# --- a request as a chat completion ------------------------------------------------------------------

def test_items_become_chat_messages_and_consecutive_calls_one_assistant_turn() -> None:
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny, then rain."}]},
    ])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny, then rain."},
    ]


def test_instructions_lead_and_are_not_part_of_the_conversation_carried_on() -> None:
    earlier = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = _request(instructions="Answer in French.", input="c", max_output_tokens=5, temperature=0, top_k=3,
                    tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
                    tool_choice={"type": "function", "name": "f"},
                    text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                     "strict": True}},
                    include=["message.output_text.logprobs"], top_logprobs=2)
    chat, conversation = chat_request(body, earlier)
    assert conversation == [*earlier, {"role": "user", "content": "c"}]
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.logprobs, chat.top_logprobs) == (5, 0, 3, True, 2)
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == {"type": "object"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_what_cannot_be_served_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        chat_request(_request(**fields), [])
    assert (refused.value.status, refused.value.param) == (400, param)


# --- output items and their events --------------------------------------------------------------------

def _text_delta(text: str, finish: engine_pb2.FinishReason.ValueType = 0) -> engine_pb2.ChoiceDelta:
    return engine_pb2.ChoiceDelta(index=0, text=text, finish_reason=finish)


def test_text_then_a_tool_call_close_in_output_order() -> None:
    output = OutputItems(TokenText())
    events = output.add(_text_delta("Let me "))
    events += output.add(_text_delta("check."))
    events += output.call(0, call_id="c1", name="weather", arguments='{"city":')
    events += output.call(0, call_id="", name="", arguments='"Paris"}')
    events += output.close()
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta",
        # the message closes when the call opens
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    # Each event shows the item as it was then: the added message had no part yet.
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert events[4]["text"] == "Let me check."
    assert events[-2]["arguments"] == '{"city":"Paris"}' and events[-1]["output_index"] == 1
    assert [item["status"] for item in output.items] == ["completed", "completed"]
    assert output.assistant_message() == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]}


def test_a_length_stop_leaves_the_message_incomplete() -> None:
    output = OutputItems(TokenText())
    output.add(_text_delta("cut sh", engine_pb2.FINISH_REASON_LENGTH))
    events = output.close()
    assert output.incomplete and output.items[0]["status"] == "incomplete"
    assert events[-1]["item"]["status"] == "incomplete"


# --- the stores ---------------------------------------------------------------------------------------

def _record(response_id: str, *, status: str = "completed", pad: int = 0) -> StoredResponse:
    return StoredResponse({"id": response_id, "object": "response", "status": status, "pad": "x" * pad},
                          [{"role": "user", "content": "hi"}])



class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stores(kind: str, redis_server: RedisServer, *, ttl: float, max_bytes: int) -> tuple[ResponseStore, Any]:
    """A store and what moves its time on: the fake clock of the memory one, real sleep for Redis."""
    if kind == "memory":
        clock = FakeClock()

        async def advance(seconds: float) -> None:
            clock.now += seconds
        return MemoryResponseStore(ttl=ttl, max_bytes=max_bytes, clock=clock), advance
    redis.Redis.from_url(redis_server.url).flushdb()
    return RedisResponseStore(redis_server.url, ttl=ttl, max_bytes=max_bytes), asyncio.sleep


def _size(record: StoredResponse) -> int:
    return len(record.body())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_tenant_finds_its_own_responses_and_no_other_tenants(kind: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        store, _ = _stores(kind, redis_server, ttl=60, max_bytes=1 << 20)
        assert await store.put("alice", _record("resp_1"))
        found = await store.get("alice", "resp_1")
        assert found is not None and found.response["id"] == "resp_1" and found.messages[0]["content"] == "hi"
        assert await store.get("bob", "resp_1") is None
        assert await store.get("", "resp_1") is None
        assert not await store.delete("bob", "resp_1")
        assert await store.delete("alice", "resp_1")
        assert await store.get("alice", "resp_1") is None
        await store.close()
    asyncio.run(run())
    # Scopes never run into each other, whatever their names hold.
    assert record_key("a:b", "c") != record_key("a", "b:c")


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_cancelled_response_is_never_written_back_to_completed(kind: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        store, _ = _stores(kind, redis_server, ttl=60, max_bytes=1 << 20)
        assert await store.put("", _record("resp_1", status="in_progress"))
        assert await store.put("", _record("resp_1", status="cancelled"), only_from=LIVE)
        assert not await store.put("", _record("resp_1", status="completed"), only_from=LIVE)
        stored = await store.get("", "resp_1")
        assert stored is not None and stored.status == "cancelled"
        # A response deleted while it ran is not brought back by its runner.
        await store.delete("", "resp_1")
        assert not await store.put("", _record("resp_1", status="completed"), only_from=LIVE)
        assert await store.get("", "resp_1") is None
        await store.close()
    asyncio.run(run())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_the_byte_cap_evicts_the_oldest_first_and_refuses_what_cannot_fit(kind: str,
                                                                          redis_server: RedisServer) -> None:
    one = _size(_record("resp_0", pad=1000))

    async def run() -> None:
        store, _ = _stores(kind, redis_server, ttl=60, max_bytes=3 * one + 10)
        for i in range(3):
            assert await store.put("t", _record(f"resp_{i}", pad=1000))
        # Rewriting one moves it to the back of the line.
        assert await store.put("t", _record("resp_0", pad=1000))
        assert await store.put("t", _record("resp_3", pad=1000))
        assert [await store.get("t", f"resp_{i}") is not None for i in range(4)] == [True, False, True, True]
        assert not await store.put("t", _record("huge", pad=4 * one))
        assert await store.get("t", "huge") is None
        # Too large to store, it leaves the record it would have replaced as it was.
        assert not await store.put("t", _record("resp_3", pad=4 * one))
        assert await store.get("t", "resp_3") is not None
        await store.close()
    asyncio.run(run())
    if kind == "redis":
        client = redis.Redis.from_url(redis_server.url)
        assert int(client.get("taco_llm:responses:bytes") or 0) == 3 * one
        assert client.zcard("taco_llm:responses:index") == 3


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_responses_expire_after_the_ttl(kind: str, redis_server: RedisServer) -> None:
    store, advance = _stores(kind, redis_server, ttl=0.3, max_bytes=1 << 20)

    async def run() -> None:
        assert await store.put("t", _record("resp_old"))
        await advance(0.5)
        assert await store.get("t", "resp_old") is None
        # The next write takes the expired one off the books too.
        assert await store.put("t", _record("resp_new"))
        if isinstance(store, MemoryResponseStore):
            assert store.stored_bytes == _size(_record("resp_new"))
        await store.close()
    asyncio.run(run())
    if kind == "redis":
        client = redis.Redis.from_url(redis_server.url)
        assert int(client.get("taco_llm:responses:bytes") or 0) == _size(_record("resp_new"))


def test_a_redis_that_does_not_answer_is_a_503_to_retry() -> None:
    async def run() -> None:
        store = RedisResponseStore(f"redis://127.0.0.1:{free_port()}/0", ttl=60, max_bytes=1 << 20)
        with pytest.raises(APIError) as refused:
            await store.get("t", "resp_1")
        assert refused.value.status == 503 and "Retry-After" in refused.value.headers
        await store.close()
    asyncio.run(run())


def test_a_stored_record_reads_back_as_it_was_written(tmp_path: Path) -> None:
    record = _record("resp_1")
    assert StoredResponse.parse(record.body()) == record
    assert json.loads(record.body())["response"]["status"] == "completed"


# --- flags --------------------------------------------------------------------------------------------

def test_the_store_is_the_registrys_redis_unless_named_and_its_bounds_are_flags() -> None:
    from taco_llm.gateway.__main__ import parse

    assert parse(["--engine", "a:1"]).responses_store_url is None
    fleet = parse(["--registry-url", "redis://r:6379/0", "--responses-ttl", "60", "--responses-max-bytes", "1000"])
    assert (fleet.responses_store_url, fleet.responses_ttl, fleet.responses_max_bytes) == ("redis://r:6379/0", 60, 1000)
    own = parse(["--registry-url", "redis://r:6379/0", "--responses-store-url", "redis://s:6379/1"])
    assert own.responses_store_url == "redis://s:6379/1"


@pytest.mark.parametrize(("argv", "named"), [
    (["--responses-ttl", "0"], "--responses-ttl"),
    (["--responses-ttl", "nan"], "--responses-ttl"),
    (["--responses-max-bytes", "0"], "--responses-max-bytes"),
    (["--responses-store-url", "http://r:6379"], "--responses-store-url"),
])
def test_a_bad_store_flag_stops_the_gateway_naming_it(argv: list[str], named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from taco_llm.gateway.__main__ import parse

    with pytest.raises(SystemExit):
        parse(["--engine", "a:1", *argv])
    assert named in capsys.readouterr().err


def test_serve_hands_the_store_flags_to_the_gateway() -> None:
    from taco_llm.serve_args import parse as parse_serve

    args = parse_serve(["some/model", "--responses-ttl", "30", "--responses-max-bytes", "4096"])
    assert args.gateway_argv[-4:] == ["--responses-ttl", "30.0", "--responses-max-bytes", "4096"]
    assert "--responses-ttl" not in args.worker_argv
