"""Tenants end to end: one `taco_llm serve` with a keys file (three tenants) and a plain key, prefix-KV
offload on, real engine, real gRPC, the OpenAI SDK.

Isolation is shown by the engine's own count of cached prompt tokens (usage.prompt_tokens_details, from
vLLM's num_cached_tokens, which counts blocks loaded from the cache service too), not by timing: tenant
A's repeated prompt hits, tenant B's identical prompt never does, whatever cache_salt B sends.

The tests run in file order and share the stack; the rate-limited tenants are used nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from taco_llm.protos import engine_pb2, engine_pb2_grpc

from .support import Stack, free_port, start_stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 128  # vLLM's CPU block size, in tokens
ALICE_KEY = "sk-alice-6f1d0c2b9e8a4d7f"
BOB_KEY = "sk-bob-0a9b8c7d6e5f4a3b"
PLAIN_KEY = "sk-plain-5e4d3c2b1a09f8e7"
LIMITED_KEY = "sk-limited-1b2c3d4e5f60718"
TOKENS_KEY = "sk-tokens-9f8e7d6c5b4a3928"
KEYS_FILE = f"""\
alice: [{ALICE_KEY}]
bob:
  keys: [{BOB_KEY}]
limited:
  keys: [{LIMITED_KEY}]
  requests_per_minute: 2
tokens:
  keys: [{TOKENS_KEY}]
  tokens_per_minute: 50
