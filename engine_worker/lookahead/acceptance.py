"""How long a draft is worth drafting: an estimate of the chance that each drafted token is accepted.

A drafted token costs compute in the verify pass whether or not it is accepted; an accepted one saves a
whole engine step. Measured on these 2-core CPUs with the bundled model (float32, eager; ngram drafts on
a counting prompt that accepts everything): a step costs about 35 ms whether it carries 1 or 4
requests, and each drafted token adds about 2 ms (batch 1: 28 tok/s with no drafts, 189 with 7-token
drafts, 294 with 24; batch 4: 115, 338 and 456). So the i-th token of a draft pays for itself when the
chance that it and every token before it are accepted is above about 2/35: the draft stops there.

The chance per token is the request's recent acceptance rate (accepted tokens against drafts cut short
by a rejection, the estimate for a geometric run of acceptances) times how strongly the index's
occurrences agree on that token. Counts decay every step, so a request whose drafts keep failing soon
stops drafting, and one that stopped tries again a few steps later as the evidence fades.
"""

from __future__ import annotations

from dataclasses import dataclass

# A drafted token's cost over a step's (2 ms / 35 ms, above), rounded up: the least cumulative chance of
# acceptance at which a draft goes on.
MIN_WORTHWHILE_CHANCE = 0.06
STEP_DECAY = 0.85        # per decoding step of the request
PRIOR_WEIGHT = 0.5       # how many observations the prior counts as
GLOBAL_DECAY = 0.995     # per verdict, across all requests: the prior for a new request
FIRST_PRIOR = 0.5


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
        self.counts.decay(GLOBAL_DECAY)
        self.counts.observe(drafted, accepted)

    def rate(self) -> float:
        return self.counts.rate(FIRST_PRIOR, 2.0)
