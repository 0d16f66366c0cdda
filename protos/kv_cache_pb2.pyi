from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WindowRef(_message.Message):
    __slots__ = ("window_id", "offset", "length")
    WINDOW_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    window_id: int
    offset: int
    length: int
    def __init__(self, window_id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class AttachWindowRequest(_message.Message):
    __slots__ = ("name", "size", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class AttachWindowResponse(_message.Message):
    __slots__ = ("window_id",)
    WINDOW_ID_FIELD_NUMBER: _ClassVar[int]
    window_id: int
    def __init__(self, window_id: _Optional[int] = ...) -> None: ...

class DetachWindowRequest(_message.Message):
    __slots__ = ("window_id",)
    WINDOW_ID_FIELD_NUMBER: _ClassVar[int]
    window_id: int
    def __init__(self, window_id: _Optional[int] = ...) -> None: ...

class DetachWindowResponse(_message.Message):
    __slots__ = ("detached",)
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    detached: bool
    def __init__(self, detached: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class BlockHeader(_message.Message):
    __slots__ = ("key", "parent_key", "size", "num_segments", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    size: int
    num_segments: int
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., size: _Optional[int] = ..., num_segments: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutBlocksChunk(_message.Message):
    __slots__ = ("start", "more", "windowed")
    START_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    WINDOWED_FIELD_NUMBER: _ClassVar[int]
    start: BlockStart
    more: bytes
    windowed: WindowedBlock
    def __init__(self, start: _Optional[_Union[BlockStart, _Mapping]] = ..., more: _Optional[bytes] = ..., windowed: _Optional[_Union[WindowedBlock, _Mapping]] = ...) -> None: ...

class BlockStart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WindowedBlock(_message.Message):
    __slots__ = ("header", "window")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    window: WindowRef
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., window: _Optional[_Union[WindowRef, _Mapping]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("num_stored", "num_already_held", "num_below_threshold", "num_no_room")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_ALREADY_HELD_FIELD_NUMBER: _ClassVar[int]
    NUM_BELOW_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NUM_NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_already_held: int
    num_below_threshold: int
    num_no_room: int
    def __init__(self, num_stored: _Optional[int] = ..., num_already_held: _Optional[int] = ..., num_below_threshold: _Optional[int] = ..., num_no_room: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("keys", "segment_major", "window")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_MAJOR_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    segment_major: bool
    window: WindowRef
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., segment_major: _Optional[bool] = ..., window: _Optional[_Union[WindowRef, _Mapping]] = ...) -> None: ...

class GetBlocksChunk(_message.Message):
    __slots__ = ("headers", "block_bytes", "segments_in_window")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_IN_WINDOW_FIELD_NUMBER: _ClassVar[int]
    headers: BlockHeaders
    block_bytes: BlockBytes
    segments_in_window: int
    def __init__(self, headers: _Optional[_Union[BlockHeaders, _Mapping]] = ..., block_bytes: _Optional[_Union[BlockBytes, _Mapping]] = ..., segments_in_window: _Optional[int] = ...) -> None: ...

class BlockHeaders(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHeader]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockHeader, _Mapping]]] = ...) -> None: ...

class BlockBytes(_message.Message):
    __slots__ = ("block_index", "offset", "data")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    offset: int
    data: bytes
    def __init__(self, block_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockHits(_message.Message):
    __slots__ = ("key", "hits")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    hits: int
    def __init__(self, key: _Optional[bytes] = ..., hits: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("bytes_used", "bytes_budget", "num_blocks", "lookups", "lookup_hit_blocks", "lookup_miss_blocks", "blocks_served", "blocks_stored", "blocks_below_threshold", "blocks_evicted", "bytes_stored", "bytes_served", "min_access_threshold", "hit_counts_enabled", "top_hits", "reads_in_progress", "bytes_stored_shm", "bytes_served_shm", "windows_attached", "incarnation")
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_BELOW_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    MIN_ACCESS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    HIT_COUNTS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    TOP_HITS_FIELD_NUMBER: _ClassVar[int]
    READS_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_SHM_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_SHM_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    bytes_used: int
    bytes_budget: int
    num_blocks: int
    lookups: int
    lookup_hit_blocks: int
    lookup_miss_blocks: int
    blocks_served: int
    blocks_stored: int
    blocks_below_threshold: int
    blocks_evicted: int
    bytes_stored: int
    bytes_served: int
    min_access_threshold: int
    hit_counts_enabled: bool
    top_hits: _containers.RepeatedCompositeFieldContainer[BlockHits]
    reads_in_progress: int
    bytes_stored_shm: int
    bytes_served_shm: int
    windows_attached: int
    incarnation: str
    def __init__(self, bytes_used: _Optional[int] = ..., bytes_budget: _Optional[int] = ..., num_blocks: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_hit_blocks: _Optional[int] = ..., lookup_miss_blocks: _Optional[int] = ..., blocks_served: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., blocks_below_threshold: _Optional[int] = ..., blocks_evicted: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., bytes_served: _Optional[int] = ..., min_access_threshold: _Optional[int] = ..., hit_counts_enabled: _Optional[bool] = ..., top_hits: _Optional[_Iterable[_Union[BlockHits, _Mapping]]] = ..., reads_in_progress: _Optional[int] = ..., bytes_stored_shm: _Optional[int] = ..., bytes_served_shm: _Optional[int] = ..., windows_attached: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...
