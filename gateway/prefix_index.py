"""An approximate index of the prompt prefixes each worker has been sent, for cache-aware routing.

The gateway does not tokenize, so a prompt's text is cut into fixed chunks of CHUNK_CHARS characters
(about one 16-token KV block of English text) and each chunk is hashed together with the hash before it:
chunk i's hash names the whole prefix up to it, as a KV block's hash does in vLLM. The chain is seeded
with the tenant (the model name as asked, a LoRA adapter being its own name, and the request's
cache_salt), so two tenants' identical prompts never look warm for each other: their KV caches are
distinct in the engine too. Only whole chunks are hashed, as only whole blocks are cached.

It is approximate on purpose: it records what was sent, not what the engine still holds (an engine
evicts blocks the index still lists), so it only steers load; it never decides correctness.

With workers that publish their prefix cache (prefix_view.py), what they hold replaces these guesses,
but for what this gateway sent in the last RECENT_SECONDS, which a worker may not have published yet:
RecentPrefixes keeps those.

PrefixIndex is a pure structure; its invariant: it holds at most `capacity` hashes, ordered from least
to most recently used, and whenever a chain is inserted its head is marked used after its tail, so
eviction takes a chain's tail before its head. (A head evicted first would make the whole chain miss:
matching stops at the first missing chunk.)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Container, Sequence

from taco_llm.protos.prefix_view import DIGEST_BYTES, MAX_CHUNKS_PER_PROMPT

CHUNK_CHARS = 64
# Hashes kept per index: 64Ki chunks = 4 MiB of prompt text per worker, about 6 MiB of memory.
DEFAULT_CAPACITY = 65_536
# How long a prompt this gateway sent counts as held before the worker publishes it: far longer than a
# prefill and a publication take, short enough that an eviction the worker published soon wins.
RECENT_SECONDS = 10.0


def leading_held(hashes: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of the leading hashes `held` has, up to the first it lacks: a chain matches only as far
    as it is unbroken, as a prefix cache's lookup does."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


def chunk_hashes(tenant: str, text: str, *, chunk_chars: int = CHUNK_CHARS,
                 max_chunks: int = MAX_CHUNKS_PER_PROMPT) -> list[bytes]:
    """The chained hashes of the text's whole chunks, seeded with the tenant."""
    previous = hashlib.blake2b(tenant.encode(), digest_size=DIGEST_BYTES, person=b"taco-tenant").digest()
    hashes = []
    count = min(len(text) // chunk_chars, max_chunks)
    for i in range(count):
        chunk = text[i * chunk_chars:(i + 1) * chunk_chars]
        previous = hashlib.blake2b(previous + chunk.encode("utf-8", "surrogatepass"),
                                   digest_size=DIGEST_BYTES).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """The chunk hashes one worker (or one cache service) was sent, least-recently-used first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a prefix index needs room for at least one chunk")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading hashes the index holds, up to the first it does not."""
        return leading_held(hashes, self._hashes)

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Records a prompt's chain as sent, head marked most recent (see the module's invariant)."""
        for h in reversed(hashes[: self.capacity]):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


class RecentPrefixes:
    """The chunk hashes sent to one worker in the last `horizon` seconds, oldest first.

    Invariant: `_sent` is ordered by the time each hash was last sent, so that the expired are all at its
    front and dropping them costs no more than their number."""

    def __init__(self, horizon: float = RECENT_SECONDS, capacity: int = DEFAULT_CAPACITY) -> None:
        self.horizon = horizon
        self.capacity = capacity
        self._sent: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sent)

    def insert(self, hashes: Sequence[bytes], now: float) -> None:
        for h in hashes[: self.capacity]:
            self._sent[h] = now
            self._sent.move_to_end(h)
        self._expire(now)

    def match(self, hashes: Sequence[bytes], now: float) -> int:
        """How many of the leading hashes were sent within the horizon, up to the first that was not."""
        self._expire(now)
        return leading_held(hashes, self._sent)

    def _expire(self, now: float) -> None:
        while self._sent and (len(self._sent) > self.capacity
                              or next(iter(self._sent.values())) < now - self.horizon):
            self._sent.popitem(last=False)
