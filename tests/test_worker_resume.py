"""GenerateRequest.resume: a stream continued from the tokens another worker already sent.

Over gRPC against the shared float32 worker (greedy output is then the same whatever the batch), plus the
tool-call parser's replay on the real tokenizer (no engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from taco_llm.engine_worker.frontend.outputs import ResumedText
from taco_llm.engine_worker.frontend.tools import ToolCalling, tool_parser_class
from taco_llm.protos import engine_pb2, engine_pb2_grpc, rich_status

from .conftest import ENGINE_FLAGS

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 40
CONTEXT_LENGTH = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--max-model-len") + 1])  # the shared worker's


# Byte-level BPE splits each of these characters over several tokens, and the model repeats them.
EMOJI_PROMPT = 'Repeat this exactly three times: "😀🙂👍 你好世界"'


class Run:
    """One Generate call's stream, read to the end."""

    def __init__(self, messages: list[engine_pb2.GenerateResponse]):
        phases = [m.WhichOneof("phase") for m in messages]
        assert phases[0] == "started" and phases[-1] == "finished", phases
        self.started = messages[0].started
        self.usage = messages[-1].finished.usage
        self.choices = [c for m in messages if m.WhichOneof("phase") == "delta" for c in m.delta.choices]
        self.ids = [t for c in self.choices for t in c.token_ids]
        self.text = "".join(c.text for c in self.choices)
        self.finish_reason = self.choices[-1].finish_reason

    def relayed(self, count: int) -> str | None:
        """The text the stream had relayed with its first `count` tokens (None: no delta ended there)."""
        sent, text = 0, ""
        for choice in self.choices:
            if sent == count:
                return text
            sent += len(choice.token_ids)
            text += choice.text
        return text if sent == count else None


def _request(kind: str, *, resume: list[int] | None = None, content: str = "",
             **sampling: Any) -> engine_pb2.GenerateRequest:
    request = engine_pb2.GenerateRequest(model=MODEL, sampling=engine_pb2.SamplingParams(**sampling))
    if kind == "text":
        request.text = content or "The three most famous rivers of Europe are"
    else:
        request.chat.messages.add(role="user",
                                  content=content or "Tell me a short story about a lighthouse keeper.")
    if resume is not None:
        request.resume.output_token_ids.extend(resume)
    return request


def _refusal(engine: engine_pb2_grpc.EngineStub, request: engine_pb2.GenerateRequest) -> tuple[Any, Any]:
    with pytest.raises(grpc.RpcError) as caught:
        list(engine.Generate(request))
    details = rich_status.details_of(caught.value)
    return caught.value.code(), details


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_resumed_greedy_stream_continues_the_uninterrupted_one(engine: engine_pb2_grpc.EngineStub,
                                                                 kind: str) -> None:
    whole = Run(list(engine.Generate(_request(kind, temperature=0, max_tokens=MAX_TOKENS))))
    assert len(whole.ids) == MAX_TOKENS, "the prompts are chosen to run to max_tokens"
    for k in (1, 17, MAX_TOKENS - 1):
        rest = Run(list(engine.Generate(_request(kind, resume=whole.ids[:k], temperature=0, max_tokens=MAX_TOKENS))))
        assert whole.ids[:k] + rest.ids == whole.ids, f"resumed after {k} tokens"
        assert list(rest.started.prompt_token_ids) == list(whole.started.prompt_token_ids), \
            "Started shows the rendered prompt, not the resumed tokens"
        sent = engine.Detokenize(engine_pb2.DetokenizeRequest(model=MODEL, token_ids=whole.ids[:k])).text
        assert sent + rest.text == whole.text, "the new text is decoded in the context of the resumed tokens"
        # Counted once: as the whole stream's usage.
        assert rest.usage.prompt_tokens == whole.usage.prompt_tokens
        assert rest.usage.completion_tokens == whole.usage.completion_tokens == MAX_TOKENS
        assert rest.usage.cached_prompt_tokens <= rest.usage.prompt_tokens
        assert rest.finish_reason == whole.finish_reason == engine_pb2.FINISH_REASON_LENGTH


