"""The OpenAI request bodies the gateway accepts, with vLLM's extra sampling fields.

Only types are checked here. Ranges (temperature >= 0, max_tokens >= 1, ...) are the worker's to
check, so that gRPC clients calling the worker directly get the same answers as HTTP clients.
Unknown fields are accepted and ignored, as OpenAI's and vLLM's servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag

from taco_llm.protos.engine_limits import CHAT_ROLES


class _Lenient(BaseModel):
    # NaN and Infinity parse from JSON (Python's json takes them) but are no value of any field.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JSONSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Lenient):
    """vLLM's `structured_outputs` request field."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionCall(_Lenient):
    name: str = ""
    arguments: str = ""


class ToolCallParam(_Lenient):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ContentPartParam(_Lenient):
    type: str
    text: str | None = None
    # The payload of OpenAI's "refusal" parts and vLLM's "thinking" parts (an assistant's earlier turns).
    refusal: str | None = None
    thinking: str | None = None


class ChatMessageParam(_Lenient):
    # The schema names OpenAI's roles (the worker refuses others, naming the field); validation leaves
    # that to the worker, so that gRPC clients get the same answer.
    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[ContentPartParam] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    add_special_tokens: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    # The names vLLM used before `structured_outputs`; old clients still send them.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    response_format: ResponseFormat | None = None
    priority: int | None = 0
    cache_salt: str | None = None
    request_id: str | None = None
    # vLLM's extension: token ids of the prompt and of each choice in the response.
    return_token_ids: bool | None = False
    # vLLM's extension: each prompt token's log-probability and this many alternatives (not with stream).
    prompt_logprobs: int | None = None


class _ChatFields(SamplingFields):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(_ChatFields):
    messages: list[ChatMessageParam] = Field(json_schema_extra={"minItems": 1})


class BatchChatCompletionRequest(_ChatFields):
    """/v1/chat/completions/batch, as vLLM 0.32's: a chat completion's fields, with `messages` a list of
    conversations, each answered on its own; choice i answers conversation i. Not streamed, without
    tools, one choice per conversation."""

    messages: list[list[ChatMessageParam]] = Field(json_schema_extra={"minItems": 1})


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    # With messages: the tools the chat template renders into the prompt, as a chat completion's.
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Lenient):
    """vLLM's /v1/load_lora_adapter body; the adapter's folder as the workers' filesystems see it."""

    lora_name: str
    lora_path: str
    load_inplace: bool | None = False
    # taco-llm's: the base model the adapter adapts, where the fleet serves several.
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(_Lenient):
    lora_name: str
    # vLLM's; each worker numbers its adapters itself, so the name alone is used.
    lora_int_id: int | None = None


# ---- What the routes answer, for /openapi.json only: the handlers build plain dicts, and these models
# document them (FastAPI's `responses=`), so that a client generator, or the schemathesis fuzz in
# tests/test_fuzz_gateway.py, can check every answer against them. Fields some answers leave out (an
# option's output) have defaults, which keeps them out of `required`.


class ErrorDetail(_Lenient):
    message: str
    type: str
    # The request field at fault, as the client named it; null where no one field is.
    param: str | None
    # A string code ("model_not_found", "invalid_api_key", ...) or the HTTP status.
    code: str | int | None


class ErrorResponse(_Lenient):
    """OpenAI's error JSON: every refusal the gateway makes, and errors in a stream's events."""

    error: ErrorDetail


class PromptTokensDetails(_Lenient):
    cached_tokens: int


class UsageInfo(_Lenient):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatMessageOut(_Lenient):
    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(_Lenient):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    # The stop string, or the stop token id, that ended the choice; null for EOS or length.
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Lenient):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionChoice(_Lenient):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(_Lenient):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None


class StreamEvent(_Lenient):
    """One server-sent event of a stream (`stream: true`): `data` is a chunk's JSON (a
    chat.completion.chunk or text_completion object, or an ErrorResponse where the stream failed
    midway), and the last event's data is `[DONE]`."""

    data: str


class TokenizeResponse(_Lenient):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Lenient):
    prompt: str


def _invocation_kind(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


class InvocationRequest(RootModel[Annotated[Annotated[ChatCompletionRequest, Tag("chat")]
                                            | Annotated[CompletionRequest, Tag("completion")],
                                            Discriminator(_invocation_kind)]]):
    """SageMaker's /invocations: a chat completion request (it has `messages`) or a completion
    request (it has `prompt`)."""


class InvocationResponse(RootModel[ChatCompletionResponse | CompletionResponse]):
    """What /invocations answers: a chat completion or a completion, as its body asked."""


class LoadResponse(_Lenient):
    # Requests on the generating routes this gateway process has not finished answering.
    server_load: int


class WorkerInfo(_Lenient):
    address: str
    ready: bool
    models: list[str]
    max_model_len: int | None
    # Running and waiting requests, with a KV-cache term (the router's load); null before a report.
    load: float | None
    publishes_prefix_cache: bool


class ServerInfo(_Lenient):
    version: str
    vllm: str | list[str]
    routing: str
    shared_prefix_view: bool
    workers: list[WorkerInfo]


class ModelCard(_Lenient):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    # The base model a LoRA adapter adapts; null for a base model.
    parent: str | None
    max_model_len: int


class ModelList(_Lenient):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(_Lenient):
    version: str
    # The workers' vLLM version; a list where they differ (or none is ready).
    vllm: str | list[str]


class HealthStatus(_Lenient):
    status: Literal["ok", "unavailable"]


class MetricsTargetGroup(_Lenient):
    """Prometheus' HTTP service-discovery format: one group per worker."""

    targets: list[str]
    labels: dict[str, str]
