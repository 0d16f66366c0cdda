"""How the gateway chooses a worker among those eligible for a request (--routing).

The pool (engine_pool.py) decides who is eligible: ready, serving the model, its breaker letting
requests through, not already tried by this request. A policy only orders the eligible:

- round_robin: each in turn, by address, so a change of membership does not reset the turn.
- least_load: the lowest load, as RoutingTarget.load defines it (the worker's running and waiting
  requests from GetLoad, the streams this gateway started since, and a KV-cache term); ties at random.
- cache_aware: load minus a credit for the share of the prompt's leading chunks the worker is believed
  to hold (prefix_index.py, one per member: a registered worker's process, an --engine worker's
  address), unless the fleet is imbalanced, when load alone decides (SGLang's rule:
  max - min > the absolute threshold and max > the relative threshold x min). Workers that offload to
  the same cache service (ModelInfo.prefix_cache_service) share one more index: a prefix any of them was
  sent is warm on all of them, at --cache-aware-offload-discount of a local hit, since the worker
  fetches those blocks from host memory instead of recomputing them. The pool has a worker's index
  forgotten when it leaves or restarts, and a service's when it restarts empty (engine_pool.py).
  A worker that publishes its prefix cache (prefix_view.py) is matched on what it published, which
  every gateway replica reads alike, and on what this gateway sent it in the last few seconds, which it
  may not have published yet; the approximate index is for the workers that publish nothing, and for
  while the shared view cannot be read.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

from .metrics import PREFIX_HIT_CHUNKS, PREFIX_LOOKUP_CHUNKS, PREFIX_VIEW_LOOKUPS
from .prefix_index import DEFAULT_CAPACITY, PrefixIndex, RecentPrefixes, chunk_hashes
from .prefix_view import SharedPrefixView

if TYPE_CHECKING:
    from .engine_pool import EngineClient

POLICIES = ("cache_aware", "least_load", "round_robin")

# What a whole prompt found warm on a worker is worth, in requests of load: a worker holding the whole
# prefix wins over one this many requests less busy. Past that, the balance rule usually takes over.
PREFIX_CREDIT_REQUESTS = 8.0
# Loads this close are a tie, broken at random (so equal workers share a burst).
_TIE = 1e-9


@dataclass(frozen=True, kw_only=True)
class RouteKey:
    """What routing needs to know of a request."""

    model: str | None          # the model name as asked; None or "" = the default model
    prefix_text: str = ""      # what cache_aware matches: the prompt text, or the chat messages joined
    cache_salt: str = ""


@dataclass(frozen=True)
class Route:
    client: EngineClient
    policy: str                # "round_robin" | "least_load" | "cache_aware"
    reason: str
    prefix_match: float        # 0..1 on the chosen worker (0 when not cache_aware)
    # The prompt's chunk digests as matched (cache_aware only), sent to a worker that publishes its cache.
    prefix_hashes: tuple[bytes, ...] = ()


class RoutingTarget(Protocol):
    """What a policy reads of a worker (EngineClient has these; tests use plain fakes)."""

    @property
    def address(self) -> str: ...

    @property
    def member_id(self) -> str: ...  # who it is: its cache affinity is kept under this name

    @property
    def load(self) -> float: ...

    @property
    def cache_group(self) -> str: ...  # the shared cache service's address, "" for none

    @property
    def prefix_view_id(self) -> str: ...  # the worker_id it publishes its prefix cache under; "" for none


T = TypeVar("T", bound=RoutingTarget)


@dataclass(frozen=True)
class Choice(Generic[T]):
    target: T
    reason: str
    prefix_match: float = 0.0
    prefix_hashes: tuple[bytes, ...] = ()


def tenant_of(model: str, cache_salt: str) -> str:
    """The seed of a prompt's chunk chain: affinity never crosses models, adapters or salts."""
    return f"{model}\x00{cache_salt}"


