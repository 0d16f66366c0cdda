"""The router on fixed inputs: prefix index, circuit breaker, policies and the pool's choice among fake
workers (no process, no network)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest

from taco_llm.gateway.circuit_breaker import BreakerState, CircuitBreaker
from taco_llm.gateway.engine_pool import EngineClient, EnginePool
from taco_llm.gateway.errors import APIError
from taco_llm.gateway.failover import is_worker_fault
from taco_llm.gateway.metrics import REGISTRY
from taco_llm.gateway.prefix_index import CHUNK_CHARS, PrefixIndex, chunk_hashes
from taco_llm.gateway.routing import CacheAware, LeastLoad, RoundRobin, RouteKey, make_policy
from taco_llm.protos import engine_pb2

# -- prefix index ----------------------------------------------------------------------------------


def _text(seed: str, chunks: int) -> str:
    return "".join(f"{seed}-{i}-".ljust(CHUNK_CHARS, "x") for i in range(chunks))


def test_chunk_hashes_chain_whole_chunks_per_tenant() -> None:
    a = chunk_hashes("m\0", _text("a", 4))
    assert len(a) == 4
    assert chunk_hashes("m\0", _text("a", 4) + "tail shorter than a chunk") == a, "a partial chunk is not hashed"
    longer = chunk_hashes("m\0", _text("a", 4) + _text("b", 2))
    assert longer[:4] == a and len(longer) == 6
    assert not set(chunk_hashes("other\0", _text("a", 4))) & set(a), "tenants share no hash"
    # A chunk's hash names its whole prefix: the same chunk after different heads hashes differently.
    assert chunk_hashes("m\0", "x" * CHUNK_CHARS + "y" * CHUNK_CHARS)[1] != \
        chunk_hashes("m\0", "z" * CHUNK_CHARS + "y" * CHUNK_CHARS)[1]
    assert chunk_hashes("m\0", "short") == []


def test_prefix_index_matches_leading_chunks_and_evicts_tails_first() -> None:
    index = PrefixIndex(capacity=6)
    first = chunk_hashes("t", _text("a", 4))
    index.insert(first)
    assert index.match(first) == 4
    assert index.match(chunk_hashes("t", _text("a", 2) + _text("z", 2))) == 2
    assert index.match(chunk_hashes("t", _text("z", 4))) == 0
    second = chunk_hashes("t", _text("b", 4))
    index.insert(second)
    assert len(index) == 6
    # The older chain lost its tail, not its head: its first two chunks still match.
    assert index.match(first) == 2 and index.match(second) == 4


# -- circuit breaker -------------------------------------------------------------------------------

CLIENT_FAULTS = [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE]
WORKER_FAULTS = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.UNKNOWN]


def _refusal(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="refused")


def test_fault_classification() -> None:
    assert all(is_worker_fault(_refusal(code)) for code in WORKER_FAULTS)
    assert not any(is_worker_fault(_refusal(code)) for code in CLIENT_FAULTS)


def test_breaker_opens_after_consecutive_faults_then_half_opens() -> None:
    breaker = CircuitBreaker(threshold=3, base_cooldown=5, max_cooldown=12)
    breaker.record(0, worker_fault=True)
    breaker.record(0, worker_fault=True)
    breaker.record(0, worker_fault=False)  # the run is broken
    breaker.record(0, worker_fault=True)
    assert breaker.state(0) is BreakerState.CLOSED
    breaker.record(1, worker_fault=True)
    assert breaker.record(1, worker_fault=True) is BreakerState.OPEN
    assert not breaker.allows(5.9) and breaker.retry_after(1.5) == 5
    assert breaker.state(6) is BreakerState.HALF_OPEN and breaker.allows(6)
    breaker.routed(6)
    assert not breaker.allows(6.5), "one trial at a time"
    # The trial fails: open again, the cool-down doubled.
    assert breaker.record(7, worker_fault=True) is BreakerState.OPEN
    assert breaker.state(16.9) is BreakerState.OPEN and breaker.state(17) is BreakerState.HALF_OPEN
    breaker.routed(17)
    breaker.record(18, worker_fault=True)
    assert breaker.cooldown == 12, "the cool-down stops doubling at max_cooldown"
    breaker.routed(30)
    assert breaker.record(31, worker_fault=False) is BreakerState.CLOSED
    assert breaker.cooldown == 5 and breaker.allows(31)


def test_a_lost_trial_frees_its_slot() -> None:
    breaker = CircuitBreaker(threshold=1, base_cooldown=1, trial_timeout=10)
    breaker.record(0, worker_fault=True)
    breaker.routed(1)
    assert not breaker.allows(5) and breaker.allows(11)


def test_client_faults_never_open_a_breaker() -> None:
    pool, (a, _) = _pool(["a:1", "b:1"])
    for _ in range(20):
        for code in CLIENT_FAULTS:
            pool.record_outcome(a, worker_fault=is_worker_fault(_refusal(code)))
    assert a.breaker.state(pool.clock()) is BreakerState.CLOSED


# -- policies --------------------------------------------------------------------------------------


@dataclass(eq=False)
class Worker:
    address: str
    load: float = 0.0
    cache_group: str = ""
    member_id: str = ""

    def __post_init__(self) -> None:
        self.member_id = self.member_id or self.address


def _cache_aware(**kwargs: float) -> CacheAware:
    settings: dict[str, float] = {"balance_abs_threshold": 16, "balance_rel_threshold": 1.5,
                                  "offload_discount": 0.75, **kwargs}
    return CacheAware(balance_abs_threshold=settings["balance_abs_threshold"],
                      balance_rel_threshold=settings["balance_rel_threshold"],
                      offload_discount=settings["offload_discount"], rng=random.Random(7))


def _send(policy: CacheAware, workers: list[Worker], text: str, *, model: str = "m",
          salt: str = "") -> tuple[Worker, str, float]:
    choice = policy.choose(workers, model=model, key=RouteKey(model=model, prefix_text=text, cache_salt=salt))
    choice.target.load += 1  # as the pool counts a routed request until the next GetLoad
    return choice.target, choice.reason, choice.prefix_match


def test_repeated_prefixes_stick_and_distinct_ones_spread() -> None:
    policy = _cache_aware()
    workers = [Worker(f"w{i}:1") for i in range(4)]
    first, reason, _ = _send(policy, workers, _text("doc", 20) + "question 0")
    assert reason == "no_match"
    for i in range(1, 6):
        worker, reason, match = _send(policy, workers, _text("doc", 20) + f"question {i}")
        assert worker is first and reason == "prefix_match" and match == 1.0
    for worker in workers:
        worker.load = 0
    chosen = Counter(_send(policy, workers, _text(f"other{i}", 10))[0].address for i in range(12))
    assert sorted(chosen.values()) == [3, 3, 3, 3], chosen


def test_new_prefixes_go_to_the_worker_holding_least_when_loads_tie() -> None:
    policy = _cache_aware()
    workers = [Worker("a:1"), Worker("b:1")]
    homes = []
    for i in range(6):
        worker, _, _ = _send(policy, workers, _text(f"topic{i}", 8))
        worker.load = 0  # one request at a time: the fleet is idle again before the next
        homes.append(worker.address)
    assert Counter(homes) == {"a:1": 3, "b:1": 3}, homes


def test_skew_spills_to_the_idle_worker() -> None:
    policy = _cache_aware()
    busy, idle = Worker("a:1"), Worker("b:1")
    _send(policy, [busy, idle], _text("doc", 8))
    assert busy.load == 1 or idle.load == 1
    holder, other = (busy, idle) if busy.load else (idle, busy)
    # Past the prefix's worth in load, the other worker wins though it holds nothing.
    holder.load, other.load = 10, 1
    worker, reason, _ = _send(policy, [holder, other], _text("doc", 8))
    assert worker is other and reason == "least_load"
    # Imbalanced beyond both thresholds: load alone decides, whatever the prefix.
    holder.load, other.load = 40, 2
    worker, reason, _ = _send(policy, [holder, other], _text("doc", 8))
    assert worker is other and reason == "balance"


def test_tenants_never_share_affinity() -> None:
    policy = _cache_aware()
    a, b = Worker("a:1"), Worker("b:1")
    text = _text("system prompt", 16)
    holder, _, _ = _send(policy, [a, b], text, model="base")
    other = b if holder is a else a
    # The holder is now a request busier; only a prefix credit would bring the next request back to it.
    for model, salt in [("lora-a", ""), ("base", "user-1")]:
        holder.load, other.load = 1, 0
        worker, reason, match = _send(policy, [a, b], text, model=model, salt=salt)
        assert worker is other and reason == "no_match" and match == 0, (model, salt)
    holder.load, other.load = 1, 0
    worker, reason, _ = _send(policy, [a, b], text, model="base")
    assert worker is holder and reason == "prefix_match"


def _sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_a_shared_cache_service_counts_at_the_discount() -> None:
    policy = _cache_aware()
    a, b = Worker("a:1", cache_group="cache:9"), Worker("b:1", cache_group="cache:9")
    c = Worker("c:1")
    text = _text("shared", 10)
    policy.choose([a], model="m", key=RouteKey(model="m", prefix_text=text))
    a.load, b.load, c.load = 4, 1, 0
    shared_before = _sample("taco_llm_router_prefix_hit_chunks_total", {"where": "shared_cache"})
    worker, reason, match = _send(policy, [a, b, c], text)
    # a: 4 - 8, b: 1 - 8 x 0.75, c: 0 -> b, warm through the cache service it shares with a.
    assert worker is b and reason == "shared_cache" and match == pytest.approx(0.75)
    assert _sample("taco_llm_router_prefix_hit_chunks_total", {"where": "shared_cache"}) - shared_before == 10
    # Without the shared service c, as idle as b, would have been as good.
    lone = _cache_aware()
    lone.choose([Worker("a:1")], model="m", key=RouteKey(model="m", prefix_text=text))
    assert lone.choose([Worker("b:1", load=1), Worker("c:1")], model="m",
                       key=RouteKey(model="m", prefix_text=text)).reason == "no_match"


def test_affinity_belongs_to_the_member_not_the_address() -> None:
    policy = _cache_aware()
    text = _text("doc", 8)
    old = Worker("a:1", member_id="incarnation-1")
    _send(policy, [old], text)
    # A new incarnation at the same address holds nothing of the old one's cache.
    new = Worker("a:1", member_id="incarnation-2")
    assert policy.choose([new], model="m", key=RouteKey(model="m", prefix_text=text)).prefix_match == 0
    policy.forget("incarnation-2")
    assert policy.choose([old], model="m", key=RouteKey(model="m", prefix_text=text)).prefix_match == 1.0
    policy.forget("incarnation-1")
    assert policy.choose([old], model="m", key=RouteKey(model="m", prefix_text=text)).prefix_match == 0


def test_a_restarted_cache_service_forgets_only_its_shared_index() -> None:
    policy = _cache_aware()
    text = _text("shared", 10)
    a, b = Worker("a:1", cache_group="cache:9"), Worker("b:1", cache_group="cache:9")
    c, d = Worker("c:1", cache_group="cache:8"), Worker("d:1", cache_group="cache:8")
    policy.choose([a], model="m", key=RouteKey(model="m", prefix_text=text))
    policy.choose([c], model="m", key=RouteKey(model="m", prefix_text=text))
    policy.forget_cache_group("cache:9")
    # b no longer counts a's prefix as warm through the service; a's own cache still holds it, and the
    # other service's index is untouched.
    assert policy.choose([b], model="m", key=RouteKey(model="m", prefix_text=_text("shared", 10))).prefix_match == 0
    assert policy.choose([a], model="m", key=RouteKey(model="m", prefix_text=text)).prefix_match == 1.0
    assert policy.choose([d], model="m", key=RouteKey(model="m", prefix_text=text)).prefix_match == \
        pytest.approx(0.75)
    for simple in (RoundRobin(), LeastLoad()):
        simple.forget_cache_group("cache:9")  # nothing to forget


def test_round_robin_and_least_load() -> None:
    workers = [Worker("b:1"), Worker("a:1"), Worker("c:1")]
    robin = RoundRobin()
    key = RouteKey(model="m")
    assert [robin.choose(workers, model="m", key=key).target.address for _ in range(4)] == \
        ["a:1", "b:1", "c:1", "a:1"]
    # A member leaving does not reset the turn.
    assert robin.choose(workers[:2], model="m", key=key).target.address == "b:1"
    least = LeastLoad(random.Random(1))
    workers[0].load, workers[1].load, workers[2].load = 3, 1, 1
    chosen = Counter(least.choose(workers, model="m", key=key).target.address for _ in range(200))
    assert set(chosen) == {"a:1", "c:1"} and min(chosen.values()) > 50, "ties are broken at random"
    with pytest.raises(ValueError, match="--routing"):
        make_policy("fastest")


# -- the pool --------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fake(address: str, names: list[str]) -> EngineClient:
    client = EngineClient(address, None, None, None)  # type: ignore[arg-type]
    client.info = engine_pb2.ModelInfo(served_model_names=names)
    client.ready = True
    return client


def _pool(addresses: list[str], *, routing: str = "least_load",
          names: list[str] | None = None) -> tuple[EnginePool, list[EngineClient]]:
    pool = EnginePool(["x:1"], routing=routing, clock=Clock(), rng=random.Random(3))
    pool.clients = [_fake(a, names or ["m"]) for a in addresses]
    return pool, pool.clients


def test_load_counts_requests_routed_since_the_last_report() -> None:
    pool, (a, b) = _pool(["a:1", "b:1"])
    a.reported = engine_pb2.Load(num_running_requests=2, num_waiting_requests=1, kv_cache_usage=0.5)
    b.reported = engine_pb2.Load(num_running_requests=3, num_waiting_requests=1)
    assert a.load == 4.0
    # A burst between two GetLoads: a takes one, then the two are even, then they alternate.
    chosen = [pool.route(RouteKey(model="m")).client for _ in range(5)]
    assert chosen[0] is a and Counter(c.address for c in chosen) in (Counter({"a:1": 3, "b:1": 2}),
                                                                      Counter({"a:1": 2, "b:1": 3}))


def test_open_breaker_is_excluded_then_half_open_after_cool_down() -> None:
    pool, (a, b) = _pool(["a:1", "b:1"])
    clock = pool.clock
    assert isinstance(clock, Clock)
    for _ in range(3):
        pool.record_outcome(a, worker_fault=True)
    assert {pool.route(RouteKey(model="m")).client.address for _ in range(10)} == {"b:1"}
    assert _sample("taco_llm_worker_circuit_state", {"worker": "a:1"}) == 2
    for _ in range(3):
        pool.record_outcome(b, worker_fault=True)
    clock.now += 1.2
    with pytest.raises(APIError) as excinfo:
        pool.route(RouteKey(model="m"))
    error = excinfo.value
    assert error.status == 503 and error.headers == {"Retry-After": "4"}
    assert "worker 1 of 2: circuit open" in error.message and error.response().headers["retry-after"] == "4"
    assert "a:1" not in error.message, "a worker's address is internal: logged, never sent to the client"
    clock.now += 4
    # Half-open: a single trial each, then nothing until their outcomes come back.
    trials = {pool.route(RouteKey(model="m")).client.address for _ in range(2)}
    assert trials == {"a:1", "b:1"}
    with pytest.raises(APIError):
        pool.route(RouteKey(model="m"))
    pool.record_outcome(a, worker_fault=False)
    assert pool.route(RouteKey(model="m")).client is a
    pool.record_outcome(b, worker_fault=True)
    assert b.breaker.cooldown == 10


def test_route_excludes_tried_workers_and_names_what_is_wrong() -> None:
    pool, (a, b) = _pool(["a:1", "b:1"])
    assert pool.route(RouteKey(model="m"), exclude=[a]).client is b
    with pytest.raises(APIError) as excinfo:
        pool.route(RouteKey(model="m"), exclude=[a, b])
    assert excinfo.value.status == 503 and "already tried" in excinfo.value.message
    with pytest.raises(APIError) as excinfo:
        pool.route(RouteKey(model="nope"))
    assert excinfo.value.status == 404 and excinfo.value.code == "model_not_found"
    a.ready = False
    a.last_error = "UNAVAILABLE: connection refused"
    b.ready = False
    with pytest.raises(APIError) as excinfo:
        pool.route(RouteKey(model="m"))
    assert excinfo.value.status == 503 and excinfo.value.headers["Retry-After"] == "1"
    assert "worker 1 of 2: not ready" in excinfo.value.message
    assert "a:1" not in excinfo.value.message and "connection refused" not in excinfo.value.message
    assert excinfo.value.code == "no_engine_ready"
    # Known but not ready: 503, not 404.
    with pytest.raises(APIError) as excinfo:
        pool.route(RouteKey(model="m"))
    assert excinfo.value.status == 503


def test_default_model_and_decisions_are_counted() -> None:
    pool, (a, b, c) = _pool(["a:1", "b:1", "c:1"], routing="cache_aware")
    assert a.info is not None and c.info is not None
    c.info.served_model_names[:] = ["other"]
    before = _sample("taco_llm_router_decisions_total", {"policy": "cache_aware", "reason": "no_match"})
    routes = [pool.route(RouteKey(model=None, prefix_text=_text(f"p{i}", 3))) for i in range(6)]
    assert {r.client.address for r in routes} == {"a:1", "b:1"}, "the default model's workers only"
    assert all(r.policy == "cache_aware" for r in routes)
    after = _sample("taco_llm_router_decisions_total", {"policy": "cache_aware", "reason": "no_match"})
    assert after - before == 6
    assert pool.route(RouteKey(model="other")).reason == "only_candidate"
    assert pool.pick(None) in (a, b)
