"""What the engine's prefix cache holds, as its KV cache events tell it, in the gateways' names.

vLLM reports every block it caches (BlockStored: the block's hash, its parent's, its tokens) and every
block it evicts (BlockRemoved), and AllBlocksCleared when it drops them all. Gateways, which do not
tokenize, name a prompt's prefix by chained digests of its text in fixed chunks (engine.proto
PrefixChunks). Two pure structures join the two:

- HeldBlocks: the cached blocks, each by its hash and by what identifies it in a prompt (its parent's
  hash and its tokens), so that a prompt's cached leading blocks are found by walking its token ids.
  Invariant: the two maps are each other's inverse. (A block found by its tokens whose removal was not
  applied would keep a prompt's chunks published after the engine dropped them.)
- HeldChunks: which blocks hold up which chunk digests. Chunk i of a prompt is held while the block
  that ends its share of the prompt's tokens is (chunk_blocks says which one); a digest is published
  while at least one block holds it up. Invariant: `_blocks_of` and `_digests_of` are each other's
  inverse, and no entry of either is empty: a digest is in `_blocks_of` exactly while it is held.

Blocks are keyed by parent and tokens alone, not by the extra keys vLLM mixes in (the LoRA adapter, a
cache_salt): two tenants' blocks of the same tokens then share a key, and one's eviction may hide the
other's digests, or one's may be published a little longer. That only ever steers routing; the engine
decides what is really reused.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Hashable, Iterator, Sequence

from taco_llm.protos import engine_pb2
from taco_llm.protos.prefix_view import DIGEST_BYTES, MAX_CHUNKS_PER_PROMPT, unpack_digests

BlockHash = Hashable
# A block's parent and a 16-byte digest of its tokens (little-endian uint32s): a block of 128 tokens
# costs 16 bytes here, not a tuple of 128 ints.
_BlockKey = tuple[BlockHash | None, bytes]


# The array type code of 4-byte unsigned integers here ("I" on every platform vLLM runs on).
_UINT32 = next(code for code in ("I", "L") if array(code).itemsize == 4)


def _tokens_digest(token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array(_UINT32, token_ids).tobytes(), digest_size=16).digest()


class HeldBlocks:
    """The engine's cached blocks (see the module's invariant)."""

    def __init__(self) -> None:
        self._by_key: dict[_BlockKey, BlockHash] = {}
        self._key_of: dict[BlockHash, _BlockKey] = {}
        self.block_size = 0  # learnt from the first event that stores a block

    def __len__(self) -> int:
        return len(self._key_of)

    def stored(self, hashes: Sequence[BlockHash], parent: BlockHash | None, token_ids: Sequence[int],
               block_size: int) -> None:
        """Consecutive blocks of one prompt, the first a child of `parent`, `block_size` tokens each."""
        if block_size <= 0 or len(token_ids) != len(hashes) * block_size:
            return  # not whole blocks of one size: vLLM never caches those
        self.block_size = self.block_size or block_size
        if block_size != self.block_size:
            return  # another KV cache group's blocks: prompts are walked in the first group's
        for i, block in enumerate(hashes):
            key = (parent, _tokens_digest(token_ids[i * block_size:(i + 1) * block_size]))
            old = self._by_key.get(key)
            if old is not None and old != block:
                self._key_of.pop(old, None)
            previous_key = self._key_of.get(block)
            if previous_key is not None and previous_key != key:
                self._by_key.pop(previous_key, None)
            self._by_key[key] = block
            self._key_of[block] = key
            parent = block

    def removed(self, block: BlockHash) -> None:
        key = self._key_of.pop(block, None)
        if key is not None and self._by_key.get(key) == block:
            del self._by_key[key]

    def clear(self) -> None:
        self._by_key.clear()
        self._key_of.clear()

    def leading(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The cached blocks a prompt of these tokens begins with, in order, up to the first not cached."""
        size = self.block_size
        found: list[BlockHash] = []
        if not size:
            return found
        parent: BlockHash | None = None
        for start in range(0, len(token_ids) - size + 1, size):
            block = self._by_key.get((parent, _tokens_digest(token_ids[start:start + size])))
            if block is None:
                break
            found.append(block)
            parent = block
        return found


def chunk_blocks(chunks: engine_pb2.PrefixChunks, prompt_tokens: int, block_size: int) -> Iterator[tuple[bytes, int]]:
    """(digest, n) for each chunk: the chunk is held while the prompt's first n blocks are. Its share of
    the tokens is its share of the text, rounded up. A chunk that ends in the prompt's last, partial
    block is held with the whole blocks before it: vLLM caches whole blocks only, so no worker can hold
    more of that prompt, and a worker that holds all it can must match it whole (as the approximate
    indexes of workers that publish nothing do). A prompt shorter than a block holds nothing anywhere."""
    if not chunks.digests or chunks.text_chars == 0 or chunks.chunk_chars == 0 or block_size <= 0:
        return
    try:
        digests = unpack_digests(chunks.digests)
    except ValueError:
        return
    whole_blocks = prompt_tokens // block_size
    if whole_blocks == 0:
        return
    for i, digest in enumerate(digests[:MAX_CHUNKS_PER_PROMPT]):
        end_chars = min((i + 1) * chunks.chunk_chars, chunks.text_chars)
        tokens = math.ceil(prompt_tokens * end_chars / chunks.text_chars)
        yield digest, min(max(1, math.ceil(tokens / block_size)), whole_blocks)


class HeldChunks:
    """Which cached blocks hold up which chunk digests (see the module's invariant)."""

    def __init__(self) -> None:
        self._blocks_of: dict[bytes, set[BlockHash]] = {}
        self._digests_of: dict[BlockHash, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._blocks_of)

    def digests(self) -> set[bytes]:
        return set(self._blocks_of)

    def attach(self, digest: bytes, block: BlockHash) -> bool:
        """`block` holds up `digest`; True when the digest was not held before."""
        if len(digest) != DIGEST_BYTES:
            return False
        blocks = self._blocks_of.get(digest)
        newly = blocks is None
        if blocks is None:
            blocks = self._blocks_of[digest] = set()
        blocks.add(block)
        self._digests_of.setdefault(block, set()).add(digest)
        return newly

    def detach(self, block: BlockHash) -> list[bytes]:
        """The block is gone: the digests it alone held up, now no longer held."""
        lost = []
        for digest in self._digests_of.pop(block, ()):
            blocks = self._blocks_of[digest]
            blocks.discard(block)
            if not blocks:
                del self._blocks_of[digest]
                lost.append(digest)
        return lost

    def clear(self) -> None:
        self._blocks_of.clear()
        self._digests_of.clear()


def prefix_chunks_problem(chunks: engine_pb2.PrefixChunks) -> tuple[str, str] | None:
    """(field, why) where a request's PrefixChunks cannot be used; None where it can."""
    if len(chunks.digests) % DIGEST_BYTES:
        return ("prefix_chunks.digests",
                f"{len(chunks.digests)} bytes is not a whole number of {DIGEST_BYTES}-byte digests")
    if len(chunks.digests) > MAX_CHUNKS_PER_PROMPT * DIGEST_BYTES:
        return "prefix_chunks.digests", f"more than {MAX_CHUNKS_PER_PROMPT} digests"
    for name in ("chunk_chars", "text_chars"):
        if chunks.digests and getattr(chunks, name) == 0:
            return f"prefix_chunks.{name}", "must be positive where digests are given"
    return None
