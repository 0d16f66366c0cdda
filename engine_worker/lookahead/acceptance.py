"""How long a draft is worth drafting: an estimate of the chance that each drafted token is accepted.

A drafted token costs compute in the verify pass whether or not it is accepted; an accepted one saves a
whole engine step. Measured on these 2-core CPUs with the bundled model (float32, eager), with a
proposer whose drafts are always rejected (median of three runs of 200 steps): a step costs about 32 ms
at batch 1 and 33-38 ms at batch 4, and drafted tokens add about 1-1.5 ms each (batch 1: 33 ms with
speculation on and no drafts, 41 ms with 8 drafted tokens, 54 with 16; batch 4: 38 ms, 84 ms with 32
drafted tokens, 150 with 64). So the i-th token of a draft pays for itself when the chance that it and
every token before it are accepted is above about 1.5/32: the draft stops there.

The chance per token is the request's recent acceptance rate (accepted tokens against drafts cut short
by a rejection, the estimate for a geometric run of acceptances) times how strongly the index's
occurrences agree on that token. A request with no evidence of its own starts from the rate across all
requests lately. Counts decay every step, so a request whose drafts keep failing soon stops drafting,
and one that stopped tries again a few steps later as the evidence fades. The rate across requests
fades per engine step too, not per verdict: once every request has stopped drafting there are no more
verdicts, and a rate that faded only with them would stay below the bar for good (a fresh worker whose
first four requests had their first drafts rejected drafted almost nothing for the rest of its copy
workload, when replayed).
"""

from __future__ import annotations

from dataclasses import dataclass

# A drafted token's cost over a step's (1.5 ms / 32 ms, above), rounded up: the least cumulative chance
# of acceptance at which a draft goes on at batch 1 (the proposer multiplies it by the batch).
MIN_WORTHWHILE_CHANCE = 0.06
STEP_DECAY = 0.85        # per decoding step of the request
PRIOR_WEIGHT = 0.5       # how many observations the prior counts as
# Per engine step, across all requests: the prior for a new request. Replayed on bench/lookahead.py's
# recorded outputs, 0.95-0.99 all let the rate recover; 0.99 left the usual run's geometric mean as it
# was (each cell within 0.02).
GLOBAL_STEP_DECAY = 0.99
FIRST_PRIOR = 0.5
GLOBAL_PRIOR_WEIGHT = 2.0


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
