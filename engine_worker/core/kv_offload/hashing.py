"""Content addresses of prefix-KV blocks: SHA-256 chains over token ids, salted with the KV's shape.

Stable across processes and machines (hashlib over explicit little-endian bytes; never Python's
hash(), which PYTHONHASHSEED changes), so a block one worker computed is found by another, or by the
same worker after a restart, exactly when its KV would be bit-compatible.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from typing import Any

SALT_VERSION = 1  # bump when the block byte layout changes


def engine_salt(factors: dict[str, Any]) -> bytes:
    """One digest over everything that makes KV incompatible between engines (model, dtypes, KV
    layout and shape, block size, parallelism). `factors` must be JSON-serializable."""
    text = json.dumps({"version": SALT_VERSION, **factors}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def request_salt(engine: bytes, lora_name: str | None, cache_salt: str | None) -> bytes:
    """The chain's seed for one request: requests with other LoRAs or cache salts never share blocks."""
    digest = hashlib.sha256(engine)
    for part in (lora_name, cache_salt):
        encoded = b"" if part is None else part.encode()
        # Length-prefixed, so ("ab", None) and ("a", "b") differ; a None differs from "".
        digest.update((len(encoded) if part is not None else 0xFFFFFFFF).to_bytes(4, "little") + encoded)
    return digest.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("q", tokens)  # int64: token ids never overflow it
    if packed.itemsize != 8:
        raise RuntimeError("array('q') is not 8 bytes here")
    if array("q", [1]).tobytes()[0] != 1:
        packed.byteswap()  # keep the bytes little-endian on big-endian hosts
    return packed.tobytes()


def chain_keys(seed: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The key of every full block: key[i] = sha256(key[i-1] or seed, tokens of block i)."""
    keys: list[bytes] = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + _token_bytes(token_ids[start:start + block_size])).digest()
        keys.append(parent)
    return keys


def rank_key(key: bytes, tp_rank: int) -> bytes:
    """Each tensor-parallel rank stores its own shard of a block under its own key (rank 0: the key)."""
    return key if tp_rank == 0 else hashlib.sha256(key + b"tp-rank" + tp_rank.to_bytes(4, "little")).digest()
