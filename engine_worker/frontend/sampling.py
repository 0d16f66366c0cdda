"""The proto's SamplingParams to vLLM's, with every refusal naming its field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from taco_llm.protos import engine_pb2
from taco_llm.protos.rich_status import Reason

# Struct numbers are doubles; whole numbers up to this are turned back into the integers they were.
_EXACT_INTEGER_LIMIT = 2**53


class InvalidField(ValueError):
    """A request field with a value the engine cannot use; `reason` is an ErrorReason value."""

    def __init__(self, field: str, message: str, reason: int = Reason.FIELD_INVALID):
        super().__init__(message)
        self.field = field
        self.reason = reason


def _whole_numbers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_INTEGER_LIMIT:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


def json_value(message: struct_pb2.Struct | struct_pb2.ListValue | struct_pb2.Value) -> Any:
    """A Struct, ListValue or Value as the JSON value (dict, list, str, ...) it carries, with whole
    numbers as ints: a JSON schema's `"maxItems": 2` or a template's `{{ n }}` must not become 2.0."""
    return _whole_numbers(json_format.MessageToDict(message))


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_logprobs: int
    vocab_size: int


# Ranges as vLLM's SamplingParams and OpenAI define them, checked here so the error names the field.
_FLOAT_RANGES: dict[str, tuple[float, float, bool]] = {
    # name: (low, high, low is exclusive)
    "temperature": (0.0, float("inf"), False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, float("inf"), True),
}


def _check_float(name: str, value: float) -> None:
    low, high, exclusive = _FLOAT_RANGES[name]
    # NaN fails every comparison, and infinity is no sampling setting (vLLM would divide logits by it).
    if not math.isfinite(value) or value > high or value < low or (exclusive and value == low):
        bracket = "(" if exclusive else "["
        raise InvalidField(name, f"{name} must be in {bracket}{low}, {high}], got {value}")


def structured(so: engine_pb2.StructuredOutput) -> StructuredOutputsParams | None:
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=json_value(so.json_schema))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=so.regex)
    if kind == "choice":
        if not so.choice.choices:
            raise InvalidField("structured_output.choice", "choice needs at least one option")
        return StructuredOutputsParams(choice=list(so.choice.choices))
    return StructuredOutputsParams(grammar=so.grammar)


def to_vllm(
    params: engine_pb2.SamplingParams,
    limits: Limits,
    prompt_len: int,
    defaults: dict[str, Any],
    overrides: dict[str, Any] | None = None,
) -> SamplingParams:
    """Builds vLLM's SamplingParams. Fields left unset take the model's generation defaults;
    `overrides` (a forced tool call's constraint, say) win over the request's own fields."""
    kwargs: dict[str, Any] = dict(defaults)
    for name in _FLOAT_RANGES:
        if params.HasField(name):
            value = getattr(params, name)
            _check_float(name, value)
            kwargs[name] = value
    if params.HasField("top_k"):
        if params.top_k < -1:
            raise InvalidField("top_k", f"top_k must be -1 or 0 (off) or at least 1, got {params.top_k}")
        kwargs["top_k"] = params.top_k
    if params.HasField("n"):
        if params.n < 1:
            raise InvalidField("n", f"n must be at least 1, got {params.n}")
        kwargs["n"] = params.n
    # As vLLM's server does: a max_tokens larger than the whole context is refused; one that only the
    # prompt leaves no room for is clamped to the room left.
    room = limits.max_model_len - prompt_len
    if params.HasField("max_tokens"):
        if params.max_tokens < 1:
            raise InvalidField("max_tokens", f"max_tokens must be at least 1, got {params.max_tokens}")
        if params.max_tokens > limits.max_model_len:
            raise InvalidField("max_tokens", f"max_tokens={params.max_tokens} cannot be greater than this "
                                             f"model's context length ({limits.max_model_len} tokens)")
        kwargs["max_tokens"] = min(params.max_tokens, room)
    else:
        kwargs["max_tokens"] = min(int(defaults.get("max_tokens") or room), room)
    if params.HasField("min_tokens"):
        if params.min_tokens < 0 or params.min_tokens > kwargs["max_tokens"]:
            raise InvalidField("min_tokens", f"min_tokens must be in [0, max_tokens], got {params.min_tokens}")
        kwargs["min_tokens"] = params.min_tokens
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name):
            value = getattr(params, name)
            # vLLM reads -1 as "the whole vocabulary": refused here like any count past --max-logprobs.
            # --max-logprobs -1 is vLLM's "no cap": then the vocabulary is the only bound.
            most = limits.vocab_size if limits.max_logprobs < 0 else min(limits.max_logprobs, limits.vocab_size)
            if value < 0 or value > most:
                raise InvalidField(
                    name, f"{name} must be in [0, {most}] (--max-logprobs {limits.max_logprobs}, vocabulary "
                          f"{limits.vocab_size} tokens), got {value}"
                )
            kwargs[name] = value
    if params.HasField("seed"):
        kwargs["seed"] = params.seed
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        if params.HasField(name):
            kwargs[name] = getattr(params, name)
    if any(not s for s in params.stop):
        raise InvalidField("stop", "stop strings must not be empty")
    for token in list(params.stop_token_ids) + list(params.logit_bias):
        if token >= limits.vocab_size:
            field = "stop_token_ids" if token in params.stop_token_ids else "logit_bias"
            raise InvalidField(field, f"{field}: token id {token} is outside the vocabulary "
                                      f"(size {limits.vocab_size})", Reason.TOKEN_OUT_OF_VOCABULARY)
    for token, bias in params.logit_bias.items():
        if not -100.0 <= bias <= 100.0:
            raise InvalidField("logit_bias", f"logit_bias for token {token} must be in [-100, 100], got {bias}")
    kwargs.update(
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
        logit_bias=dict(params.logit_bias) or None,
        structured_outputs=structured(params.structured_output),
        output_kind=RequestOutputKind.DELTA,
    )
    kwargs.update(overrides or {})
    try:
        return SamplingParams(**kwargs)
    except VLLMValidationError as error:  # n > 1 with greedy sampling, say
        raise InvalidField(error.parameter or "sampling", str(error)) from None
    except (ValueError, TypeError) as error:
        raise InvalidField("sampling", str(error)) from None
