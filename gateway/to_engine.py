"""OpenAI request bodies to the engine's GenerateRequest."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from taco_llm.protos import engine_pb2

from .errors import bad_request
from .protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

# The worker names proto fields; clients sent these. Keyed by the proto field name.
CHAT_PARAMS = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs", "chat": "messages",
               "chat.messages": "messages", "chat.tools": "tools", "chat.chat_template": "chat_template",
               "chat.chat_template_kwargs": "chat_template_kwargs", "chat.tool_choice": "tool_choice",
               ".content_parts": "content", ".function_name": "function.name",
               ".function_arguments": "function.arguments"}
COMPLETION_PARAMS = {"text": "prompt", "token_ids": "prompt"}
TOKENIZE_PARAMS = {"text": "prompt", "chat": "messages", "chat.messages": "messages",
                   "chat.chat_template": "chat_template", "chat.chat_template_kwargs": "chat_template_kwargs"}


# What each proto number type carries. A value past these would make protobuf raise (a 500) or, for a
# float, turn silently into infinity: each is refused here with a 400 naming the client's field. The
# worker checks what the values mean (n at most its limit, a token id in the vocabulary...).
_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
_FLOAT32_MAX = 3.4028234663852886e38
_SHOWN_DIGITS = 30


def _shown(value: float) -> str:
    text = str(value)
    return text if len(text) <= _SHOWN_DIGITS else f"{text[:_SHOWN_DIGITS]}... ({len(text)} characters)"


def check_carried(cpp_type: int, value: float, param: str) -> None:
    """Raises a 400 naming `param` where a proto field of `cpp_type` (FieldDescriptor.CPPTYPE_*) cannot
    carry `value` as it is."""
    if cpp_type in _INT_RANGES:
        low, high = _INT_RANGES[cpp_type]
        if not low <= value <= high:
            raise bad_request(f"{param} must be an integer from {low} to {high}, got {_shown(value)}", param)
    elif cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        limit = _FLOAT32_MAX if cpp_type == FieldDescriptor.CPPTYPE_FLOAT else math.inf
        if not math.isfinite(value) or abs(value) > limit:
            raise bad_request(f"{param} must be a finite number of at most {limit:.4g} in size, got {_shown(value)}",
                              param)


def _put(message: Message, name: str, value: Any, param: str) -> None:
    """Sets a scalar field of `message`, after check_carried."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        check_carried(message.DESCRIPTOR.fields_by_name[name].cpp_type, value, param)
    setattr(message, name, value)


def checked_ids(message: Message, name: str, ids: Sequence[int], param: str) -> Sequence[int]:
    """`ids` for the repeated number field `name`, after check_carried on the smallest and the largest."""
    if ids:
        cpp_type = message.DESCRIPTOR.fields_by_name[name].cpp_type
        check_carried(cpp_type, min(ids), param)
        check_carried(cpp_type, max(ids), param)
    return ids


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


JsonMessage = TypeVar("JsonMessage", struct_pb2.Struct, struct_pb2.ListValue, struct_pb2.Value)


def _json_message(value: Any, into: JsonMessage, param: str, label: str) -> JsonMessage:
    """A JSON value as protobuf's Struct or ListValue; a value protobuf cannot carry (NaN from a JSON
    string, say) is a 400 naming `param`, its message starting with `label`."""
    try:
        return json_format.ParseDict(value, into)
    except (json_format.ParseError, TypeError, ValueError, OverflowError) as error:
        raise bad_request(f"{label}: {error}", param) from None


def _struct(value: dict[str, Any], param: str) -> struct_pb2.Struct:
    return _json_message(value, struct_pb2.Struct(), param, f"{param} is not a JSON object")