class Policy(abc.ABC):
    name: ClassVar[str]

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    @abc.abstractmethod
    def choose(self, candidates: Sequence[T], *, model: str, key: RouteKey) -> Choice[T]:
        """One of `candidates` (never empty); `model` is the name routed on, the default resolved."""

    def forget(self, member_id: str) -> None:
        """The worker left, or restarted with a cold cache: only cache_aware remembers workers."""
        del member_id

    def forget_cache_group(self, service: str) -> None:
        """The shared cache service restarted, empty: only cache_aware remembers what it held."""
        del service

    def prefilled(self, member_id: str, hashes: Sequence[bytes]) -> None:
        """The worker has prefilled a prompt routed to it: only cache_aware notes it."""
        del member_id, hashes

    def least_loaded(self, candidates: Sequence[RoutingTarget]) -> int:
        """The index of the least-loaded candidate, ties broken at random."""
        loads = [c.load for c in candidates]
        least = min(loads)
        return self.rng.choice([i for i, load in enumerate(loads) if load <= least + _TIE])


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._last = ""

    def choose(self, candidates: Sequence[T], *, model: str, key: RouteKey) -> Choice[T]:
        ordered = sorted(candidates, key=lambda c: c.address)
        chosen = next((c for c in ordered if c.address > self._last), ordered[0])
        self._last = chosen.address
        return Choice(chosen, "round_robin")


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, candidates: Sequence[T], *, model: str, key: RouteKey) -> Choice[T]:
        if len(candidates) == 1:
            return Choice(candidates[0], "only_candidate")
        return Choice(candidates[self.least_loaded(candidates)], "least_load")


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, *, balance_abs_threshold: float, balance_rel_threshold: float, offload_discount: float,
                 capacity: int = DEFAULT_CAPACITY, rng: random.Random | None = None,
                 view: SharedPrefixView | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(rng)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.offload_discount = offload_discount
        self.capacity = capacity
        self.view = view
        self.clock = clock
        self._workers: dict[str, PrefixIndex] = {}
        # What was sent to each publishing worker lately, which it may not have published yet.
        self._recent: dict[str, RecentPrefixes] = {}
        # One index per cache service, shared by every worker that offloads to it.
        self._services: dict[str, PrefixIndex] = {}

    def forget(self, member_id: str) -> None:
        # A cache service's index stays: the service keeps its blocks when one of its workers goes.
        self._workers.pop(member_id, None)
        self._recent.pop(member_id, None)

    def forget_cache_group(self, service: str) -> None:
        self._services.pop(service, None)

    def prefilled(self, member_id: str, hashes: Sequence[bytes]) -> None:
        # Counted as sent from now on, not from when it was routed: a prefill that waited in the queue, or
        # took long (a cold engine), must not outlast the time the worker is given to publish it.
        recent = self._recent.get(member_id)
        if recent is not None:
            recent.insert(hashes, self.clock())

    def imbalanced(self, loads: Sequence[float]) -> bool:
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def choose(self, candidates: Sequence[T], *, model: str, key: RouteKey) -> Choice[T]:
        hashes = chunk_hashes(tenant_of(model, key.cache_salt), key.prefix_text)
        now = self.clock()
        own = [self._held(c, hashes, now) for c in candidates]
        shared = [self._service_index(c.cache_group).match(hashes) if c.cache_group else 0 for c in candidates]
        warm = [max(float(o), self.offload_discount * s) for o, s in zip(own, shared, strict=True)]
        matches = [w / len(hashes) if hashes else 0.0 for w in warm]

        if len(candidates) == 1:
            index, reason = 0, "only_candidate"
        elif self.imbalanced([c.load for c in candidates]):
            index, reason = self.least_loaded(candidates), "balance"
        else:
            costs = [c.load - PREFIX_CREDIT_REQUESTS * m for c, m in zip(candidates, matches, strict=True)]
            least = min(costs)
            tied = [i for i, cost in enumerate(costs) if cost <= least + _TIE]
            # Among equals, the worker believed to hold the least (as SGLang sends a prefix no worker
            # has to its smallest tree): new prefixes spread over the fleet's caches instead of piling
            # onto one worker until the balance rule notices.
            sizes = {i: self._size(candidates[i]) for i in tied}
            smallest = min(sizes.values())
            index = self.rng.choice([i for i in tied if sizes[i] == smallest])
            if warm[index] == 0:
                reason = "least_load" if any(warm) else "no_match"
            elif own[index] >= self.offload_discount * shared[index]:
                reason = "prefix_match"
            else:
                reason = "shared_cache"

        chosen = candidates[index]
        self._worker_index(chosen.member_id).insert(hashes)
        if self._shared(chosen):
            self._recent_of(chosen.member_id).insert(hashes, now)
        if chosen.cache_group:
            self._service_index(chosen.cache_group).insert(hashes)
        if hashes:
            PREFIX_LOOKUP_CHUNKS.inc(len(hashes))
            PREFIX_HIT_CHUNKS.labels("worker").inc(own[index])
            PREFIX_HIT_CHUNKS.labels("shared_cache").inc(max(0, shared[index] - own[index]))
        return Choice(chosen, reason, matches[index], tuple(hashes))

    def _shared(self, target: RoutingTarget) -> bool:
        """Whether the worker is matched on what it publishes (see the module's docstring)."""
        return self.view is not None and self.view.synced and bool(target.prefix_view_id)

    def _held(self, target: RoutingTarget, hashes: Sequence[bytes], now: float) -> int:
        if self._shared(target):
            assert self.view is not None
            PREFIX_VIEW_LOOKUPS.labels("shared").inc()
            return max(self.view.match(target.prefix_view_id, hashes),
                       self._recent_of(target.member_id).match(hashes, now))
        PREFIX_VIEW_LOOKUPS.labels("approximate").inc()
        return self._worker_index(target.member_id).match(hashes)

    def _size(self, target: RoutingTarget) -> int:
        """How much the worker is believed to hold, to break ties toward the emptiest."""
        if self._shared(target):
            assert self.view is not None
            return self.view.held(target.prefix_view_id) + len(self._recent_of(target.member_id))
        return len(self._worker_index(target.member_id))

    def _recent_of(self, member_id: str) -> RecentPrefixes:
        recent = self._recent.get(member_id)
        if recent is None:
            recent = self._recent[member_id] = RecentPrefixes(capacity=self.capacity)
        return recent

    def _worker_index(self, member_id: str) -> PrefixIndex:
        index = self._workers.get(member_id)
        if index is None:
            index = self._workers[member_id] = PrefixIndex(self.capacity)
        return index

    def _service_index(self, service: str) -> PrefixIndex:
        index = self._services.get(service)
        if index is None:
            index = self._services[service] = PrefixIndex(self.capacity)
        return index


def make_policy(name: str, *, balance_abs_threshold: float = 16, balance_rel_threshold: float = 1.5,
                offload_discount: float = 0.75, rng: random.Random | None = None,
                view: SharedPrefixView | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin(rng)
    if name == "least_load":
        return LeastLoad(rng)
    if name == "cache_aware":
        return CacheAware(balance_abs_threshold=balance_abs_threshold,
                          balance_rel_threshold=balance_rel_threshold, offload_discount=offload_discount, rng=rng,
                          view=view)
    raise ValueError(f"--routing {name!r} is not one of {', '.join(POLICIES)}")
