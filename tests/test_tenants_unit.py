"""Tenants, their keys and rate limits, without an engine: the keys' parsing and lookup, the keys file's
refusals, the cache_salt composition, and the rate limits on a fake clock (the `limits` library's
memory storage reads time.time, replaced here)."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from taco_llm.gateway import rate_limits
from taco_llm.gateway.__main__ import parse
from taco_llm.gateway.app import GatewaySettings, create_app
from taco_llm.gateway.errors import APIError
from taco_llm.gateway.rate_limits import RateLimiter, charge_tokens
from taco_llm.gateway.tenants import (
    ApiKeys,
    RateLimits,
    Tenant,
    TenantConfigError,
    cache_salt,
    read_keys_file,
    split_api_key,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    import limits.storage.memory

    fake = FakeClock()
    monkeypatch.setattr(limits.storage.memory, "time", types.SimpleNamespace(time=fake.time))
    monkeypatch.setattr(rate_limits, "time", types.SimpleNamespace(time=fake.time))
    return fake


# --- keys and tenants ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("alice=sk-1", ("alice", "sk-1")),
    ("team.a_b-c=k=with=equals", ("team.a_b-c", "k=with=equals")),
    ("sk-plain", ("", "sk-plain")),
    ("c2VjcmV0=", ("", "c2VjcmV0=")),       # base64 padding: KEY part empty
    ("c2VjcmV0cw==", ("", "c2VjcmV0cw==")),  # KEY part starts with '='
    ("=abc", ("", "=abc")),                  # no name
    ("sk/x=abc", ("", "sk/x=abc")),          # '/' cannot be in a tenant name
])
def test_split_api_key(value: str, expected: tuple[str, str]) -> None:
    assert split_api_key(value) == expected


def test_lookup_finds_each_key_and_refuses_others() -> None:
    keys = ApiKeys.from_flags(["alice=ka1", "alice=ka2", "bob=kb", "plain-one", "plain-two"])
    assert keys.named
    alice = keys.tenant_of(b"ka1")
    assert alice is not None and alice.name == "alice" and keys.tenant_of(b"ka2") == alice
    bob = keys.tenant_of(b"kb")
    assert bob is not None and bob.name == "bob"
    one, two = keys.tenant_of(b"plain-one"), keys.tenant_of(b"plain-two")
    assert one is not None and two is not None and one.name == two.name == ""
    # Keys without a tenant are limited each alone.
    assert one.limit_identity != two.limit_identity
    for wrong in (b"", b"ka", b"ka1 ", b"alice=ka1", b"KA1", b"kb" * 100):
        assert keys.tenant_of(wrong) is None


def test_environment_key_is_taken_whole_and_only_without_flags() -> None:
    keys = ApiKeys.from_flags([], environment_key="alice=secret")
    assert not keys.named and keys.tenant_of(b"alice=secret") is not None and keys.tenant_of(b"secret") is None
    flag_wins = ApiKeys.from_flags(["flag-key"], environment_key="env-key")
    assert flag_wins.tenant_of(b"env-key") is None and flag_wins.tenant_of(b"flag-key") is not None


def test_one_key_for_two_tenants_is_refused() -> None:
    with pytest.raises(TenantConfigError, match="both alice and bob"):
        ApiKeys.from_flags(["alice=same", "bob=same"])


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_keys_file_yaml_and_json(tmp_path: Path) -> None:
    yaml_path = _write(tmp_path, "keys.yaml", "alice: [ka1, ka2]\nbob:\n  keys: [kb]\n  requests_per_minute: 5\n"
                                              "  tokens_per_minute: 100\n")
    tenants = {tenant.name: (tenant, keys) for tenant, keys in read_keys_file(yaml_path)}
    assert tenants["alice"][1] == ["ka1", "ka2"] and tenants["alice"][0].requests_per_minute is None
    bob = tenants["bob"][0]
    assert bob.limits(RateLimits(60, 0)) == RateLimits(5, 100)
    assert tenants["alice"][0].limits(RateLimits(60, 0)) == RateLimits(60, 0)
    json_path = _write(tmp_path, "keys.json", json.dumps({"carol": {"keys": ["kc"]}}))
    keys = ApiKeys.from_flags(["plain"], json_path)
    carol = keys.tenant_of(b"kc")
    assert carol is not None and carol.name == "carol" and keys.tenant_of(b"plain") is not None


@pytest.mark.parametrize(("text", "message"), [
    ("alice: [ka\n  bob", "not valid YAML or JSON at line"),
    ("- a\n- b\n", "expected a mapping of tenant name to its keys"),
    ("'al ice': [k]\n", "tenant name 'al ice' is not"),
    ("alice: []\n", "alice.keys: List should have at least 1 item"),
    ("alice: {keys: [k], requests_per_minute: -1}\n", "alice.requests_per_minute"),
    ("alice: {keys: [k], rpm: 3}\n", "alice.rpm: Extra inputs are not permitted"),
    ("alice: {keys: [1]}\n", "alice.keys.0"),
    ("alice: ['']\n", "alice.keys.0: a key cannot be empty"),
])
def test_keys_file_refusals_name_the_flag_and_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, "keys.yaml", text)
    with pytest.raises(TenantConfigError) as excinfo:
        read_keys_file(path)
    assert str(excinfo.value).startswith(f"--api-keys-file {path}: ") and message in str(excinfo.value)


def test_gateway_refuses_a_bad_keys_file_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "keys.yaml", "alice: {keys: [k], tokens_per_minute: many}\n")
    with pytest.raises(SystemExit) as excinfo:
        parse(["--engine", "127.0.0.1:1", "--api-keys-file", path])
    assert excinfo.value.code == 2
    assert f"--api-keys-file {path}: alice.tokens_per_minute" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--engine", "127.0.0.1:1", "--api-keys-file", str(tmp_path / "missing.yaml")])
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--engine", "127.0.0.1:1", "--rate-limit-requests-per-minute", "-1"])
    assert "--rate-limit-requests-per-minute -1 is negative" in capsys.readouterr().err


def test_gateway_flags_make_settings(tmp_path: Path) -> None:
    path = _write(tmp_path, "keys.yaml", "bob: [kb]\n")
    settings = parse(["--engine", "127.0.0.1:1", "--api-key", "alice=ka", "--api-key", "plain",
                      "--api-keys-file", path, "--no-tenant-isolation", "--rate-limit-tokens-per-minute", "7"])
    assert settings.api_keys is not None and settings.api_keys.named
    assert settings.tenant_isolation is False and settings.rate_limits == RateLimits(0, 7)
    assert parse(["--engine", "127.0.0.1:1"]).api_keys is None


def test_cache_salt_is_injective_across_tenants() -> None:
    alice, bob, default = (Tenant(name=n, limit_identity=n) for n in ("alice", "bob", ""))
    assert cache_salt(alice, None) == cache_salt(alice, "") == "tenant:alice:"
    # Whatever salt bob (or a key of the default tenant) sends, it never spells alice's.
    assert cache_salt(bob, cache_salt(alice, None)) != cache_salt(alice, None)
    assert cache_salt(default, "alice:") != cache_salt(alice, None)
    assert cache_salt(default, "tenant:alice:") != cache_salt(alice, None)
    salts = {cache_salt(t, s) for t in (alice, bob, default) for s in ("", "x", "alice:", ":x", "tenant:bob:")}
    assert len(salts) == 15


# --- rate limits --------------------------------------------------------------------------------------

ALICE = Tenant(name="alice", limit_identity="tenant:alice")
BOB = Tenant(name="bob", limit_identity="tenant:bob")


def _refusal(limiter: RateLimiter, tenant: Tenant) -> APIError:
    with pytest.raises(APIError) as excinfo:
        limiter.admit(tenant)
    return excinfo.value


def test_requests_per_minute_refuses_then_frees(clock: FakeClock) -> None:
    limiter = RateLimiter(RateLimits(requests_per_minute=3))
    for remaining in (2, 1, 0):
        admission = limiter.admit(ALICE)
        assert admission.headers["x-ratelimit-remaining-requests"] == str(remaining)
        assert admission.headers["x-ratelimit-limit-requests"] == "3"
        clock.now += 10
    refusal = _refusal(limiter, ALICE)
    body = refusal.body()["error"]
    assert refusal.status == 429 and isinstance(body, dict)
    assert body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded"
    assert "--rate-limit-requests-per-minute" in body["message"] and "'alice'" in body["message"]
    # The first request leaves the moving window 60 s after it came, 30 s from now.
    assert refusal.headers["Retry-After"] == "30"
    limiter.admit(BOB)  # another tenant is unaffected
    clock.now += 30.5
    limiter.admit(ALICE)


def test_tokens_count_when_known_and_refuse_once_over(clock: FakeClock) -> None:
    limiter = RateLimiter(RateLimits(tokens_per_minute=100))
    admission = limiter.admit(ALICE)
    assert admission.token_sink is not None
    token = admission.charge_tokens_here()
    try:
        charge_tokens(60)
        charge_tokens(70)  # past the budget: still recorded
    finally:
        admission.done(token)
    charge_tokens(1000)  # outside any request: charged to nobody
    refusal = _refusal(limiter, ALICE)
    assert "--rate-limit-tokens-per-minute" in str(refusal.body()) and refusal.headers["Retry-After"] == "60"
    assert limiter.admit(BOB).headers["x-ratelimit-remaining-tokens"] == "100"
    clock.now += 61
    assert limiter.admit(ALICE).headers["x-ratelimit-remaining-tokens"] == "100"


def test_tenant_limits_override_the_flags(clock: FakeClock) -> None:
    limiter = RateLimiter(RateLimits(requests_per_minute=1))
    generous = Tenant(name="g", limit_identity="tenant:g", requests_per_minute=0)
    for _ in range(5):
        limiter.admit(generous)
    limiter.admit(ALICE)
    _refusal(limiter, ALICE)


@pytest.fixture
def limited_app(clock: FakeClock) -> Iterator[TestClient]:
    settings = GatewaySettings(engines=["127.0.0.1:1"], api_keys=ApiKeys.from_flags(["alice=ka", "bob=kb"]),
                               rate_limits=RateLimits(requests_per_minute=2))
    with TestClient(create_app(settings)) as client:
        yield client


def test_http_429_with_retry_after_and_headers(limited_app: TestClient) -> None:
    alice = {"Authorization": "Bearer ka"}
    first = limited_app.get("/version", headers=alice)
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "1"
    limited_app.get("/version", headers=alice)
    refused = limited_app.get("/version", headers=alice)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert limited_app.get("/version", headers={"Authorization": "Bearer kb"}).status_code == 200
    # /health needs no key and is not counted.
    assert all(limited_app.get("/health").status_code != 429 for _ in range(5))
