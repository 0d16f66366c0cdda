from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Record(_message.Message):
    __slots__ = ("prompt", "output", "id", "created_unix", "origin", "scope")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedScalarFieldContainer[int]
    output: _containers.RepeatedScalarFieldContainer[int]
    id: str
    created_unix: float
    origin: str
    scope: str
    def __init__(self, prompt: _Optional[_Iterable[int]] = ..., output: _Optional[_Iterable[int]] = ..., id: _Optional[str] = ..., created_unix: _Optional[float] = ..., origin: _Optional[str] = ..., scope: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("namespace", "records")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    records: _containers.RepeatedCompositeFieldContainer[Record]
    def __init__(self, namespace: _Optional[str] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("last_id",)
    LAST_ID_FIELD_NUMBER: _ClassVar[int]
    last_id: str
    def __init__(self, last_id: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("namespace", "after_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    after_id: str
    def __init__(self, namespace: _Optional[str] = ..., after_id: _Optional[str] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("records", "caught_up")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[Record]
    caught_up: bool
    def __init__(self, records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., caught_up: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class IndexStats(_message.Message):
    __slots__ = ("records", "tokens", "max_records", "redis_connected")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    records: int
    tokens: int
    max_records: int
    redis_connected: bool
    def __init__(self, records: _Optional[int] = ..., tokens: _Optional[int] = ..., max_records: _Optional[int] = ..., redis_connected: _Optional[bool] = ...) -> None: ...
