"""/v1/models, /version, /health and /metrics/targets: what the workers serve and where their own
metrics are, from the pool's health checks."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from taco_llm.version import package_version

from .engine_pool import EnginePool


class ServingModels:
    """Answers from the pool's last health check alone; no call reaches a worker."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def health(self) -> JSONResponse:
        if not self.pool.ready_clients():
            # Load balancers in front of several gateways take this one out until a worker is ready.
            return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    def version(self) -> dict[str, Any]:
        engines = sorted({c.info.engine_version for c in self.pool.ready_clients() if c.info is not None})
        return {"version": package_version(), "vllm": engines[0] if len(engines) == 1 else engines}

    def models(self) -> dict[str, Any]:
        data = []
        for name, info in self.pool.models():
            # A LoRA adapter is a model of its own, whose parent is the base model it adapts (as in vLLM).
            lora = next((a for a in info.lora_adapters if a.name == name), None)
            data.append({"id": name, "object": "model", "created": info.created, "owned_by": "taco-llm",
                         "root": lora.path if lora else info.model_path,
                         "parent": lora.base_model_name if lora else None, "max_model_len": info.max_model_len})
        if not data:
            raise self.pool.unavailable()
        return {"object": "list", "data": data}

    def metrics_targets(self) -> list[dict[str, Any]]:
        """The workers' own /metrics endpoints, in Prometheus' HTTP service-discovery format: one group
        per worker whose ModelInfo has a metrics_port, on the host the gateway dials it at. Workers that
        are down are listed too (while the pool knows them), so that Prometheus sees them down."""
        groups = []
        for client in self.pool.clients:
            if client.info is None or not client.info.metrics_port:
                continue
            host = client.address.rpartition(":")[0]
            groups.append({"targets": [f"{host}:{client.info.metrics_port}"],
                           "labels": {"worker": client.address, "model": client.info.served_model_names[0]}})
        return groups
