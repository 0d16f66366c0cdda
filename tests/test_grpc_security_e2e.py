"""Keys and mutual TLS on every gRPC hop, between real processes, with certificates made at test time.

A cache service with --api-key and mutual TLS; one engine worker with mutual TLS and a key on its own
port, which offloads prefix-KV blocks to that cache service as a TLS client with the service's key; and a
gateway that reaches the worker with --engine-tls-* and --engine-api-key. The openai SDK talks to the
gateway. One engine start in all.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.grpc_security import CacheServiceClient, ClientTls
from taco_llm.protos import engine_pb2, engine_pb2_grpc, kv_cache_pb2, kv_cache_pb2_grpc, rich_status
from taco_llm.protos.kv_cache_limits import CHUNK_BYTES
from taco_llm.protos.rich_status import Reason

from .certificates import Certificates, make_certificates
from .support import Process, free_port, http_status, start, wait_until

CACHE_KEY = "cache-service-key"
WORKER_KEY = "worker-key"
MODEL = "SmolLM2-135M-Instruct"
BLOCK = 128  # vLLM's CPU block size, in tokens
# vLLM's own KV cache holds 12 blocks (float32, 5.9 MB each): two 8-block prompts push a short prompt out
# of it, so that its next run loads the blocks back from the cache service (as tests/test_kv_offload.py).
SMALL_KV = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "2", "--kv-cache-memory-bytes",
            "72000000", "--seed", "0"]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("grpc-certs"))


def secure(address: str, tls: ClientTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.credentials())


def trusted(certs: Certificates) -> ClientTls:
    return ClientTls(str(certs.ca), str(certs.client_cert), str(certs.client_key))


def health_code(address: str, tls: ClientTls | None) -> grpc.StatusCode:
    """The health service needs no key, so this fails only on the connection (TLS, certificates)."""
    with secure(address, tls) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def refused_connections(address: str, certs: Certificates) -> dict[str, grpc.StatusCode]:
    return {
        "plain text": health_code(address, None),
        "no client certificate": health_code(address, ClientTls(str(certs.ca))),
        "a stranger's certificate": health_code(
            address, ClientTls(str(certs.ca), str(certs.stranger_cert), str(certs.stranger_key))),
    }


@pytest.fixture(scope="module")
def cache_service(certs: Certificates, log_dir: Path) -> Iterator[str]:
    port = free_port()
    process = start("cache-service-mtls", [
        "cache-service", "--grpc-port", str(port), "--memory", "256M", "--api-key", CACHE_KEY,
        "--grpc-tls-certfile", str(certs.server_cert), "--grpc-tls-keyfile", str(certs.server_key),
        "--grpc-tls-client-ca", str(certs.ca)], log_dir)
    address = f"127.0.0.1:{port}"
    wait_until(process, lambda: health_code(address, trusted(certs)) == grpc.StatusCode.OK, timeout=60)
    yield address
    assert process.stop() == 0, process.tail()
    assert CACHE_KEY not in process.log.read_text(), "the key was logged"


def _block(key: bytes, data: bytes) -> Iterator[kv_cache_pb2.PutBlocksChunk]:
    header = kv_cache_pb2.BlockHeader(key=key, size=len(data), num_segments=1, checksum=zlib.crc32(data))
    yield kv_cache_pb2.PutBlocksChunk(start=kv_cache_pb2.BlockStart(header=header, data=data[:CHUNK_BYTES]))


def test_cache_service_refuses_connections_without_a_certificate_its_ca_signed(
        cache_service: str, certs: Certificates) -> None:
    refused = refused_connections(cache_service, certs)
    assert refused == dict.fromkeys(refused, grpc.StatusCode.UNAVAILABLE)


def test_cache_service_refuses_calls_without_its_key(cache_service: str, certs: Certificates) -> None:
    with secure(cache_service, trusted(certs)) as channel:
        store = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as error:
                store.Stats(kv_cache_pb2.StatsRequest(), metadata=metadata, timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            details = rich_status.details_of(error.value)
            assert (details.reason, details.field) == (Reason.Name(Reason.API_KEY_INVALID), "authorization")
            assert "--api-key" in error.value.details()  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as error:  # a streaming call too, before it reads a byte
            store.PutBlocks(_block(os.urandom(32), b"x" * 64), timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        with_key = (("authorization", f"Bearer {CACHE_KEY}"),)
        assert store.Stats(kv_cache_pb2.StatsRequest(), metadata=with_key, timeout=10).num_blocks == 0, \
            "nothing was stored"


def test_cache_service_with_key_and_certificate_stores_and_returns_a_block(
        cache_service: str, certs: Certificates) -> None:
    # The worker's own client: the settings as they cross into vLLM's engine processes, the key added
    # to every call by the channel.
    client = CacheServiceClient(CACHE_KEY, trusted(certs))
    channel = client.channel(cache_service)
    try:
        store = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        key, data = os.urandom(32), os.urandom(5000)
        assert store.PutBlocks(_block(key, data), timeout=10).num_stored == 1
        messages = list(store.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=[key]), timeout=10))
        assert b"".join(m.block_bytes.data for m in messages[1:]) == data
    finally:
        channel.close()


@pytest.fixture(scope="module")
def secured_stack(cache_service: str, certs: Certificates, model_dir: Path,
                  log_dir: Path) -> Iterator[tuple[str, str, Process]]:
    """A worker (mutual TLS and a key on its port; offload to the TLS cache service with its key) and a
    gateway in front of it: the worker's address, the gateway's URL, and the worker's process."""
    worker_port, gateway_port = free_port(), free_port()
    worker = start("worker-mtls", [
        "worker", "--grpc-port", str(worker_port), *SMALL_KV, "--api-key", WORKER_KEY,
        "--grpc-tls-certfile", str(certs.server_cert), "--grpc-tls-keyfile", str(certs.server_key),
        "--grpc-tls-client-ca", str(certs.ca),
        "--enable-prefix-cache-offload", "--apc-offload-lookup-timeout", "3", "--cache-service", cache_service,
        "--cache-service-api-key", CACHE_KEY, "--cache-service-tls-ca", str(certs.ca),
        "--cache-service-tls-certfile", str(certs.client_cert), "--cache-service-tls-keyfile",
        str(certs.client_key)], log_dir)
    worker_address = f"127.0.0.1:{worker_port}"
    gateway: Process | None = None
    try:
        wait_until(worker, lambda: health_code(worker_address, trusted(certs)) == grpc.StatusCode.OK)
        gateway = start("gateway-mtls", [
            "gateway", "--engine", worker_address, "--port", str(gateway_port), "--engine-api-key", WORKER_KEY,
            "--engine-tls-ca", str(certs.ca), "--engine-tls-certfile", str(certs.client_cert),
            "--engine-tls-keyfile", str(certs.client_key)], log_dir)
        base_url = f"http://127.0.0.1:{gateway_port}"
        wait_until(gateway, lambda: http_status(f"{base_url}/health") == 200, timeout=60)
        yield worker_address, base_url, worker
    finally:
        try:
            gateway_code = gateway.stop() if gateway is not None else 0
        finally:
            worker_code = worker.stop()  # whatever became of the gateway
    # uvicorn shuts down gracefully, then re-raises SIGTERM: -15 is the gateway's clean exit.
    assert gateway_code in (0, -15) and worker_code == 0, worker.tail()
    for process in (gateway, worker):
        if process is not None:
            log = process.log.read_text()
            assert CACHE_KEY not in log and WORKER_KEY not in log, f"{process.name} logged a key"


