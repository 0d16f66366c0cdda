"""Prometheus metrics of the Lookahead Cache. They are counted in vLLM's engine process, where the
proposer runs, and served by the worker's front end: prometheus_client's multiprocess mode (set up by
the worker before the engine starts) carries them across."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
