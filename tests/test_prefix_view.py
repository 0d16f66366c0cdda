"""The shared prefix view, without an engine: the worker's structures that turn vLLM's KV cache events
into the gateway's chunk digests (held_prefixes.py), the worker's publisher writing them to a real
Redis, gateways' views reading them back, and cache_aware routing on them from two gateways.

The events are vLLM's own classes (vllm.distributed.kv_events), as the engine sends them; the engine's
side is tested end to end in test_fleet_e2e.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
import zmq
import zmq.asyncio

from taco_llm.engine_worker.frontend.held_prefixes import HeldBlocks, HeldChunks, chunk_blocks
from taco_llm.engine_worker.frontend.prefix_publisher import PrefixPublisher, subscriber_endpoint
from taco_llm.engine_worker.vllm_internals import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from taco_llm.gateway.prefix_index import CHUNK_CHARS, RecentPrefixes, chunk_hashes
from taco_llm.gateway.prefix_view import SharedPrefixView
from taco_llm.gateway.routing import CacheAware, RouteKey, tenant_of
from taco_llm.protos import engine_pb2
from taco_llm.protos.prefix_view import PREFIX_EVENTS_STREAM, PREFIX_SET_KEY_PREFIX, pack_digests

from .support import RedisServer, free_port

# The async tests run on the session's loop, where the async fixtures live (pyproject's setting).
on_session_loop = pytest.mark.asyncio(loop_scope="session")

BLOCK = 4  # tokens per block in these tests (vLLM's CPU backend has 128)
MODEL = "m"


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=None)


def _removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium="GPU")


def _chunks(text: str) -> engine_pb2.PrefixChunks:
    return engine_pb2.PrefixChunks(digests=pack_digests(chunk_hashes(tenant_of(MODEL, ""), text)),
                                   chunk_chars=CHUNK_CHARS, text_chars=len(text))


# -- the worker's structures ----------------------------------------------------------------------


def test_held_blocks_walk_a_prompt_up_to_its_first_block_not_cached() -> None:
    blocks = HeldBlocks()
    tokens = list(range(12))
    blocks.stored([101, 102], None, tokens[:8], BLOCK)
    blocks.stored([103], 102, tokens[8:12], BLOCK)
    assert blocks.leading(tokens) == [101, 102, 103]
    assert blocks.leading(tokens[:7]) == [101], "only whole blocks of the prompt count"
    assert blocks.leading([99, *tokens[1:]]) == [], "another first block is another prompt"
    blocks.removed(102)
    assert blocks.leading(tokens) == [101], "a block evicted cuts the chain there, as vLLM's lookup does"
    blocks.stored([104], None, [7, 7, 7], BLOCK)  # not a whole block: ignored
    assert len(blocks) == 2
    blocks.clear()
    assert blocks.leading(tokens) == [] and len(blocks) == 0


def test_a_block_stored_again_under_another_hash_replaces_the_old() -> None:
    blocks = HeldBlocks()
    blocks.stored([1], None, [1, 2, 3, 4], BLOCK)
    blocks.stored([2], None, [1, 2, 3, 4], BLOCK)
    blocks.removed(1)  # the old hash's removal must not remove the new block
    assert blocks.leading([1, 2, 3, 4]) == [2]


def test_chunks_map_to_the_blocks_that_hold_their_share_of_the_prompt() -> None:
    text = "x" * (CHUNK_CHARS * 4)  # 4 chunks over a 16-token prompt: 4 tokens (one block) each
    mapping = list(chunk_blocks(_chunks(text), prompt_tokens=16, block_size=BLOCK))
    assert [blocks for _, blocks in mapping] == [1, 2, 3, 4]
    # 14 tokens: 3 whole blocks; the fourth chunk's share ends in the partial block, which no worker
    # caches: it is held with the whole blocks before it.
    assert [blocks for _, blocks in chunk_blocks(_chunks(text), prompt_tokens=14, block_size=BLOCK)] == [1, 2, 3, 3]
    assert list(chunk_blocks(_chunks(text), prompt_tokens=3, block_size=BLOCK)) == [], "no whole block"
    assert list(chunk_blocks(engine_pb2.PrefixChunks(), prompt_tokens=16, block_size=BLOCK)) == []
    broken = engine_pb2.PrefixChunks(digests=b"123", chunk_chars=CHUNK_CHARS, text_chars=100)
    assert list(chunk_blocks(broken, prompt_tokens=16, block_size=BLOCK)) == [], "not whole digests: ignored"


def test_a_digest_stays_held_while_any_block_holds_it_up() -> None:
    chunks = HeldChunks()
    digest = b"d" * 8
    assert chunks.attach(digest, 1)
    assert not chunks.attach(digest, 2), "already held"
    assert chunks.detach(1) == []
    assert chunks.detach(2) == [digest]
    assert len(chunks) == 0 and chunks.detach(3) == []
    assert not chunks.attach(b"short", 1), "not a digest"


def test_recent_prefixes_expire_after_their_horizon() -> None:
    recent = RecentPrefixes(horizon=10.0)
    hashes = [b"a" * 8, b"b" * 8, b"c" * 8]
    recent.insert(hashes, now=0.0)
    assert recent.match(hashes, now=5.0) == 3
    recent.insert(hashes[:1], now=8.0)
    assert recent.match(hashes, now=12.0) == 1, "the head was sent again; the tail expired"
    assert recent.match(hashes, now=30.0) == 0 and len(recent) == 0


# -- publisher and views on a real Redis ----------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(free_port(), tmp_path_factory.mktemp("prefix-view-redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client: aioredis.Redis = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()


async def _within(seconds: float, condition: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {seconds}s: {what}"
        await asyncio.sleep(0.02)


@dataclass
class Published:
    publisher: PrefixPublisher
    tokens: list[int]
    text: str

    @property
    def hashes(self) -> list[bytes]:
        return chunk_hashes(tenant_of(MODEL, ""), self.text)


def _prompt(publisher: PrefixPublisher, first_block: int, first_token: int, *, events_first: bool = False
            ) -> Published:
    """A 16-token prompt of 4 chunks, noted as prefilled and its 4 blocks reported stored (the events
    come on another socket than the request's output: in either order)."""
    text = "".join(chr(ord("a") + first_token % 26) for _ in range(CHUNK_CHARS * 4))
    tokens = list(range(first_token, first_token + 16))
    stored = _stored([first_block + i for i in range(4)], None, tokens)
    if events_first:
        publisher.apply([stored])
    publisher.note(_chunks(text), tokens)
    if not events_first:
        publisher.apply([stored])
    return Published(publisher, tokens, text)


async def _publisher(redis_url: str, worker_id: str, endpoint: str | None = None) -> PrefixPublisher:
    # Without `endpoint` nothing writes to the events socket: the test hands the events to apply() itself.
    publisher = PrefixPublisher(redis_url, worker_id, ttl=6.0,
                                endpoint=endpoint or f"ipc:///tmp/taco-test-{worker_id}-{free_port()}")
    await publisher.start()
    return publisher


@on_session_loop
async def test_a_publisher_writes_what_its_cache_holds_and_a_view_reads_it(
        redis_url: str, redis_client: aioredis.Redis) -> None:
    publisher = await _publisher(redis_url, "w1")
    view = SharedPrefixView(redis_url)
    following = asyncio.create_task(view.run())
    try:
        await _within(2.0, lambda: view.synced, "the view syncs")
        prompt = _prompt(publisher, first_block=100, first_token=0)
        await _within(2.0, lambda: view.match("w1", prompt.hashes) == 4, "the view reads what was published")
        assert await redis_client.scard(PREFIX_SET_KEY_PREFIX + "w1") == 4
        assert 0 < await redis_client.pttl(PREFIX_SET_KEY_PREFIX + "w1") <= 6000, "it expires with the worker"

        # vLLM evicts the prompt's third block: chunks 3 and 4 are gone (chunk 4's block is no longer
        # reachable either: the walk stops at the third).
        publisher.apply([_removed([102])])
        await _within(2.0, lambda: view.match("w1", prompt.hashes) == 2, "an eviction reaches the view")

        # A view started now reads the set, then follows the stream: a prompt whose events came before
        # its output is published all the same.
        late = SharedPrefixView(redis_url)
        late_following = asyncio.create_task(late.run())
        second = _prompt(publisher, first_block=200, first_token=50, events_first=True)
        await _within(2.0, lambda: late.synced and late.match("w1", second.hashes) == 4
                      and late.match("w1", prompt.hashes) == 2, "a late view syncs from the sets and the stream")
        late_following.cancel()
        await asyncio.gather(late_following, return_exceptions=True)
        await late.close()

        publisher.apply([AllBlocksCleared()])
        await _within(2.0, lambda: view.held("w1") == 0, "all blocks cleared")
    finally:
        await publisher.stop()
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await view.close()
    assert await redis_client.exists(PREFIX_SET_KEY_PREFIX + "w1") == 0, "a stopped worker's set is deleted"


@on_session_loop
async def test_a_publisher_that_lost_writes_rewrites_its_whole_set(redis_url: str,
                                                                   redis_client: aioredis.Redis) -> None:
    publisher = await _publisher(redis_url, "w2")
    try:
        prompt = _prompt(publisher, first_block=300, first_token=100)
        await _within(2.0, lambda: publisher.chunks.digests() and not publisher._added, "written")
        # Redis lost the set (restarted empty, say) and the stream with it: the publisher finds out at
        # its next write (the set's expiry is refreshed every TTL / 3) and states the whole set again.
        await redis_client.flushdb()
        deadline = asyncio.get_running_loop().time() + 5.0
        while await redis_client.smembers(PREFIX_SET_KEY_PREFIX + "w2") != set(prompt.hashes):
            assert asyncio.get_running_loop().time() < deadline, "the lost set was not written again"
            await asyncio.sleep(0.05)
        assert await redis_client.xlen(PREFIX_EVENTS_STREAM) == 1, "one RESET, the whole set"
    finally:
        await publisher.stop()


@dataclass
class FakeWorker:
    address: str
    member_id: str
    prefix_view_id: str
    load: float = 0.0
    cache_group: str = ""


@on_session_loop
async def test_two_gateways_route_a_prefix_to_the_worker_that_holds_it(redis_url: str,
                                                                       redis_client: aioredis.Redis) -> None:
    publishers = [await _publisher(redis_url, f"g{n}") for n in range(2)]
    workers = [FakeWorker(f"10.0.0.{n}:1", f"g{n}", f"g{n}") for n in range(2)]
    views = [SharedPrefixView(redis_url) for _ in range(2)]
    tasks = [asyncio.create_task(view.run()) for view in views]
    first, second = (CacheAware(balance_abs_threshold=16, balance_rel_threshold=1.5, offload_discount=0.75,
                                view=view) for view in views)
    try:
        await _within(2.0, lambda: all(view.synced for view in views), "both views sync")
        text = "q" * (CHUNK_CHARS * 4)
        key = RouteKey(model=MODEL, prefix_text=text)
        chosen = first.choose(workers, model=MODEL, key=key)
        assert chosen.prefix_hashes == tuple(chunk_hashes(tenant_of(MODEL, ""), text))
        # The chosen worker prefills it, and its engine reports the blocks.
        publisher = publishers[workers.index(chosen.target)]
        tokens = list(range(500, 516))
        publisher.note(_chunks(text), tokens)
        publisher.apply([_stored([900, 901, 902, 903], None, tokens)])
        await _within(2.0, lambda: views[1].match(chosen.target.prefix_view_id, list(chosen.prefix_hashes)) == 4,
                      "the other gateway's view")
        for _ in range(5):
            again = second.choose(workers, model=MODEL, key=key)
            assert again.target is chosen.target and again.reason == "prefix_match", \
                "the other gateway never sent this prefix, yet routes it to the worker that holds it"

        # Evicted there: the other gateway no longer counts on it (its own sends are not recent either).
        publisher.apply([_removed([900])])
        await _within(2.0, lambda: views[1].match(chosen.target.prefix_view_id, list(chosen.prefix_hashes)) == 0,
                      "an eviction")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for view in views:
            await view.close()
        for publisher in publishers:
            await publisher.stop()


def test_an_events_endpoint_that_binds_every_interface_is_dialled_on_loopback(tmp_path: Path) -> None:
    assert subscriber_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert subscriber_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert subscriber_endpoint(f"ipc://{tmp_path}/events") == f"ipc://{tmp_path}/events"


@on_session_loop
async def test_the_publisher_reads_vllm_batches_from_zmq_and_starts_over_after_a_gap(
        redis_url: str, redis_client: aioredis.Redis, tmp_path: Path) -> None:
    # vLLM's wire format (ZmqEventPublisher): (topic, 8-byte big-endian sequence number, msgpack batch).
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.PUB)
    endpoint = f"ipc://{tmp_path}/events"
    socket.bind(endpoint)
    encoder = msgspec.msgpack.Encoder()
    publisher = await _publisher(redis_url, "w3", endpoint=endpoint)
    sequence = 0

    async def send(*events: object) -> None:
        nonlocal sequence
        await socket.send_multipart((b"", sequence.to_bytes(8, "big"),
                                     encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))))
        sequence += 1

    try:
        while publisher.last_sequence is None:  # a subscriber misses what is sent before it has joined
            await send()
            await asyncio.sleep(0.02)
        sequence = publisher.last_sequence + 1
        text, tokens = "z" * (CHUNK_CHARS * 4), list(range(600, 616))
        publisher.note(_chunks(text), tokens)
        await send(_stored([500, 501, 502, 503], None, tokens))
        await _within(2.0, lambda: publisher.chunks.digests() == set(chunk_hashes(tenant_of(MODEL, ""), text)),
                      "a prompt's blocks reported on the socket")
        sequence += 1  # a batch lost: a removal may have been in it
        await send()
        await _within(2.0, lambda: len(publisher.blocks) == 0 and len(publisher.chunks) == 0, "started over")
        await _within(2.0, lambda: not publisher._reset, "the emptied set written")
        assert await redis_client.scard(PREFIX_SET_KEY_PREFIX + "w3") == 0
    finally:
        await publisher.stop()
        socket.close(0)
        context.term()


