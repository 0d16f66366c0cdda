from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    FIELD_INVALID: _ClassVar[ErrorReason]
    FIELD_REQUIRED: _ClassVar[ErrorReason]
    API_KEY_INVALID: _ClassVar[ErrorReason]
    MODEL_NOT_FOUND: _ClassVar[ErrorReason]
    PROMPT_TOO_LONG: _ClassVar[ErrorReason]
    REQUEST_ID_IN_USE: _ClassVar[ErrorReason]
    TOKEN_OUT_OF_VOCABULARY: _ClassVar[ErrorReason]
    LORA_LOAD_FAILED: _ClassVar[ErrorReason]
    CHAT_TEMPLATE_NOT_TRUSTED: _ClassVar[ErrorReason]
    TOOL_CHOICE_UNSUPPORTED: _ClassVar[ErrorReason]
    STRUCTURED_OUTPUT_BACKEND_FIXED: _ClassVar[ErrorReason]
    RUNTIME_LORA_OFF: _ClassVar[ErrorReason]
    ENGINE_DEAD: _ClassVar[ErrorReason]
    WORKER_DRAINING: _ClassVar[ErrorReason]
    WINDOW_NOT_FOUND: _ClassVar[ErrorReason]
    WINDOW_UNREACHABLE: _ClassVar[ErrorReason]
    WINDOW_IO_FAILED: _ClassVar[ErrorReason]
    BLOCK_NOT_FOUND: _ClassVar[ErrorReason]
    CHECKSUM_MISMATCH: _ClassVar[ErrorReason]
    BLOCK_TOO_LARGE: _ClassVar[ErrorReason]
    INDEX_UNAVAILABLE: _ClassVar[ErrorReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
FIELD_INVALID: ErrorReason
FIELD_REQUIRED: ErrorReason
API_KEY_INVALID: ErrorReason
MODEL_NOT_FOUND: ErrorReason
PROMPT_TOO_LONG: ErrorReason
REQUEST_ID_IN_USE: ErrorReason
TOKEN_OUT_OF_VOCABULARY: ErrorReason
LORA_LOAD_FAILED: ErrorReason
CHAT_TEMPLATE_NOT_TRUSTED: ErrorReason
TOOL_CHOICE_UNSUPPORTED: ErrorReason
STRUCTURED_OUTPUT_BACKEND_FIXED: ErrorReason
RUNTIME_LORA_OFF: ErrorReason
ENGINE_DEAD: ErrorReason
WORKER_DRAINING: ErrorReason
WINDOW_NOT_FOUND: ErrorReason
WINDOW_UNREACHABLE: ErrorReason
WINDOW_IO_FAILED: ErrorReason
BLOCK_NOT_FOUND: ErrorReason
CHECKSUM_MISMATCH: ErrorReason
BLOCK_TOO_LARGE: ErrorReason
INDEX_UNAVAILABLE: ErrorReason
