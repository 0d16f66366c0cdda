"""The shared prefix view's names and byte layouts (engine.proto PrefixChunks, registry.proto
WorkerRecord.publishes_prefix_cache), which workers write and gateways read in the registry's Redis.

A .proto file cannot declare constants, so they live here, beside it: plain values only.

In Redis, per publishing worker:
- a set, PREFIX_SET_KEY_PREFIX + worker_id, of the DIGEST_BYTES-byte chunk digests its KV cache holds
  now (the snapshot a gateway starts from), expiring with the worker's registry TTL unless refreshed;
- its changes, appended to the one stream PREFIX_EVENTS_STREAM (the deltas every gateway follows), each
  entry with the fields:
    EVENT_WORKER: the worker_id;
    EVENT_KIND: one of ADDED, REMOVED (digests the cache took in or lost) or RESET (the set is
      now exactly the digests given: after the worker could not write for a while, or at its start
      and its drain, when it is empty);
    EVENT_DIGESTS: the digests, DIGEST_BYTES each, concatenated.
"""

from __future__ import annotations

DIGEST_BYTES = 8
# The most chunks a prompt is named by (256 Ki characters of 64): bounds a gateway's hashing and a
# worker's bookkeeping per request. A request that sends more is refused (INVALID_ARGUMENT).
MAX_CHUNKS_PER_PROMPT = 4_096
PREFIX_SET_KEY_PREFIX = "taco_llm:prefix:"
PREFIX_EVENTS_STREAM = "taco_llm:prefix-events"
# Entries the stream keeps (trimmed approximately): far more than a gateway falls behind between two
# reads; one that does, or reconnects, starts again from the sets.
PREFIX_EVENTS_KEPT = 100_000

EVENT_WORKER = b"w"
EVENT_KIND = b"k"
EVENT_DIGESTS = b"d"
ADDED = b"+"
REMOVED = b"-"
RESET = b"="


def pack_digests(digests: list[bytes] | tuple[bytes, ...] | set[bytes]) -> bytes:
    """The digests concatenated; each must be DIGEST_BYTES long."""
    return b"".join(digests)


def unpack_digests(data: bytes) -> list[bytes]:
    """The digests of a concatenation; raises ValueError where its length is not a multiple of theirs."""
    if len(data) % DIGEST_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of {DIGEST_BYTES}-byte digests")
    return [data[i:i + DIGEST_BYTES] for i in range(0, len(data), DIGEST_BYTES)]
