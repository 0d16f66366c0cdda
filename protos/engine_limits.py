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