"""
FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4", "--kv-cache-memory-bytes",
         "256M", "--seed", "0", "--enable-prefix-cache-offload", "--apc-offload-lookup-timeout", "3",
         "--disable-log-requests", "--max-log-len", "0"]
# Seen in no log (--disable-log-requests), whatever the requests carrying it did.
PROMPT_MARKER = "zebra-quartz-marker-4471"


def tokens(seed: int, count: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729 + i * i * 31) % 40000 for i in range(count)]


PROMPT = tokens(21, 2 * BLOCK + 40)  # two whole blocks, cached once computed


@pytest.fixture(scope="module")
def tenants_stack(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    keys.write_text(KEYS_FILE)
    stack = start_stack("serve-tenants", [*FLAGS, "--api-keys-file", str(keys), "--api-key", PLAIN_KEY,
                                          "--cache-service-port", str(free_port())], log_dir)
    yield stack
    code = stack.process.stop()
    assert code == 0, f"serve exited with {code}:\n{stack.process.tail()}"


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=300)


def cached(stack: Stack, key: str, salt: str | None = None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    reply = client(stack, key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                                  extra_body=extra)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return int(reply.usage.prompt_tokens_details.cached_tokens or 0)


def test_a_tenants_prompt_never_gives_another_tenant_a_kv_hit(tenants_stack: Stack) -> None:
    assert cached(tenants_stack, ALICE_KEY) == 0
    assert cached(tenants_stack, ALICE_KEY) == 2 * BLOCK, "the cache does not work for alice herself"
    # Bob: the same prompt with the salt alice's requests are sent with (tenant:alice:), with ones that
    # would spell it after the gateway's prefix, and with none.
    for salt in ("tenant:alice:", "alice:", ":", None):
        assert cached(tenants_stack, BOB_KEY, salt) == 0, f"bob hit alice's KV blocks with cache_salt {salt!r}"
    # Keys without a tenant share a namespace of their own, never a named tenant's.
    assert cached(tenants_stack, PLAIN_KEY, "tenant:alice:") == 0
    assert cached(tenants_stack, PLAIN_KEY) == 0
    # Bob's own repeat ("" is no salt, as None) hits: his misses were isolation, not a cold cache.
    assert cached(tenants_stack, BOB_KEY, "") == 2 * BLOCK
    # A client's own salt still separates its requests within its tenant.
    assert cached(tenants_stack, ALICE_KEY, "other") == 0
    assert cached(tenants_stack, ALICE_KEY, "other") == 2 * BLOCK


def test_chat_is_salted_too(tenants_stack: Stack) -> None:
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(90))}]

    def chat(key: str) -> int:
        reply = client(tenants_stack, key).chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                                   max_tokens=1, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return int(reply.usage.prompt_tokens_details.cached_tokens or 0)

    assert chat(ALICE_KEY) == 0 and chat(ALICE_KEY) >= BLOCK
    assert chat(BOB_KEY) == 0


def test_a_stored_response_is_its_tenants_alone(tenants_stack: Stack) -> None:
    # Knowing a response's id is not enough: another tenant, or the plain key's default tenant, finds
    # nothing under it, and cannot continue its conversation either.
    alice, bob, plain = (client(tenants_stack, key) for key in (ALICE_KEY, BOB_KEY, PLAIN_KEY))
    stored = alice.responses.create(model=MODEL, input="A secret for Alice.", max_output_tokens=2, temperature=0)
    assert alice.responses.retrieve(stored.id).id == stored.id
    for other in (bob, plain):
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(stored.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(stored.id)
        with pytest.raises(openai.BadRequestError) as refused:
            other.responses.create(model=MODEL, input="Go on.", previous_response_id=stored.id, max_output_tokens=2)
        assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert alice.responses.create(model=MODEL, input="Go on.", previous_response_id=stored.id,
                                  max_output_tokens=2).previous_response_id == stored.id


def test_only_the_operators_key_may_change_the_fleets_adapters(tenants_stack: Stack) -> None:
    # A named tenant is refused (403); the plain key gets past, to what this gateway says of runtime
    # LoRA: off, as it runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's server: no such route, 404).
    body = {"lora_name": "mine", "lora_path": "/tmp/none"}
    for key, status in ((ALICE_KEY, 403), (PLAIN_KEY, 404)):
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            reply = httpx.post(f"{tenants_stack.base_url}{route}", json=body, timeout=30,
                               headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == status, reply.text
            assert reply.json()["error"]["message"]


def test_unknown_key_is_refused_and_tenant_keys_do_not_reach_the_worker(tenants_stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as excinfo:
        client(tenants_stack, "sk-nobody").models.list()
    assert excinfo.value.status_code == 401
    # With tenants, serve gives the worker a key of its own: no tenant's key goes around the gateway.
    with grpc.insecure_channel(tenants_stack.grpc_address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as rpc_error:
            stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10,
                              metadata=(("authorization", f"Bearer {ALICE_KEY}"),))
        assert rpc_error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_requests_per_minute_429_with_retry_after_while_others_go_on(tenants_stack: Stack) -> None:
    limited = client(tenants_stack, LIMITED_KEY)
    for _ in range(2):
        limited.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as excinfo:
        limited.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    refused = excinfo.value.response
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "'limited'" in error["message"] and "--rate-limit-requests-per-minute" in error["message"]
    # Another tenant, and a key of the default tenant, are unaffected.
    assert client(tenants_stack, ALICE_KEY).completions.create(model=MODEL, prompt="Hello", max_tokens=1).choices
    assert client(tenants_stack, PLAIN_KEY).models.list().data


def test_tokens_per_minute_counts_usage_and_refuses_once_spent(tenants_stack: Stack) -> None:
    http = httpx.Client(base_url=tenants_stack.base_url, headers={"Authorization": f"Bearer {TOKENS_KEY}"},
                        timeout=300)
    # 60 prompt tokens: over the budget of 50 with the prompt alone, which is charged before the stream's
    # last chunk is sent (the completion tokens are charged as the stream closes, maybe after).
    body = {"model": MODEL, "prompt": tokens(5, 60), "max_tokens": 8, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200 and stream.headers["x-ratelimit-remaining-tokens"] == "50"
        assert "[DONE]" in "".join(stream.iter_text())
    # Spent until the minute is over.
    refused = http.post("/v1/completions", json={**body, "stream": False})
    assert refused.status_code == 429, refused.text
    assert "--rate-limit-tokens-per-minute" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 1


def test_no_key_or_prompt_in_the_logs(tenants_stack: Stack) -> None:
    client(tenants_stack, ALICE_KEY).completions.create(model=MODEL, prompt=f"Say {PROMPT_MARKER}", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client(tenants_stack, BOB_KEY).completions.create(model=MODEL, prompt=f"{PROMPT_MARKER}", max_tokens=2,
                                                          temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        client(tenants_stack, ALICE_KEY + "x").completions.create(model=MODEL, prompt=PROMPT_MARKER, max_tokens=2)
    log = tenants_stack.process.log.read_text()
    assert "taco_llm gateway: listening" in log, "the stack's log is not where this test reads it"
    for secret in (ALICE_KEY, BOB_KEY, PLAIN_KEY, LIMITED_KEY, TOKENS_KEY, PROMPT_MARKER):
        assert secret not in log, f"{secret!r} is in the stack's log"
