"""Tenants: who an API key belongs to, and the server-side `cache_salt` that keeps tenants' KV apart.

Keys come from repeated `--api-key` values and from `--api-keys-file`:
- `--api-key NAME=KEY` gives tenant NAME the key KEY, when NAME matches [A-Za-z0-9_.-]+ and KEY is not
  empty and does not start with '='. Any other value is a plain key of the default (unnamed) tenant,
  taken whole: so `--api-key sk-abc` and base64 keys ending in '=' padding keep working. A plain key that
  would read as NAME=KEY goes in the keys file (or VLLM_API_KEY, which is always taken whole).
- `--api-keys-file PATH`, YAML or JSON: a mapping of tenant name to its keys, either a list or
  `{keys: [...], requests_per_minute: N, tokens_per_minute: N}` (the limits override the flags').

A key is looked up by comparing SHA-256 digests of equal length with hmac.compare_digest against every
key, never stopping at the first match: the time taken says neither how much of a guess was right nor
which key matched (beyond what the response itself says).

Isolation (`--tenant-isolation`, on by default; it matters only once some tenant is named): each request's
cache_salt becomes `tenant:<name>:<client's salt>` (`tenant::...` for the default tenant). vLLM mixes
the salt into the prefix-cache block hashes and the KV offload keys its blocks by them, so tenants never
share KV blocks; tenant names cannot contain ':', so no client salt can spell another tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]+")
SALT_PREFIX = "tenant:"
# Between the tenant's name and the client's salt; never in a tenant name, so the composition is injective.
SALT_SEPARATOR = ":"
KEYS_FILE_FLAG = "--api-keys-file"


class TenantConfigError(ValueError):
    """A keys file or --api-key value that cannot be used; the message names the flag and the entry."""


@dataclass(frozen=True)
class RateLimits:
    """Per minute; 0: no limit. None in a tenant's entry: the flags' values."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0


@dataclass(frozen=True)
class Tenant:
    # "" for the default tenant (keys given without a name).
    name: str
    # Who the rate limits count: the tenant, or for the default tenant each of its keys alone.
    limit_identity: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def limits(self, defaults: RateLimits) -> RateLimits:
        return RateLimits(
            defaults.requests_per_minute if self.requests_per_minute is None else self.requests_per_minute,
            defaults.tokens_per_minute if self.tokens_per_minute is None else self.tokens_per_minute,
        )

    @property
    def label(self) -> str:
        """How messages name the tenant (never by its key)."""
        return f"tenant {self.name!r}" if self.name else f"API key {self.limit_identity}"


# The tenant of requests when the gateway wants no key (rate limits alone).
ANONYMOUS = Tenant(name="", limit_identity="anonymous")


@dataclass(frozen=True)
class _Key:
    digest: bytes
    tenant: Tenant


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def split_api_key(value: str) -> tuple[str, str]:
    """(tenant name, key) of one --api-key value; the name is "" for a plain key (see the module doc)."""
    name, separator, key = value.partition("=")
    if separator and TENANT_NAME.fullmatch(name) and key and not key.startswith("="):
        return name, key
    return "", value


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    keys: list[str] = Field(min_length=1)
    requests_per_minute: int | None = Field(default=None, ge=0)
    tokens_per_minute: int | None = Field(default=None, ge=0)


def _location(error: ValidationError, tenant: str) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in (tenant, *first["loc"]))
    return f"{where}: {first['msg']}"