@pytest.mark.e2e
def test_a_stream_resumed_inside_a_character_shows_each_character_once(engine: engine_pb2_grpc.EngineStub) -> None:
    whole = Run(list(engine.Generate(_request("chat", content=EMOJI_PROMPT, temperature=0, max_tokens=24))))
    assert "😀" in whole.text and "你好" in whole.text, whole.text
    assert any(not c.text for c in whole.choices[:20]), "some characters must span several tokens"
    for k in range(1, 21):
        sent = whole.relayed(k)
        assert sent is not None, "vLLM relays one token per delta"
        rest = Run(list(engine.Generate(_request("chat", content=EMOJI_PROMPT, resume=whole.ids[:k],
                                                 temperature=0, max_tokens=24))))
        assert whole.ids[:k] + rest.ids == whole.ids, f"resumed after {k} tokens"
        assert sent + rest.text == whole.text, f"resumed after {k} tokens: {sent!r} + {rest.text!r}"
        for choice in rest.choices:
            assert "Repeat this" not in choice.text and "assistant" not in choice.text, (k, choice.text)


@pytest.mark.e2e
def test_resume_without_max_tokens_runs_to_the_end_of_the_context(engine: engine_pb2_grpc.EngineStub) -> None:
    # About 1,960 prompt tokens of the 2,048-token context, so that running to its end
    # takes ~90 tokens, not ~2,000; the repetition keeps the model from stopping sooner.
    prompt = "The Danube, the Rhine and the Volga are rivers of Europe. " * 140
    first = Run(list(engine.Generate(_request("text", content=prompt, temperature=0, max_tokens=3))))
    rest = Run(list(engine.Generate(_request("text", content=prompt, resume=first.ids, temperature=0,
                                             min_tokens=5))))
    assert len(rest.ids) >= 5 - 3
    assert rest.usage.completion_tokens == 3 + len(rest.ids)
    assert rest.finish_reason == engine_pb2.FINISH_REASON_LENGTH, rest.finish_reason
    assert rest.usage.prompt_tokens + rest.usage.completion_tokens == CONTEXT_LENGTH


@pytest.mark.e2e
def test_resume_refusals_name_their_field(engine: engine_pb2_grpc.EngineStub) -> None:
    ids = Run(list(engine.Generate(_request("text", temperature=0, max_tokens=5)))).ids
    cases = [
        (_request("text", resume=ids, n=2, temperature=0, max_tokens=20),
         grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "sampling.n"),
        (_request("text", resume=ids, temperature=0, max_tokens=5),
         grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "resume.output_token_ids"),
        (_request("text", resume=ids, temperature=0, max_tokens=20,
                  structured_output=engine_pb2.StructuredOutput(regex="[a-z ]+")),
         grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "resume"),
        (_request("chat", resume=ids, temperature=0, max_tokens=20,
                  structured_output=engine_pb2.StructuredOutput(json_object=True)),
         grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "resume"),
        (_request("text", resume=ids, temperature=0, max_tokens=20, presence_penalty=0.5),
         grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "resume"),
        (_request("text", resume=ids, temperature=0, max_tokens=20, frequency_penalty=-0.5),
         grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "resume"),
        (_request("text", resume=ids, temperature=0, max_tokens=20, stop=["river"]),
         grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "resume"),
        (_request("text", resume=[*ids, 10**7], temperature=0, max_tokens=20),
         grpc.StatusCode.INVALID_ARGUMENT, "TOKEN_OUT_OF_VOCABULARY", "resume.output_token_ids"),
        (_request("text", resume=ids * 500, temperature=0),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "PROMPT_TOO_LONG", "text"),
    ]
    for request, code, reason, field in cases:
        got_code, details = _refusal(engine, request)
        assert (got_code, details.reason, details.field) == (code, reason, field), request


# --- the tool-call parser's replay: no engine --------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
OUTPUT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from taco_llm.engine_worker.vllm_internals import get_tokenizer

    return get_tokenizer(str(model_dir))