def _schema(value: str | dict[str, Any], param: str) -> struct_pb2.Struct:
    """A JSON schema, sent as an object or (as vLLM also takes it) as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise bad_request(f"{param} is not valid JSON: {error}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON object (a JSON schema)", param)
    return _struct(value, param)


def _constraints(prefix: str, json_: str | dict[str, Any] | None, regex: str | None, choice: list[str] | None,
                 grammar: str | None) -> list[tuple[str, engine_pb2.StructuredOutput]]:
    """The constraints one spelling of the request gives (vLLM's `structured_outputs.*` or the older
    `guided_*`), each with the field name to blame."""
    found = []
    if json_ is not None:
        found.append((f"{prefix}json", engine_pb2.StructuredOutput(json_schema=_schema(json_, f"{prefix}json"))))
    if regex is not None:
        found.append((f"{prefix}regex", engine_pb2.StructuredOutput(regex=regex)))
    if choice is not None:
        found.append((f"{prefix}choice", engine_pb2.StructuredOutput(choice=engine_pb2.ChoiceList(choices=choice))))
    if grammar is not None:
        found.append((f"{prefix}grammar", engine_pb2.StructuredOutput(grammar=grammar)))
    return found


def _structured_output_param(body: SamplingFields) -> str | None:
    """The client's field that gave the structured output (at most one does: _structured_output)."""
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            return name
    so = body.structured_outputs
    if so is not None:
        for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None)):
            if value is not None:
                return f"structured_outputs.{name}"
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    return None


def request_params(base: Mapping[str, str], body: SamplingFields) -> Mapping[str, str]:
    """`base` (CHAT_PARAMS, COMPLETION_PARAMS), with the worker's `structured_output` field named as
    this request's client sent it (`guided_regex`, `structured_outputs.regex`, `response_format`...)."""
    param = _structured_output_param(body)
    if param is None:
        return base
    return {**base, "structured_output": param,
            **{f"structured_output.{kind}": param for kind in ("json_schema", "json_object", "regex", "choice",
                                                               "grammar", "backend")}}


