"""How long a draft is worth drafting: an estimate of the chance that each drafted token is accepted.

The rule: a drafted token costs compute in the verify pass whether or not it is accepted; an accepted
one saves a whole engine step. So the i-th token of a draft pays for itself when the chance that it
and every token before it are accepted exceeds (a drafted token's cost / a step's cost), and at batch
B an accepted token saves only its own request's share of the step: the bar is that ratio times B.
The ratio is the platform's (`draft_token_cost` below); the measurements behind each default are in
docs/benchmarks.md ("What a drafted token costs").

The chance per token is the request's recent acceptance rate (accepted tokens against drafts cut short
by a rejection, the estimate for a geometric run of acceptances) times how strongly the index's
occurrences agree on that token. A request with no evidence of its own starts from the rate across all
requests lately. Counts decay every step, so a request whose drafts keep failing soon stops drafting,
and one that stopped tries again a few steps later as the evidence fades. The rate across requests
fades per engine step too, not per verdict: once every request has stopped drafting there are no more
verdicts, and a rate that faded only with them would stay below the bar for good.
"""

from __future__ import annotations

from dataclasses import dataclass

# A drafted token's cost as a share of one decoding step at batch 1, by vLLM device type. The cost of
# verifying a few more tokens is compute, while a step at small batch is bound by reading the weights:
# on a CPU compute is scarce and a token costs a visible share; on a GPU it is nearly free. Platforms
# not listed take the CPU's figure, the cautious side (a draft stops sooner, never slower than none).
# The CPU's is measured; the GPU's is a roofline estimate until bench/draft_token_cost.py runs on one.
DRAFT_TOKEN_COST_BY_DEVICE = {"cpu": 0.06, "cuda": 0.01}
STEP_DECAY = 0.85        # per decoding step of the request
PRIOR_WEIGHT = 0.5       # how many observations the prior counts as
# Per engine step, across all requests: the prior for a new request (chosen on the replay,
# docs/benchmarks.md).
GLOBAL_STEP_DECAY = 0.99
FIRST_PRIOR = 0.5
GLOBAL_PRIOR_WEIGHT = 2.0


def draft_token_cost(device_type: str, configured: float | None = None) -> float:
    """The least cumulative chance of acceptance at which a draft goes on at batch 1: the config's
    `draft_token_cost` where set, else the device type's default."""
    if configured is not None:
        return configured
    return DRAFT_TOKEN_COST_BY_DEVICE.get(device_type, DRAFT_TOKEN_COST_BY_DEVICE["cpu"])


@dataclass(slots=True)
class AcceptanceRate:
    """Decayed counts of accepted draft tokens and of rejections (at most one per draft)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted += accepted
        if accepted < drafted:
            self.rejected += 1.0

    def decay(self, factor: float) -> None:
        self.accepted *= factor
        self.rejected *= factor

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior_weight * prior) / (self.accepted + self.rejected + prior_weight)


class GlobalAcceptance:
    """The acceptance rate across every request lately: where a new request's estimate starts."""

    def __init__(self) -> None:
        self.counts = AcceptanceRate()

    def observe(self, drafted: int, accepted: int) -> None:
        self.counts.observe(drafted, accepted)

    def fade(self) -> None:
        self.counts.decay(GLOBAL_STEP_DECAY)

    def rate(self) -> float:
        return self.counts.rate(FIRST_PRIOR, GLOBAL_PRIOR_WEIGHT)