def read_keys_file(path: str) -> list[tuple[Tenant, list[str]]]:
    """The tenants of a keys file and their keys; raises TenantConfigError naming the flag and the entry."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TenantConfigError(f"{KEYS_FILE_FLAG} {path}: cannot be read ({error.strerror})") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TenantConfigError(f"{KEYS_FILE_FLAG} {path}: not valid YAML or JSON{where}") from None
    if not isinstance(data, dict) or not data:
        raise TenantConfigError(f"{KEYS_FILE_FLAG} {path}: expected a mapping of tenant name to its keys")
    tenants: list[tuple[Tenant, list[str]]] = []
    for name, entry in data.items():
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
            raise TenantConfigError(f"{KEYS_FILE_FLAG} {path}: tenant name {name!r} is not [A-Za-z0-9_.-]+")
        try:
            parsed = _TenantEntry.model_validate({"keys": entry} if isinstance(entry, list) else entry)
        except ValidationError as error:
            raise TenantConfigError(f"{KEYS_FILE_FLAG} {path}: {_location(error, name)}") from None
        for i, key in enumerate(parsed.keys):
            if not key:
                raise TenantConfigError(f"{KEYS_FILE_FLAG} {path}: {name}.keys.{i}: a key cannot be empty")
        tenant = Tenant(name=name, limit_identity=f"tenant:{name}",
                        requests_per_minute=parsed.requests_per_minute, tokens_per_minute=parsed.tokens_per_minute)
        tenants.append((tenant, parsed.keys))
    return tenants


class ApiKeys:
    """Every accepted key and its tenant."""

    def __init__(self, entries: Iterable[tuple[Tenant, str]]) -> None:
        self._keys: list[_Key] = []
        seen: dict[bytes, str] = {}
        for tenant, key in entries:
            digest = _digest(key.encode())
            owner = tenant.name or "the default tenant"
            if digest in seen and seen[digest] != owner:
                # Which tenant a request belongs to must not depend on the order of the keys.
                raise TenantConfigError(f"one API key is given to both {seen[digest]} and {owner}")
            seen[digest] = owner
            self._keys.append(_Key(digest, tenant))

    @classmethod
    def from_flags(cls, api_keys: Sequence[str], keys_file: str | None = None, *,
                   environment_key: str | None = None) -> ApiKeys:
        """`api_keys`: the --api-key values; `environment_key`: VLLM_API_KEY, used when none is given and
        always taken whole."""
        entries: list[tuple[Tenant, str]] = []
        tenants: dict[str, Tenant] = {}
        values = [(value, True) for value in api_keys] or ([(environment_key, False)] if environment_key else [])
        for index, (value, may_name) in enumerate(values, start=1):
            name, key = split_api_key(value) if may_name else ("", value)
            if not key:
                raise TenantConfigError(f"--api-key #{index} is empty")
            if name:
                tenant = tenants.setdefault(name, Tenant(name=name, limit_identity=f"tenant:{name}"))
            else:
                tenant = Tenant(name="", limit_identity=f"#{index}")
            entries.append((tenant, key))
        if keys_file:
            for tenant, keys in read_keys_file(keys_file):
                if tenant.name in tenants:
                    raise TenantConfigError(f"{KEYS_FILE_FLAG} {keys_file}: tenant {tenant.name!r} is also "
                                            "given by --api-key; name each tenant in one place")
                tenants[tenant.name] = tenant
                entries += [(tenant, key) for key in keys]
        return cls(entries)

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def named(self) -> bool:
        """Whether any key belongs to a named tenant (isolation matters only then)."""
        return any(key.tenant.name for key in self._keys)

    @property
    def has_limits(self) -> bool:
        """Whether some tenant has rate limits of its own (from the keys file)."""
        return any(key.tenant.requests_per_minute or key.tenant.tokens_per_minute for key in self._keys)

    def tenant_of(self, token: bytes) -> Tenant | None:
        digest = _digest(token)
        found: Tenant | None = None
        for key in self._keys:
            # Every key is compared, whatever matched before: no early exit to time.
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key.tenant
        return found


def cache_salt(tenant: Tenant, client_salt: str | None) -> str:
    """The cache_salt sent to the engine for a tenant's request under --tenant-isolation (see the module
    doc): injective in (tenant, client salt), since names hold no SALT_SEPARATOR."""
    return f"{SALT_PREFIX}{tenant.name}{SALT_SEPARATOR}{client_salt or ''}"


def serve_keys(values: Sequence[str], keys_file: str | None,
               environment_key: str | None) -> tuple[str | None, str | None]:
    """For `taco_llm serve`: (the key of the hops behind the gateway, a client key for serve's readiness
    probe). One key given stays the key of every hop, as before tenants. Several keys, or a keys file,
    get the hops a fresh random key of their own: no tenant's key then reaches a worker's gRPC directly,
    around the gateway's tenant salts and rate limits. A bad keys file is refused here, before anything
    starts (TenantConfigError)."""
    from_file = read_keys_file(keys_file) if keys_file else []
    if not from_file and len(values) <= 1:
        key = values[0] if values else environment_key
        return key, split_api_key(key)[1] if values and key else key
    probe = split_api_key(values[0])[1] if values else environment_key or from_file[0][1][0]
    return secrets.token_urlsafe(32), probe
