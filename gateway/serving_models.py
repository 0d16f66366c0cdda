"""/v1/models, /version, /health, /ping, /load, /server_info and /metrics/targets: what the workers
serve, how loaded the gateway is, and where the workers' own metrics are, from the pool's health checks."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from taco_llm.version import package_version

from .engine_pool import EnginePool
from .server_load import ServerLoad


class ServingModels:
    """Answers from the pool's last health check alone; no call reaches a worker."""

    def __init__(self, pool: EnginePool, load: ServerLoad | None = None) -> None:
        self.pool = pool
        self.server_load = load or ServerLoad()

    def ping(self) -> dict[str, Any]:
        """SageMaker's /ping: 200 while a worker is ready, else the pool's 503 (with Retry-After)."""
        if not self.pool.ready_clients():
            raise self.pool.unavailable()
        return {"status": "ok"}

    def load(self) -> dict[str, Any]:
        return {"server_load": self.server_load.in_progress}

    def server_info(self) -> dict[str, Any]:
        """What this gateway runs and sees: its version, routing, and each worker as its health checks
        found it (no secret: no key, no flag values beyond these)."""
        workers = []
        for client in self.pool.clients:
            info = client.info
            workers.append({"address": client.address, "ready": client.ready,
                            "models": list(info.served_model_names) if info is not None else [],
                            "max_model_len": info.max_model_len if info is not None else None,
                            "load": client.load if client.reported is not None else None,
                            "publishes_prefix_cache": bool(client.prefix_view_id)})
        return {**self.version(), "routing": self.pool.policy.name,
                "shared_prefix_view": self.pool.prefix_view is not None, "workers": workers}

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
