"""The worker's background link to the cache service for the shared lookahead index.

The decode loop never waits on it: finished sequences go into an outbox that a publisher thread sends,
and other workers' sequences arrive in an inbox that the proposer drains a bounded amount of each step.
Either side reconnects with backoff when the cache service or its Redis is away, and the subscriber
resumes after the last record it saw, so nothing published meanwhile is missed.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc

from taco_llm.grpc_security import CacheServiceClient
from taco_llm.protos import lookahead_pb2, lookahead_pb2_grpc
from taco_llm.protos.kv_cache_limits import GRPC_MESSAGE_LIMIT, LOOKAHEAD_BATCH_BYTES

logger = logging.getLogger(__name__)

OUTBOX_LIMIT = 10_000
PUBLISH_BATCH = 64
MAX_BACKOFF_SECONDS = 10.0


@dataclass
class Sequence:
    prompt: list[int]
    output: list[int]
    scope: str = ""
    # When the publishing worker finished it, by that worker's clock (0: not known). Across hosts the
    # delivery time read from it carries the clocks' offset.
    finished_unix: float = 0.0
    # When this worker's subscriber received it (0: not received from the stream).
    received_unix: float = 0.0


class IndexSync:
    def __init__(self, address: str, namespace: str, origin: str):
        self.address = address
        self.namespace = namespace
        self.origin = origin
        self.inbox: collections.deque[Sequence] = collections.deque()
        self.outbox: queue.Queue[lookahead_pb2.Record] = queue.Queue(OUTBOX_LIMIT)
        self.caught_up = threading.Event()
        self.last_id = ""
        self.lag_seconds = 0.0
        self.received = 0
        self.published = 0
        self.dropped = 0
        self.connected = False
        self._unsent = 0
        self._stopping = threading.Event()
        # TLS and the key as the worker's --cache-service-tls-* and --cache-service-api-key say.
        self._channel = CacheServiceClient.from_environment().channel(
            address, options=[("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
                              ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT)])
        self._stub = lookahead_pb2_grpc.LookaheadIndexStub(self._channel)
        self._threads = [threading.Thread(target=self._subscribe_forever, name="lookahead-subscribe", daemon=True),
                         threading.Thread(target=self._publish_forever, name="lookahead-publish", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, flush_seconds: float = 2.0) -> None:
        """Gives sequences still waiting to be published a moment to go (a clean shutdown should not
        lose the last requests' outputs), then ends both threads."""
        deadline = time.monotonic() + flush_seconds
        while self.connected and self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stopping.set()
        self._channel.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(1.0)

    def publish(self, prompt: list[int], output: list[int], scope: str = "") -> None:
        record = lookahead_pb2.Record(prompt=prompt, output=output, origin=self.origin, created_unix=time.time(),
                                      scope=scope)
        try:
            self.outbox.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def pending(self) -> int:
        """Sequences not yet in the cache service: queued, or in a batch being retried."""
        return self.outbox.qsize() + self._unsent

    def _set_connected(self, connected: bool, why: str = "") -> None:
        if connected != self.connected:
            if connected:
                logger.info("lookahead index: connected to the cache service at %s", self.address)
            else:
                logger.warning("lookahead index: cache service at %s unavailable (%s); drafting from the "
                               "local index and retrying", self.address, why)
        self.connected = connected

    def _subscribe_forever(self) -> None:
        backoff = 0.25
        while not self._stopping.is_set():
            try:
                request = lookahead_pb2.SubscribeRequest(namespace=self.namespace, after_id=self.last_id)
                for response in self._stub.Subscribe(request):
                    self._set_connected(True)
                    backoff = 0.25
                    for record in response.records:
                        self.last_id = record.id
                        if record.origin == self.origin:
                            continue
                        now = time.time()
                        self.inbox.append(Sequence(list(record.prompt), list(record.output), record.scope,
                                                   record.created_unix, now))
                        self.received += 1
                        if record.created_unix:
                            self.lag_seconds = max(0.0, now - record.created_unix)
                    if response.caught_up:
                        self.caught_up.set()
            except grpc.RpcError as error:
                if self._stopping.is_set():
                    return
                self._set_connected(False, f"{error.code().name}: {error.details()}")
            except ValueError:  # the channel was closed by stop()
                return
            # An unreachable service must not hold up start-up: whoever waits for the backlog goes on.
            self.caught_up.set()
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _publish_forever(self) -> None:
        backoff = 0.25
        batch: list[lookahead_pb2.Record] = []
        size = 0  # the batch's bytes (ByteSize is not cached: each call encodes the record)
        # Taken from the outbox, with its size, but too large for the batch it met.
        held: tuple[lookahead_pb2.Record, int] | None = None
        while not self._stopping.is_set():
            if not batch:
                if held is None:
                    try:
                        record = self.outbox.get(timeout=0.5)
                    except queue.Empty:
                        continue
                    held = record, record.ByteSize()
                record, size = held
                held = None
                if size > LOOKAHEAD_BATCH_BYTES:  # no Publish could carry it
                    self.dropped += 1
                    logger.warning("lookahead index: a sequence of %d tokens is too large to publish; kept "
                                   "only by this worker", len(record.prompt) + len(record.output))
                    continue
                batch = [record]
            while held is None and len(batch) < PUBLISH_BATCH:
                try:
                    record = self.outbox.get_nowait()
                except queue.Empty:
                    break
                record_bytes = record.ByteSize()
                if size + record_bytes > LOOKAHEAD_BATCH_BYTES:
                    held = record, record_bytes
                else:
                    batch.append(record)
                    size += record_bytes
            self._unsent = len(batch) + (held is not None)
            try:
                self._stub.Publish(lookahead_pb2.PublishRequest(namespace=self.namespace, records=batch),
                                   timeout=5.0)
                self.published += len(batch)
                batch = []
                self._unsent = int(held is not None)
                backoff = 0.25
                self._set_connected(True)
            except grpc.RpcError as error:
                if self._stopping.is_set():
                    return
                self._set_connected(False, f"{error.code().name}: {error.details()}")
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            except ValueError:
                return
