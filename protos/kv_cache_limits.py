"""The numbers and names of the KVBlockStore contract (kv_cache.proto) that both sides must agree on.

A .proto file cannot declare constants, so they live here, beside it: the worker's client
(engine_worker/core/kv_offload) and the cache service (cache_service) both import this module and never
each other. kv_cache.proto states the same values in words for other readers; change both together.
Plain values only: no gRPC, no import of either side.
"""

from __future__ import annotations

import re

# The most block bytes one PutBlocks or GetBlocks message carries (BlockStart.data, `more`,
# BlockBytes.data): large enough that per-message overhead is small next to the copy, small enough
# that a message never nears GRPC_MESSAGE_LIMIT. The service refuses a larger put chunk.
CHUNK_BYTES = 1024 * 1024

# The max send and receive message size of both the service's server and the worker's channel: room
# for a full chunk plus its header and framing, with margin, while gRPC itself refuses anything larger
# (RESOURCE_EXHAUSTED) before it reaches our code. Both ends must use the same limit: a smaller one on
# either side would refuse chunks the other side legitimately sends.
GRPC_MESSAGE_LIMIT = 4 * CHUNK_BYTES

# The cache service serves the lookahead index under the same limit. A Publish (the worker's batch of
# finished sequences) and a Subscribe response (the service's batch of records) each carry records up
# to this many bytes, half the limit: a batch past the limit would be refused, and the same batch would
# be sent again for ever.
LOOKAHEAD_BATCH_BYTES = GRPC_MESSAGE_LIMIT // 2

# Where windows live. The service opens only plain names directly in this directory, so that a name
# from a client can never reach a path outside it.
SHM_DIR = "/dev/shm"

# A window's file name is WINDOW_NAME_PREFIX, the creating process id, "-", and random hex digits:
# the prefix marks our files in a /dev/shm shared with other programs, the pid and the random part
# keep the workers on one host apart. WINDOW_NAME_PATTERN is what the service accepts: exactly that,
# so no "/" or ".." can appear. Make names with window_name(), which always fits the pattern.
WINDOW_NAME_PREFIX = "taco_llm-kv-"
WINDOW_NAME_PATTERN = re.compile(re.escape(WINDOW_NAME_PREFIX) + r"[0-9]{1,10}-[0-9a-f]{8,64}")

# A window's first NONCE_BYTES bytes hold the random nonce sent with AttachWindow: the service reading
# the same bytes from the file proves it sees the client's own file (the same host or IPC namespace).
# 16 random bytes: guessing is hopeless. It is also the smallest window the service attaches.
NONCE_BYTES = 16

# The largest window the service attaches (AttachWindowRequest.size): bounds what one client can make
# the service hold open; the worker's windows (a 256 MiB save ring, load windows up to 2 GiB) stay below.
MAX_WINDOW_BYTES = 4 * 1024**3


def window_name(pid: int, random_hex: str) -> str:
    """The /dev/shm file name of a window made by process `pid`; `random_hex`: 8 to 64 lowercase hex
    digits (secrets.token_hex(8) gives 16)."""
    name = f"{WINDOW_NAME_PREFIX}{pid}-{random_hex}"
    if not WINDOW_NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{name!r} does not fit the window name pattern {WINDOW_NAME_PATTERN.pattern}")
    return name
