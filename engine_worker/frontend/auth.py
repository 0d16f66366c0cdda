"""`taco_llm worker --api-key KEY`: gRPC calls must carry `authorization: Bearer KEY` in their metadata.

The health service stays open, so that probes and load balancers need no key. The check itself is
shared with the cache service (taco_llm/grpc_security.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from taco_llm import grpc_security


class ApiKeyInterceptor(grpc_security.ApiKeyInterceptor):
    def __init__(self, api_keys: str | Sequence[str]):
        super().__init__(api_keys, flag="the worker's --api-key")