def _feed(parser: Any, tokenizer: Any, ids: list[int], *, last: bool) -> list[engine_pb2.ChoiceDelta]:
    deltas = []
    for i, token in enumerate(ids):
        finished = last and i == len(ids) - 1
        delta = engine_pb2.ChoiceDelta(text=tokenizer.decode([token], skip_special_tokens=False), token_ids=[token],
                                       finish_reason=engine_pb2.FINISH_REASON_STOP if finished else None)
        parser.delta(delta, [1, 2, 3], finished=finished)
        deltas.append(delta)
    return deltas


def _streamed(deltas: list[engine_pb2.ChoiceDelta]) -> tuple[str, str, str]:
    content = "".join(d.parsed.content for d in deltas)
    names = "".join(c.function_name for d in deltas for c in d.parsed.tool_calls)
    arguments = "".join(c.function_arguments for d in deltas for c in d.parsed.tool_calls)
    return content, names, arguments


def test_the_tool_parser_continues_a_resumed_call(tokenizer: Any) -> None:
    calling = ToolCalling(tool_parser_class("hermes", True, tokenizer), True, tokenizer, None, "hermes")
    chat = engine_pb2.ChatInput()
    tools = calling.prepare([{"role": "user", "content": "Weather in Paris?"}], [WEATHER], chat, None)
    assert tools is not None
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    whole = _feed(tools.choice_parser(), tokenizer, ids, last=True)
    content, names, arguments = _streamed(whole)
    assert (content.strip(), names, json.loads(arguments)) == ("Let me check.", "get_weather", {"city": "Paris"})
    for k in range(3, len(ids) - 1, 4):  # before, inside and after the call's opening
        before = _streamed(whole[:k])
        parser = tools.choice_parser()
        resumed = ResumedText(tokenizer, [1, 2, 3], ids[:k], skip_special_tokens=False)
        parser.replay(resumed.pieces(), [1, 2, 3])
        after = _feed(parser, tokenizer, ids[k:], last=True)
        rest = _streamed(after)
        assert tuple(a + b for a, b in zip(before, rest, strict=True)) == (content, names, arguments), k
        last = after[-1]
        assert last.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS, k
        (call,) = last.parsed.whole.tool_calls
        assert (call.function_name, json.loads(call.function_arguments)) == ("get_weather", {"city": "Paris"})
        assert last.parsed.whole.content.strip() == "Let me check."


def test_resumed_text_continues_inside_a_character(tokenizer: Any) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": EMOJI_PROMPT}], add_generation_prompt=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    output = tokenizer.encode(" hello 😀🙂 world 你好", add_special_tokens=False)
    whole = tokenizer.decode(output)
    for k in range(1, len(output)):
        resumed = ResumedText(tokenizer, prompt, output[:k], skip_special_tokens=True)
        assert whole.startswith(resumed.shown) and not resumed.shown.endswith("\ufffd"), k
        assert "".join(text for text, _ in resumed.pieces()) == resumed.shown, k
        assert [i for _, ids in resumed.pieces() for i in ids] == output[:k], k
        deltas = [resumed.delta([token]) for token in output[k:]]
        assert resumed.shown + "".join(deltas) == whole, k
        assert all("\ufffd" not in delta for delta in deltas), k


def test_resumed_text_leaves_out_the_stop_token_as_vllm_does(tokenizer: Any) -> None:
    """vLLM never shows the text of the token that stopped a choice (EOS or a stop token), unless
    include_stop_str_in_output; a resumed stream decoding its own text must not either."""
    output = tokenizer.encode(" hello world", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    resumed = ResumedText(tokenizer, [1, 2, 3], output[:1], skip_special_tokens=False)
    assert resumed.delta(output[1:]) + resumed.delta([eos], stopped_by_token=True) == tokenizer.decode(output[1:])
    shown = ResumedText(tokenizer, [1, 2, 3], output[:1], skip_special_tokens=False, include_stop_str_in_output=True)
    assert shown.delta([*output[1:], eos], stopped_by_token=True).endswith(tokenizer.decode([eos]))
