"""The numbers of the Engine contract (engine.proto) that the gateway, the worker and any gRPC client
must agree on. A .proto file cannot declare constants, so they live here, beside it; plain values only.
"""

from __future__ import annotations

from taco_llm.protos import engine_pb2

# The max send and receive message size of the worker's server and of every client channel. A request
# carries at most a context of token ids or text (a few MiB at the longest contexts) and a response one
# engine step's deltas, so 64 MiB leaves room to spare; both ends must use the same limit, since a
# smaller one on either side would refuse messages the other legitimately sends.
GRPC_MESSAGE_LIMIT = 64 * 1024 * 1024

# The name the worker's health service reports the Engine under (clients check it before routing).
ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name

# The chat roles the worker takes (OpenAI's), in the order the gateway's OpenAPI schema lists them. Chat
# templates may know more, but a role OpenAI refuses is refused here too (ChatMessage.role stays a string:
# see engine.proto).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Keepalive between gateways and workers. A worker cut off by the network (a partition: no connection is
# refused, packets just stop) is found by the gateway's HTTP/2 pings: one goes out after KEEPALIVE_TIME_MS
# without traffic, and a ping unanswered for KEEPALIVE_TIMEOUT_MS closes the connection, failing its
# streams with UNAVAILABLE, which the gateway then migrates. A partition is therefore noticed within
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS (5 s) even while every stream on the connection waits on a
# long prefill. The worker must accept pings that often, even between calls, or it answers with GOAWAY
# ("too_many_pings") and drops healthy connections.
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 3_000

# Client-side channel arguments for the pings above (gateway -> worker, worker -> cache service).
KEEPALIVE_CLIENT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC keeps one ping in flight: when a connection dies with another ping out (flow control's BDP
    # ping, sent as data arrives), no keepalive ping goes until that one times out, after a minute by
    # default. Any ping unanswered this long ends the connection.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
# Server-side: accept those pings (half the interval leaves room for timer jitter), never count them as
# abuse.
KEEPALIVE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)
