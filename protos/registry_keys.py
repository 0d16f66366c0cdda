"""The names and times of the worker registry (registry.proto) that workers and gateways share.

A .proto file cannot declare constants, so they live here, beside it: plain values only.
"""

from __future__ import annotations

# Every worker's key is this prefix plus its worker_id; gateways list the keys with SCAN PREFIX*.
REGISTRY_KEY_PREFIX = "taco_llm:workers:"

# A record lives this long unless its worker rewrites it: a worker that stops heartbeating leaves
# every gateway's pool within one TTL (plus a gateway's listing interval).
DEFAULT_TTL_SECONDS = 6.0

# Heartbeats per TTL: two can be lost (a slow Redis, a GC pause) before the key expires.
HEARTBEATS_PER_TTL = 3

# How often a gateway lists the registry; far below the TTL, so a new worker joins within a second.
LIST_INTERVAL_SECONDS = 1.0

# The environment variable that names a worker's instance (WorkerRecord.instance): set it where the host
# name is not stable across restarts but something else is (a StatefulSet pod's name, a unit's name).
# Unset, a worker is HOSTNAME:PORT (its host name and the port it advertises).
INSTANCE_ENV = "TACO_LLM_INSTANCE"