def tokens(seed: int, count: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(count)]


def test_openai_sdk_through_the_gateway_over_mutual_tls_and_offload_to_the_tls_cache_service(
        secured_stack: tuple[str, str, Process], cache_service: str, certs: Certificates) -> None:
    _, base_url, worker = secured_stack
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def cached_tokens(prompt: list[int]) -> tuple[str, int]:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
        details = reply.usage.prompt_tokens_details
        return reply.choices[0].text, details.cached_tokens or 0 if details is not None else 0

    with secure(cache_service, trusted(certs)) as channel:
        store = kv_cache_pb2_grpc.KVBlockStoreStub(channel)

        def stats() -> kv_cache_pb2.StatsResponse:
            return store.Stats(kv_cache_pb2.StatsRequest(), metadata=(("authorization", f"Bearer {CACHE_KEY}"),),
                               timeout=10)

        before = stats()
        prompt = tokens(1, 3 * BLOCK + 20)  # 3 full blocks
        text, cached = cached_tokens(prompt)
        assert text and cached == 0
        # The worker saves a request's full blocks as its prefill completes: over TLS, with the key.
        wait_until(worker, lambda: stats().blocks_stored - before.blocks_stored >= 3, timeout=30)
        for seed in (2, 3):
            client.completions.create(model=MODEL, prompt=tokens(seed, 7 * BLOCK + 5), max_tokens=1)
        loaded = stats()
        again, cached = cached_tokens(prompt)
        after = stats()
    assert again == text, "the blocks loaded back changed the greedy output"
    assert cached == 3 * BLOCK, "the prompt was not loaded back from the cache service"
    assert after.blocks_served - loaded.blocks_served == 3 and after.lookups > before.lookups
    log = worker.log.read_text()
    assert "UNAUTHENTICATED" not in log and "UNAVAILABLE" not in log, log[-3000:]


def test_worker_port_refuses_plain_text_and_strangers(secured_stack: tuple[str, str, Process],
                                                      certs: Certificates) -> None:
    worker_address = secured_stack[0]
    refused = refused_connections(worker_address, certs)
    assert refused == dict.fromkeys(refused, grpc.StatusCode.UNAVAILABLE)
    with secure(worker_address, trusted(certs)) as channel:  # the right certificate, but no key
        with pytest.raises(grpc.RpcError) as error:
            engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def test_worker_with_an_unreadable_tls_file_exits_naming_the_flag(
        certs: Certificates, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The worker's own parser, in this process: vLLM is imported once for the suite, not again here.
    from taco_llm.engine_worker.frontend.args import parse

    absent = tmp_path / "absent.pem"
    with pytest.raises(SystemExit) as exited:
        parse(["--grpc-tls-certfile", str(certs.server_cert), "--grpc-tls-keyfile", str(absent)])
    assert exited.value.code != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--grpc-tls-keyfile" in last and str(absent) in last, last