def _structured_output(body: SamplingFields) -> engine_pb2.StructuredOutput | None:
    kinds = _constraints("guided_", body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar)
    so = body.structured_outputs
    if so is not None:
        kinds += _constraints("structured_outputs.", so.json_, so.regex, so.choice, so.grammar)
        if so.json_object:
            kinds.append(("structured_outputs.json_object", engine_pb2.StructuredOutput(json_object=True)))
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        kinds.append(("response_format", engine_pb2.StructuredOutput(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        kinds.append(("response_format", engine_pb2.StructuredOutput(
            json_schema=_struct(rf.json_schema.json_schema, "response_format"))))
    if not kinds:
        return None
    if len(kinds) > 1:
        names = ", ".join(name for name, _ in kinds)
        raise bad_request(f"only one kind of structured output may be given, got {names}", kinds[1][0])
    result = kinds[0][1]
    if body.guided_decoding_backend:
        result.backend = body.guided_decoding_backend
    return result


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    entry = engine_pb2.SamplingParams.LogitBiasEntry.DESCRIPTOR.fields_by_name
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:_SHOWN_DIGITS]!r}", "logit_bias") from None
        check_carried(entry["key"].cpp_type, token, "logit_bias")
        check_carried(entry["value"].cpp_type, value, "logit_bias")
        out[token] = value
    return out


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None, *,
                    max_tokens_param: str = "max_tokens",
                    logprobs_param: str = "logprobs") -> engine_pb2.SamplingParams:
    prompt_logprobs = body.prompt_logprobs
    if body.stream and prompt_logprobs is not None and (prompt_logprobs > 0 or prompt_logprobs == -1):
        # As vLLM's server: a stream has no place for them.
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    params = engine_pb2.SamplingParams(
        stop=_stop_list(body.stop),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        ignore_eos=bool(body.ignore_eos),
    )
    params.stop_token_ids.extend(checked_ids(params, "stop_token_ids", body.stop_token_ids or [], "stop_token_ids"))
    # Unset fields stay unset, so the worker applies the model's generation defaults.
    for name in ("temperature", "top_p", "top_k", "min_p", "min_tokens", "seed", "n",
                 "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "skip_special_tokens", "spaces_between_special_tokens"):
        value = getattr(body, name)
        if value is not None:
            if name == "n" and value < 1:
                raise bad_request(f"n must be at least 1, got {value}", "n")
            _put(params, name, value, name)
    if max_tokens is not None:
        _put(params, "max_tokens", max_tokens, max_tokens_param)
    if logprobs is not None:
        _put(params, "logprobs", logprobs, logprobs_param)
    if prompt_logprobs is not None:
        _put(params, "prompt_logprobs", prompt_logprobs, "prompt_logprobs")
    for token, bias in _logit_bias(body.logit_bias).items():
        params.logit_bias[token] = bias
    structured = _structured_output(body)
    if structured is not None:
        params.structured_output.CopyFrom(structured)
    return params


def chat_messages(messages: list[ChatMessageParam]) -> list[engine_pb2.ChatMessage]:
    out = []
    for m in messages:
        msg = engine_pb2.ChatMessage(role=m.role, name=m.name or "", tool_call_id=m.tool_call_id or "")
        if isinstance(m.content, str):
            msg.content = m.content
        elif m.content is not None:
            msg.content_parts.extend(
                engine_pb2.ContentPart(type=p.type, text=p.text or p.refusal or p.thinking or "") for p in m.content
            )
        for call in m.tool_calls or []:
            msg.tool_calls.append(engine_pb2.ToolCall(
                id=call.id, type=call.type,
                function_name=call.function.name, function_arguments=call.function.arguments,
            ))
        out.append(msg)
    return out


def chat_input(
    messages: list[ChatMessageParam],
    *,
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> engine_pb2.ChatInput:
    chat = engine_pb2.ChatInput(
        messages=chat_messages(messages),
        continue_final_message=bool(continue_final_message),
    )
    if chat_template_kwargs:
        chat.chat_template_kwargs.CopyFrom(_struct(chat_template_kwargs, "chat_template_kwargs"))
    if tools is not None:
        # An empty list is passed on: the worker refuses it by name, as vLLM does.
        chat.tools.CopyFrom(_json_message(tools, struct_pb2.ListValue(), "tools", "tools"))
    if tool_choice is not None:
        chat.tool_choice.CopyFrom(_json_message(tool_choice, struct_pb2.Value(), "tool_choice", "tool_choice"))
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    if chat_template is not None:
        chat.chat_template = chat_template
    return chat


def _common(request: engine_pb2.GenerateRequest, body: SamplingFields, request_id: str) -> None:
    request.request_id = request_id
    request.model = body.model or ""
    _put(request, "priority", body.priority or 0, "priority")
    request.cache_salt = body.cache_salt or ""
    if body.add_special_tokens is not None:
        request.add_special_tokens = body.add_special_tokens


def chat_request(body: ChatCompletionRequest, request_id: str) -> engine_pb2.GenerateRequest:
    if not body.messages:
        raise bad_request("messages must not be empty", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = engine_pb2.GenerateRequest(
        chat=chat_input(
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
        ),
        sampling=sampling_params(body, max_tokens, logprobs, max_tokens_param=max_tokens_param,
                                 logprobs_param="top_logprobs"),
    )
    _common(request, body, request_id)
    return request


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], *,
                       max_prompts: int | None = None) -> list[str | list[int]]:
    """OpenAI allows one prompt or a batch, each as text or token ids; a batch of at most `max_prompts`
    (--max-prompts-per-batch: each prompt is an engine request of its own)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if max_prompts is not None and len(prompt) > max_prompts:
            raise bad_request(f"prompt is a batch of {len(prompt)} prompts, more than {max_prompts} (the server's "
                              "--max-prompts-per-batch)", "prompt")
        return list(prompt)  # type: ignore[arg-type]
    raise bad_request("prompt must be a string, a list of strings, or token ids", "prompt")


def completion_request(
    body: CompletionRequest, prompt: str | list[int], request_id: str
) -> engine_pb2.GenerateRequest:
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of is not supported by vLLM's V1 engine; use n", "best_of")
    request = engine_pb2.GenerateRequest(sampling=sampling_params(body, body.max_tokens, body.logprobs))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(checked_ids(request.token_ids, "ids", prompt, "prompt"))
    _common(request, body, request_id)
    return request


def detokenize_request(body: DetokenizeRequest) -> engine_pb2.DetokenizeRequest:
    request = engine_pb2.DetokenizeRequest(model=body.model or "")
    request.token_ids.extend(checked_ids(request, "token_ids", body.tokens, "tokens"))
    return request


def tokenize_request(body: TokenizeRequest) -> engine_pb2.TokenizeRequest:
    request = engine_pb2.TokenizeRequest(
        model=body.model or "", return_token_strs=bool(body.return_token_strs)
    )
    if body.add_special_tokens is not None:
        request.add_special_tokens = body.add_special_tokens
    if body.messages is not None:
        if body.prompt is not None:
            raise bad_request("give either prompt or messages, not both", "messages")
        request.chat.CopyFrom(chat_input(
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            tools=body.tools,
        ))
    elif body.prompt is not None:
        request.text = body.prompt
    else:
        raise bad_request("prompt or messages is required", "prompt")
    return request
