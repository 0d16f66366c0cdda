"""The worker's admission checks on their own: limits, roles, content parts, ranges, and structured output
compiled by the engine core's own backend. No engine: vLLM's config, the real tokenizer and compiler."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from taco_llm.engine_worker.frontend.admission import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_STOP_STRING_LENGTH,
    DEFAULT_MAX_STOP_STRINGS,
    AdmissionLimits,
    StructuredOutputCheck,
    check_amplifiers,
    check_chat_messages,
    constraint_field,
)
from taco_llm.engine_worker.frontend.sampling import InvalidField, Limits, to_vllm
from taco_llm.protos import engine_pb2

LIMITS = Limits(max_model_len=2048, max_logprobs=20, vocab_size=49152)


def _field(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InvalidField) as caught:
        call(*args, **kwargs)
    return caught.value.field


def test_amplifiers_have_limits() -> None:
    limits = AdmissionLimits()
    assert (limits.max_n, limits.max_stop_strings, limits.max_stop_string_length) == (128, 64, 1024)
    check_amplifiers(engine_pb2.SamplingParams(n=DEFAULT_MAX_N, stop=["x"] * DEFAULT_MAX_STOP_STRINGS), limits)
    assert _field(check_amplifiers, engine_pb2.SamplingParams(n=DEFAULT_MAX_N + 1), limits) == "n"
    assert _field(check_amplifiers, engine_pb2.SamplingParams(n=2**32 - 1), limits) == "n"
    too_many = engine_pb2.SamplingParams(stop=[str(i) for i in range(100_000)])
    assert _field(check_amplifiers, too_many, limits) == "stop"
    too_long = engine_pb2.SamplingParams(stop=["x" * (DEFAULT_MAX_STOP_STRING_LENGTH + 1)])
    assert _field(check_amplifiers, too_long, limits) == "stop"
    assert _field(check_amplifiers, engine_pb2.SamplingParams(n=3), AdmissionLimits(max_n=2)) == "n"


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_openai_roles_pass(role: str) -> None:
    check_chat_messages([engine_pb2.ChatMessage(role=role, content="hi")], multimodal=False)


@pytest.mark.parametrize("role", ["hacker", "User", "ipython", " user"])
def test_other_roles_are_refused_naming_the_message(role: str) -> None:
    messages = [engine_pb2.ChatMessage(role="user", content="hi"), engine_pb2.ChatMessage(role=role, content="x")]
    assert _field(check_chat_messages, messages, multimodal=False) == "chat.messages[1].role"


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "video_url", "file", "audio_url"])
def test_parts_a_text_only_model_cannot_take(kind: str) -> None:
    message = engine_pb2.ChatMessage(role="user", content_parts=[
        engine_pb2.ContentPart(type="text", text="look"), engine_pb2.ContentPart(type=kind)])
    assert _field(check_chat_messages, [message], multimodal=False) == "chat.messages[0].content_parts[1].type"
    check_chat_messages([message], multimodal=True)  # vLLM's renderer decides for a multimodal model


def test_text_parts_pass() -> None:
    kinds = ("text", "input_text", "output_text", "refusal", "thinking")
    parts = [engine_pb2.ContentPart(type=t, text="a") for t in kinds]
    check_chat_messages([engine_pb2.ChatMessage(role="assistant", content_parts=parts)], multimodal=False)


def test_refusal_and_thinking_parts_reach_the_renderer_under_their_own_keys() -> None:
    from taco_llm.engine_worker.frontend.prompts import chat_messages

    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="assistant", content_parts=[
        engine_pb2.ContentPart(type="refusal", text="no"), engine_pb2.ContentPart(type="thinking", text="hm"),
        engine_pb2.ContentPart(type="text", text="ok")])])
    assert chat_messages(chat)[0]["content"] == [
        {"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "ok"}]


def _to_vllm(prompt_len: int = 10, **fields: Any) -> SamplingParams:
    return to_vllm(engine_pb2.SamplingParams(**fields), LIMITS, prompt_len, {})


def test_max_tokens_past_the_context_is_refused_and_within_it_clamped() -> None:
    assert _field(_to_vllm, max_tokens=LIMITS.max_model_len + 1) == "max_tokens"
    assert _field(_to_vllm, max_tokens=2**31 - 1) == "max_tokens"
    # As vLLM's server: what only the prompt leaves no room for is clamped to the room left.
    assert _to_vllm(prompt_len=100, max_tokens=LIMITS.max_model_len).max_tokens == LIMITS.max_model_len - 100
    assert _to_vllm(prompt_len=100).max_tokens == LIMITS.max_model_len - 100


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, -2, 21, 49153, 2**31 - 1])
def test_logprob_counts_past_the_limit_are_refused(name: str, value: int) -> None:
    assert _field(_to_vllm, **{name: value}) == name


def test_logprob_counts_past_the_vocabulary_are_refused() -> None:
    small = Limits(max_model_len=2048, max_logprobs=100_000, vocab_size=49152)
    with pytest.raises(InvalidField) as caught:
        to_vllm(engine_pb2.SamplingParams(logprobs=49153), small, 10, {})
    assert caught.value.field == "logprobs" and "vocabulary" in str(caught.value)
    assert to_vllm(engine_pb2.SamplingParams(logprobs=49152), small, 10, {}).logprobs == 49152


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_float_fields_refuse_nan_and_infinity(name: str, value: float) -> None:
    assert _field(_to_vllm, **{name: value}) == name


@pytest.mark.parametrize(("fields", "field"), [
    ({"temperature": 2.5}, "temperature"), ({"top_k": -2}, "top_k"), ({"min_tokens": 5000}, "min_tokens"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {49152: 1.0}}, "logit_bias"), ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
])
def test_out_of_range_fields_are_refused_by_name(fields: dict[str, Any], field: str) -> None:
    assert _field(_to_vllm, **fields) == field


def test_seeds_across_the_whole_int64_range_are_taken() -> None:
    for seed in (-(2**63), -1, 0, 2**63 - 1):
        assert _to_vllm(seed=seed, temperature=1.0).seed in (seed, None)  # vLLM reads -1 as "no seed"


def test_constraint_fields() -> None:
    assert constraint_field(engine_pb2.StructuredOutput(regex="a"), from_tools=False) == "structured_output.regex"
    assert constraint_field(engine_pb2.StructuredOutput(grammar="g"), from_tools=False) == "structured_output.grammar"
    assert constraint_field(engine_pb2.StructuredOutput(regex="a"), from_tools=True) == "chat.tools"


@pytest.fixture(scope="module")
def compiler(model_dir: Path) -> StructuredOutputCheck:
    from vllm.engine.arg_utils import EngineArgs

    from taco_llm.engine_worker.vllm_internals import get_tokenizer

    config = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=2048,
                        enforce_eager=True).create_engine_config()
    return StructuredOutputCheck(config, get_tokenizer(str(model_dir)), config.model_config.get_vocab_size())


def _compile(compiler: StructuredOutputCheck, **constraint: Any) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), max_tokens=5)
    asyncio.run(compiler.check(params, "the-field"))


@pytest.mark.parametrize("constraint", [
    {"regex": "(abc"}, {"regex": "a{5,2}"}, {"regex": "\\1"}, {"regex": "a\x00"},
    {"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}},
    {"json": {"type": "string", "pattern": "[z-a]", "minLength": 2}},  # the guidance fallback's path
    {"json": {"type": "integer", "minimum": 5, "maximum": 1}}, {"json": {"$ref": "#/definitions/missing"}},
    {"grammar": "root ::= foo"}, {"grammar": "start: foo"}, {"grammar": "   "}, {"choice": []},
])
def test_constraints_the_compiler_rejects_are_refused(compiler: StructuredOutputCheck,
                                                      constraint: dict[str, Any]) -> None:
    with pytest.raises(InvalidField) as caught:
        _compile(compiler, **constraint)
    assert caught.value.field == "the-field" and str(caught.value)


@pytest.mark.parametrize("constraint", [
    {"regex": "[a-z]{3}"}, {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"json": {"type": "string", "pattern": "^a+$", "minLength": 2}}, {"grammar": 'root ::= "yes" | "no"'},
    {"choice": ["yes", "no"]}, {"json_object": True},
])
def test_constraints_that_compile_pass(compiler: StructuredOutputCheck, constraint: dict[str, Any]) -> None:
    _compile(compiler, **constraint)


def test_compiled_outcomes_are_cached_by_digest_and_bounded(compiler: StructuredOutputCheck,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    compile_uncached = compiler._compile_uncached

    def counting(backend_name: str, kind: Any, spec: str) -> str | None:
        compiled.append(spec)
        return compile_uncached(backend_name, kind, spec)

    monkeypatch.setattr(compiler, "_compile_uncached", counting)
    monkeypatch.setattr(compiler, "_cache_size", 2)
    schemas = [{"type": "object", "properties": {f"cached{i}": {"type": "string"}}} for i in range(3)]
    _compile(compiler, json=schemas[0])
    _compile(compiler, json=schemas[0])
    assert len(compiled) == 1  # the repeat was not compiled again
    _compile(compiler, json=schemas[1])
    _compile(compiler, json=schemas[2])
    assert len(compiler._outcomes) == 2 and all(len(key) == 32 for key in compiler._outcomes)
    _compile(compiler, json=schemas[0])  # the oldest was dropped: compiled again
    assert len(compiled) == 4


def test_worker_flags_and_serve_hands_them_on() -> None:
    from taco_llm.engine_worker.frontend.args import build_parser
    from taco_llm.engine_worker.frontend.frontend_args import from_cli_args
    from taco_llm.serve_args import parse

    parser = build_parser()
    defaults = from_cli_args(parser, parser.parse_args([]), "").admission
    assert defaults == AdmissionLimits()
    given = from_cli_args(parser, parser.parse_args(["--max-n", "4", "--max-stop-strings", "2",
                                                     "--max-stop-string-length", "9"]), "").admission
    assert given == AdmissionLimits(max_n=4, max_stop_strings=2, max_stop_string_length=9)
    with pytest.raises(SystemExit):
        from_cli_args(parser, parser.parse_args(["--max-n", "0"]), "")
    # `--max-n` is not taken for an abbreviation of --max-num-seqs on the way through serve.
    worker_argv = parse(["--max-n", "4", "--max-num-seqs", "8", "--max-stop-strings", "2"]).worker_argv
    assert worker_argv[worker_argv.index("--max-n") + 1] == "4"
    assert worker_argv[worker_argv.index("--max-num-seqs") + 1] == "8"
    assert worker_argv[worker_argv.index("--max-stop-strings") + 1] == "2"