def test_the_worker_turns_vllm_events_on_or_says_why_it_cannot() -> None:
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from taco_llm.engine_worker.frontend.prefix_publisher import PublishError, events_endpoint

    engine = AsyncEngineArgs()
    endpoint = events_endpoint(engine, asked=False)
    assert endpoint is not None and endpoint.startswith("ipc://")
    assert engine.kv_events_config is not None and engine.kv_events_config.enable_kv_cache_events
    assert engine.kv_events_config.endpoint == endpoint

    given = AsyncEngineArgs(kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                            endpoint="tcp://*:5599"))
    assert events_endpoint(given, asked=True) == "tcp://*:5599", "the operator's own socket is read"

    for engine, flag in ((AsyncEngineArgs(enable_prefix_caching=False), "--no-enable-prefix-caching"),
                         (AsyncEngineArgs(kv_events_config=KVEventsConfig(enable_kv_cache_events=False,
                                                                          publisher="null")),
                          "--kv-events-config")):
        assert events_endpoint(engine, asked=False) is None, "not asked: the worker runs without publishing"
        with pytest.raises(PublishError, match=flag):
            events_endpoint(engine, asked=True)


def test_what_was_sent_counts_from_its_prefill_not_from_its_routing() -> None:
    # A cold engine, or a queue, may take longer than the horizon to prefill: the gateway's own record of
    # the send must then still cover the time the worker takes to publish what it cached.
    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    class SyncedView(SharedPrefixView):
        def __init__(self) -> None:
            super().__init__("redis://127.0.0.1:1/0")  # never read: nothing published
            self.synced = True

    clock = Clock()
    policy = CacheAware(balance_abs_threshold=16, balance_rel_threshold=1.5, offload_discount=0.75,
                        view=SyncedView(), clock=clock)
    workers = [FakeWorker(f"10.0.0.{n}:1", f"m{n}", f"m{n}") for n in range(2)]
    key = RouteKey(model=MODEL, prefix_text="p" * (CHUNK_CHARS * 4))
    first = policy.choose(workers, model=MODEL, key=key)
    clock.now = 25.0  # prefilled 25 s after it was routed
    policy.prefilled(first.target.member_id, first.prefix_hashes)
    clock.now = 30.0  # its publication is late, yet the repeat goes where the prompt was sent
    again = policy.choose(workers, model=MODEL, key=key)
    assert again.target is first.target and again.reason == "prefix_match"
