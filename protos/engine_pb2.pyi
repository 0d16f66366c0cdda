from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_REPETITION: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_REPETITION: FinishReason

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("loaded",)
    LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: bool
    def __init__(self, loaded: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("type", "text")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    type: str
    text: str
    def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "type", "function_name", "function_arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function_name: str
    function_arguments: str
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function_name: _Optional[str] = ..., function_arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "content_parts", "name", "tool_call_id", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_PARTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    content_parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    name: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., content_parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str
    chat_template_kwargs: _struct_pb2.Struct
    tools: _struct_pb2.ListValue
    tool_choice: _struct_pb2.Value
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template: _Optional[str] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., tools: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., tool_choice: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "backend")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    json_schema: _struct_pb2.Struct
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    backend: str
    def __init__(self, json_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "stop_token_ids", "include_stop_str_in_output", "seed", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    seed: int
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    prompt_logprobs: int
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "chat", "sampling", "add_special_tokens", "cache_salt", "priority", "resume", "prefix_chunks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    chat: ChatInput
    sampling: SamplingParams
    add_special_tokens: bool
    cache_salt: str
    priority: int
    resume: Resume
    prefix_chunks: PrefixChunks
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., prefix_chunks: _Optional[_Union[PrefixChunks, _Mapping]] = ...) -> None: ...

class PrefixChunks(_message.Message):
    __slots__ = ("digests", "chunk_chars", "text_chars")
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHARS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    digests: bytes
    chunk_chars: int
    text_chars: int
    def __init__(self, digests: _Optional[bytes] = ..., chunk_chars: _Optional[int] = ..., text_chars: _Optional[int] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("output_token_ids",)
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class RankedLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class PromptTokenLogprobs(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[RankedLogprob]
    def __init__(self, candidates: _Optional[_Iterable[_Union[RankedLogprob, _Mapping]]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "type", "function_name", "function_arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    type: str
    function_name: str
    function_arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., type: _Optional[str] = ..., function_name: _Optional[str] = ..., function_arguments: _Optional[str] = ...) -> None: ...

class ParsedChoice(_message.Message):
    __slots__ = ("content", "tool_calls", "finish_reason")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    finish_reason: FinishReason
    def __init__(self, content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class ParsedDelta(_message.Message):
    __slots__ = ("raw_text", "content", "tool_calls", "whole")
    RAW_TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    raw_text: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    whole: ParsedChoice
    def __init__(self, raw_text: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., whole: _Optional[_Union[ParsedChoice, _Mapping]] = ...) -> None: ...

class ChoiceDelta(_message.Message):
    __slots__ = ("index", "text", "parsed", "token_ids", "logprobs", "finish_reason", "stop_string", "stop_token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PARSED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    parsed: ParsedDelta
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., parsed: _Optional[_Union[ParsedDelta, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_logprobs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprobs]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprobs, _Mapping]]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceDelta]
    def __init__(self, choices: _Optional[_Iterable[_Union[ChoiceDelta, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "started", "delta", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    started: Started
    delta: Delta
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., started: _Optional[_Union[Started, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "base_model_name", "loaded_at_runtime")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    base_model_name: str
    loaded_at_runtime: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., base_model_name: _Optional[str] = ..., loaded_at_runtime: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("served_model_names", "model_path", "tokenizer", "max_model_len", "vocab_size", "eos_token_ids", "bos_token_id", "dtype", "has_chat_template", "max_logprobs", "engine_version", "worker_version", "created", "lora_adapters", "tool_call_parser", "prefix_cache_service", "metrics_port")
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SERVICE_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    model_path: str
    tokenizer: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    dtype: str
    has_chat_template: bool
    max_logprobs: int
    engine_version: str
    worker_version: str
    created: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    tool_call_parser: str
    prefix_cache_service: str
    metrics_port: int
    def __init__(self, served_model_names: _Optional[_Iterable[str]] = ..., model_path: _Optional[str] = ..., tokenizer: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., dtype: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., max_logprobs: _Optional[int] = ..., engine_version: _Optional[str] = ..., worker_version: _Optional[str] = ..., created: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., tool_call_parser: _Optional[str] = ..., prefix_cache_service: _Optional[str] = ..., metrics_port: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "kv_cache_usage", "num_active_streams", "prefix_cache_incarnation", "engine_stalled_ms")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STALLED_MS_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_active_streams: int
    prefix_cache_incarnation: str
    engine_stalled_ms: int
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_active_streams: _Optional[int] = ..., prefix_cache_incarnation: _Optional[str] = ..., engine_stalled_ms: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "add_special_tokens", "return_token_strs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: ChatInput
    add_special_tokens: bool
    return_token_strs: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "token_strs", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strs: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
