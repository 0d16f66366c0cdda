"""Per-tenant rate limits (per key for keys without a tenant): requests and tokens per minute.

- Requests count on admission, in a moving window (the `limits` library's moving window: exactly the
  last 60 s); a refused request does not count.
- Tokens (prompt + completion) count once they are known: a request's prompt tokens when its worker
  reports them at the end, its completion tokens when its stream closes (failover._Meter calls
  `charge_tokens`). A stream under way costs nothing until it ends, so a tenant's concurrent streams may
  overshoot its budget by their own size; the next request is then refused until the window frees.
  Tokens use a fixed one-minute window, since it records what was spent even past the budget, where a
  moving window would drop the excess.

Refusals are 429 with OpenAI's error JSON (type rate_limit_error, code rate_limit_exceeded), a
Retry-After in seconds until the window frees, and the x-ratelimit-* headers OpenAI sends; admitted
requests carry those headers too.

Counts live in this process's memory: with --api-server-count N each gateway process counts alone, so a
tenant gets up to N times its limits across them (the kernel spreads connections over the processes).
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

from .errors import APIError
from .tenants import RateLimits, Tenant

REQUESTS_FLAG = "--rate-limit-requests-per-minute"
TOKENS_FLAG = "--rate-limit-tokens-per-minute"

# What the request under way charges its tokens to: set by the auth middleware for each request, read
# by the tasks it spawns (contextvars are copied into them), None when tokens are not limited.
_TOKEN_SINK: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar(
    "taco_llm_token_sink", default=None)


def charge_tokens(count: int) -> None:
    """Counts `count` tokens against the limit of the request under way, if it has one."""
    sink = _TOKEN_SINK.get()
    if sink is not None and count > 0:
        sink(count)


@dataclass(frozen=True)
class Admission:
    """An admitted request: its x-ratelimit-* headers, and where its tokens are charged (None: nowhere)."""

    headers: dict[str, str]
    token_sink: Callable[[int], None] | None

    def charge_tokens_here(self) -> contextvars.Token[Callable[[int], None] | None]:
        return _TOKEN_SINK.set(self.token_sink)

    @staticmethod
    def done(token: contextvars.Token[Callable[[int], None] | None]) -> None:
        _TOKEN_SINK.reset(token)


def _seconds_until(epoch: float) -> int:
    return max(1, math.ceil(epoch - time.time()))


class RateLimiter:
    """The limits of every tenant, in this process's memory."""

    def __init__(self, defaults: RateLimits) -> None:
        self.defaults = defaults
        storage = MemoryStorage()
        self._requests = MovingWindowRateLimiter(storage)
        self._tokens = FixedWindowRateLimiter(storage)

    def admit(self, tenant: Tenant) -> Admission:
        """Counts one request of the tenant; raises a 429 APIError if a limit refuses it."""
        limits = tenant.limits(self.defaults)
        identity = tenant.limit_identity
        headers: dict[str, str] = {}
        token_sink: Callable[[int], None] | None = None
        if limits.tokens_per_minute:
            item = RateLimitItemPerMinute(limits.tokens_per_minute, namespace="tokens")
            stats = self._tokens.get_window_stats(item, identity)
            if not self._tokens.test(item, identity):
                raise self._refusal(tenant, f"{limits.tokens_per_minute} tokens per minute", TOKENS_FLAG,
                                    "tokens_per_minute", stats.reset_time)
            headers |= {"x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
                        "x-ratelimit-remaining-tokens": str(stats.remaining),
                        "x-ratelimit-reset-tokens": f"{_seconds_until(stats.reset_time)}s"}

            def token_sink(count: int) -> None:
                # Always recorded, even past the budget (a fixed window's hit adds before it compares).
                self._tokens.hit(item, identity, cost=count)

        if limits.requests_per_minute:
            item = RateLimitItemPerMinute(limits.requests_per_minute, namespace="requests")
            admitted = self._requests.hit(item, identity)
            stats = self._requests.get_window_stats(item, identity)
            if not admitted:
                raise self._refusal(tenant, f"{limits.requests_per_minute} requests per minute", REQUESTS_FLAG,
                                    "requests_per_minute", stats.reset_time)
            headers |= {"x-ratelimit-limit-requests": str(limits.requests_per_minute),
                        "x-ratelimit-remaining-requests": str(stats.remaining),
                        "x-ratelimit-reset-requests": f"{_seconds_until(stats.reset_time)}s"}
        return Admission(headers, token_sink)

    @staticmethod
    def _refusal(tenant: Tenant, limit: str, flag: str, file_key: str, reset_time: float) -> APIError:
        retry_after = _seconds_until(reset_time)
        return APIError(
            429, f"Rate limit reached for {tenant.label}: {limit} ({flag}, or {file_key} in the tenant's "
                 f"--api-keys-file entry); retry in {retry_after} s.",
            code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})
