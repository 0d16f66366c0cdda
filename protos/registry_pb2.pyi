from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRecord(_message.Message):
    __slots__ = ("worker_id", "address", "served_model_names", "started_unix_ms", "heartbeat_unix_ms", "instance", "ttl_ms", "publishes_prefix_cache")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    started_unix_ms: int
    heartbeat_unix_ms: int
    instance: str
    ttl_ms: int
    publishes_prefix_cache: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., started_unix_ms: _Optional[int] = ..., heartbeat_unix_ms: _Optional[int] = ..., instance: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., publishes_prefix_cache: _Optional[bool] = ...) -> None: ...
