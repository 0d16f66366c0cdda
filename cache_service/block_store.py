"""The prefix-KV block store: content-addressed blocks in host memory under a byte budget.

Pure data structure, no gRPC: the servicer in kv_servicer.py validates input and calls it from one
asyncio event loop, so it needs no locks.

Eviction is least-recently-used, ordered so that a chain's tail goes before its head: whenever a
block is used its ancestors are marked used after it, and only a block no held block names as its
parent is ever evicted. (A head evicted before its tail would leave the tail unreachable: Lookup
stops at the first miss.) A block being read is never evicted.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

KEY_BYTES = 32  # SHA-256
# What a block costs beyond its bytes (key, header, dictionary entry), counted against the budget so
# that a flood of tiny blocks cannot exceed it either.
BLOCK_OVERHEAD_BYTES = 256
# With --apc-offload-enable-hit-cnt, the victim is the least-hit of this many least-recent blocks.
HIT_COUNT_WINDOW = 8


@dataclass
class Block:
    key: bytes
    parent_key: bytes
    data: bytes
    num_segments: int
    checksum: int
    readers: int = 0  # GetBlocks calls streaming it now: never evicted while > 0
    hits: int = 0     # times served

    @property
    def cost(self) -> int:
        return len(self.data) + BLOCK_OVERHEAD_BYTES


class PutOutcome(enum.Enum):
    STORED = "stored"
    ALREADY_HELD = "already_held"
    BELOW_THRESHOLD = "below_threshold"
    NO_ROOM = "no_room"


@dataclass
class StoreCounters:
    lookups: int = 0
    lookup_hit_blocks: int = 0
    lookup_miss_blocks: int = 0
    blocks_served: int = 0
    bytes_served: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0
    blocks_below_threshold: int = 0
    blocks_evicted: int = 0
    reads_in_progress: int = 0


@dataclass
class BlockStore:
    budget_bytes: int
    min_access_threshold: int = 1
    count_hits: bool = False
    # Use counts are kept for at most this many keys (the least recently seen are forgotten first).
    max_tracked_uses: int = 200_000
    counters: StoreCounters = field(default_factory=StoreCounters)

    def __post_init__(self) -> None:
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._uses: OrderedDict[bytes, int] = OrderedDict()
        # Held blocks per parent key: only a block with none (a chain's tail) may be evicted.
        self._children: dict[bytes, int] = {}
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def lru_order(self) -> list[bytes]:
        """Keys from the next to evict to the last (for tests and debugging)."""
        return list(self._blocks)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are held. Counts one use of each key; marks the held ones used."""
        self.counters.lookups += 1
        if self.min_access_threshold > 1:
            for key in keys:
                self._uses[key] = self._uses.pop(key, 0) + 1
            while len(self._uses) > self.max_tracked_uses:
                self._uses.popitem(last=False)
        held = 0
        for key in keys:
            if key not in self._blocks:
                break
            held += 1
        self.counters.lookup_hit_blocks += held
        if held < len(keys):
            self.counters.lookup_miss_blocks += 1
        if held:
            self._touch(keys[:held])
        return held

    def put(self, key: bytes, parent_key: bytes, data: bytes, num_segments: int, checksum: int) -> PutOutcome:
        """Stores a block whose input the caller has checked (sizes, checksum, budget)."""
        if key in self._blocks:
            self._touch([key])
            return PutOutcome.ALREADY_HELD
        if self.min_access_threshold > 1 and self._uses.get(key, 0) < self.min_access_threshold:
            self.counters.blocks_below_threshold += 1
            return PutOutcome.BELOW_THRESHOLD
        block = Block(key, parent_key, data, num_segments, checksum)
        if not self._make_room(block.cost):
            return PutOutcome.NO_ROOM
        self._blocks[key] = block
        if parent_key:
            self._children[parent_key] = self._children.get(parent_key, 0) + 1
        self.bytes_used += block.cost
        self.counters.blocks_stored += 1
        self.counters.bytes_stored += len(data)
        self._touch([key])
        return PutOutcome.STORED

    def acquire(self, keys: Sequence[bytes]) -> list[Block]:
        """Pins the blocks for reading (they stay until release). KeyError(index) if one is not held."""
        blocks = []
        for index, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None:
                raise KeyError(index)
            blocks.append(block)
        for block in blocks:
            block.readers += 1
        self.counters.reads_in_progress += 1
        self._touch(list(keys))
        return blocks

    def release(self, blocks: Sequence[Block], served: bool) -> None:
        self.counters.reads_in_progress -= 1
        for block in blocks:
            block.readers -= 1
            if served:
                block.hits += 1
                self.counters.blocks_served += 1
                self.counters.bytes_served += len(block.data)

    def top_hits(self, count: int) -> list[tuple[bytes, int]]:
        ranked = sorted(self._blocks.values(), key=lambda b: b.hits, reverse=True)
        return [(b.key, b.hits) for b in ranked[:count] if b.hits > 0]

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Marks keys used, tail first, then their ancestors up to the chain's head, most recent last."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)
        seen = set(keys)
        parent = self._blocks[keys[0]].parent_key if keys[0] in self._blocks else b""
        while parent and parent in self._blocks and parent not in seen:
            seen.add(parent)
            self._blocks.move_to_end(parent)
            parent = self._blocks[parent].parent_key

    def _make_room(self, cost: int) -> bool:
        if cost > self.budget_bytes:
            return False
        while self.bytes_used + cost > self.budget_bytes:
            victim = self._victim()
            if victim is None:
                return False
            block = self._blocks.pop(victim)
            if block.parent_key:
                left = self._children.pop(block.parent_key) - 1
                if left:
                    self._children[block.parent_key] = left
            self.bytes_used -= block.cost
            self.counters.blocks_evicted += 1
        return True

    def _victim(self) -> bytes | None:
        candidates: list[Block] = []
        for block in self._blocks.values():
            if block.readers == 0 and block.key not in self._children:
                candidates.append(block)
                if not self.count_hits or len(candidates) == HIT_COUNT_WINDOW:
                    break
        if not candidates:
            return None
        # min() keeps the first of equals: the least recent among the least hit.
        return min(candidates, key=lambda b: b.hits).key
