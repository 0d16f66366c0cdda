"""Prometheus metrics of the Lookahead Cache. They are counted in vLLM's engine process, where the
proposer runs, and served by the worker's front end: prometheus_client's multiprocess mode (set up by
the worker before the engine starts) carries them across."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

drafts = Counter("taco_llm_lookahead_drafts", "Drafts proposed by the lookahead cache")
drafted_tokens = Counter("taco_llm_lookahead_drafted_tokens", "Tokens proposed by the lookahead cache")
accepted_tokens = Counter("taco_llm_lookahead_accepted_tokens",
                          "Drafted tokens the model accepted (each saves one decode step)")
steps = Counter("taco_llm_lookahead_steps", "Engine steps the lookahead proposer ran in")
propose_seconds = Counter("taco_llm_lookahead_propose_seconds",
                          "Time spent indexing and drafting, on the engine's own thread")
index_tokens = Gauge("taco_llm_lookahead_index_tokens", "Tokens held by the shared lookahead index",
                     multiprocess_mode="livemax")
index_bytes = Gauge("taco_llm_lookahead_index_bytes", "Estimated bytes held by the shared lookahead index",
                    multiprocess_mode="livemax")
sync_lag = Gauge("taco_llm_lookahead_sync_lag_seconds",
                 "Age of the newest record received from other workers when it arrived",
                 multiprocess_mode="livemax")
sync_pending = Gauge("taco_llm_lookahead_sync_pending_records",
                     "Finished sequences waiting to be published to the cache service",
                     multiprocess_mode="livemax")
sync_connected = Gauge("taco_llm_lookahead_sync_connected",
                       "1 while the cache service (and its Redis) answers, else 0", multiprocess_mode="livemax")
scopes = Gauge("taco_llm_lookahead_scopes", "Scopes (one per cache_salt, so per tenant under isolation) with an index",
               multiprocess_mode="livemax")
dropped_scopes = Counter("taco_llm_lookahead_dropped_scopes",
                         "Scopes whose index was dropped to stay within the budget or the scope limit")
# From a sequence finishing on another worker to its being indexed here, that is, draftable: the fleet
# target is 100 ms at p99. The buckets are fine around it. Sequences replayed from the backlog at start
# are not timed (their age is how long ago they were answered, not a delivery). Arrival (in this worker's
# inbox) apart from delivery tells the network and the other processes from the wait for the next step.
DELIVERY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0)
sync_delivery_seconds = Histogram(
    "taco_llm_lookahead_sync_delivery_seconds",
    "Seconds from a sequence finishing on another worker to its being draftable here", buckets=DELIVERY_BUCKETS)
sync_arrival_seconds = Histogram(
    "taco_llm_lookahead_sync_arrival_seconds",
    "Seconds from a sequence finishing on another worker to its arrival in this worker's inbox",
    buckets=DELIVERY_BUCKETS)
