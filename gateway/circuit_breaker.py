"""A circuit breaker per worker: after a run of worker faults the gateway stops sending it requests for a
cool-down, then lets one trial request through to see whether it has recovered.

Pure structure, no gRPC and no clock of its own (every call takes `now`), so tests drive time directly.

States and invariant:
- CLOSED: requests flow; `failures` counts the worker faults in a row, always below `threshold`.
- OPEN: no request is routed until `opened_at + cooldown`; then the breaker reads as HALF_OPEN.
- HALF_OPEN: one trial request at a time (`trial_since` is set while it is out); its success closes the
  breaker and resets the cool-down to `base_cooldown`, its failure reopens it with the cool-down doubled
  (never above `max_cooldown`). A trial whose request ends with no outcome (its client left, or its
  stream was closed before the worker answered) gives its slot back at once (`abandon`); one whose
  outcome never comes back at all (its caller vanished) frees it after `trial_timeout`, so the breaker
  cannot stay shut forever.
`base_cooldown <= cooldown <= max_cooldown` always holds.

Only worker faults are fed in as failures: the caller decides what a fault is (failover.is_worker_fault), and
a client's bad input must never count, or a flood of bad requests would open every breaker of a fleet.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

DEFAULT_THRESHOLD = 3
DEFAULT_BASE_COOLDOWN = 5.0
DEFAULT_MAX_COOLDOWN = 60.0
DEFAULT_TRIAL_TIMEOUT = 30.0

class BreakerState(enum.IntEnum):
    # The values are CIRCUIT_STATE's: 0 closed, 1 half-open, 2 open.
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass
class CircuitBreaker:
    threshold: int = DEFAULT_THRESHOLD
    base_cooldown: float = DEFAULT_BASE_COOLDOWN
    max_cooldown: float = DEFAULT_MAX_COOLDOWN
    trial_timeout: float = DEFAULT_TRIAL_TIMEOUT
    failures: int = 0
    cooldown: float = 0.0
    opened_at: float | None = None
    trial_since: float | None = None
    # Trials sent so far: the one out while `trial_since` is set is number `trials`.
    trials: int = 0

    def __post_init__(self) -> None:
        if self.threshold < 1 or self.base_cooldown <= 0 or self.max_cooldown < self.base_cooldown:
            raise ValueError("a breaker needs threshold >= 1 and 0 < base_cooldown <= max_cooldown")
        self.cooldown = self.cooldown or self.base_cooldown

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if now < self.opened_at + self.cooldown:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allows(self, now: float) -> bool:
        """Whether a request may be routed to the worker now (half-open: only while no trial is out)."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        return self.trial_since is None or now >= self.trial_since + self.trial_timeout

    def routed(self, now: float) -> None:
        """A request was sent: in half-open it is the trial."""
        if self.state(now) is BreakerState.HALF_OPEN:
            self.trial_since = now
            self.trials += 1

    def trial_out(self) -> int | None:
        """The number of the trial request out now, None if none. Read right after routing a request to
        this worker (with no await between), it says whether that request is the trial: a breaker lets a
        request through while a trial is out only by making it the new trial."""
        return self.trials if self.trial_since is not None else None

    def abandon(self, trial: int) -> None:
        """Trial `trial` ended with no outcome (its client left, or its stream was closed before the worker
        answered): its slot is free for the next request at once, not after `trial_timeout`. A later
        trial (this one timed out and was replaced) keeps its slot."""
        if self.trial_since is not None and self.trials == trial:
            self.trial_since = None

    def record(self, now: float, *, worker_fault: bool) -> BreakerState:
        """Feeds one request's outcome; returns the state after it."""
        state = self.state(now)
        if not worker_fault:
            if state is BreakerState.OPEN:
                # A late answer to a request sent before the breaker opened: the cool-down stands (only
                # the half-open trial may close it).
                return state
            # The worker answered (even a refusal of bad input is an answer): the run of faults is over.
            self.failures = 0
            if state is not BreakerState.CLOSED:
                self.opened_at = None
                self.trial_since = None
                self.cooldown = self.base_cooldown
            return self.state(now)
        if state is BreakerState.OPEN:
            # A late outcome of a request sent before the breaker opened: already counted as a reason.
            return state
        if state is BreakerState.HALF_OPEN:
            self.cooldown = min(self.cooldown * 2, self.max_cooldown)
            self._open(now)
            return self.state(now)
        self.failures += 1
        if self.failures >= self.threshold:
            self._open(now)
        return self.state(now)

    def remaining(self, now: float) -> float:
        """Seconds until an open breaker lets a trial through (0 unless open)."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.cooldown - now)

    def retry_after(self, now: float) -> int:
        """Retry-After for a client whom only this breaker keeps out: whole seconds, at least 1."""
        return max(1, math.ceil(self.remaining(now)))

    def _open(self, now: float) -> None:
        self.opened_at = now
        self.trial_since = None
        self.failures = 0
