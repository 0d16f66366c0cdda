"""docker-compose.yml: a valid Compose file, whose commands our own command lines accept and whose every
service says when it is healthy (no Docker engine runs on these machines)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from .support import ROOT


def _compose() -> dict[str, Any]:
    return yaml.safe_load(Path(ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]  # type: ignore[no-any-return]


def test_compose_file_follows_the_compose_specification() -> None:
    import jsonschema
    from check_jsonschema.builtin_schemas import get_builtin_schema

    # The Compose Specification's schema as check-jsonschema ships it (vendored: nothing is fetched).
    validator = jsonschema.Draft7Validator(get_builtin_schema("vendor.compose-spec"))
    errors = [f"{'/'.join(map(str, error.path))}: {error.message}" for error in validator.iter_errors(_compose())]
    assert not errors


def test_every_service_has_a_healthcheck_that_runs() -> None:
    for name, service in _services().items():
        test = service.get("healthcheck", {}).get("test")
        assert isinstance(test, list) and test[0] == "CMD", f"{name} has no healthcheck"
        if test[1:3] == ["python", "-c"]:
            compile(test[3], f"{name} healthcheck", "exec")  # a typo would leave the service unhealthy forever


def _probed_port(service: dict[str, Any]) -> int:
    """The port a service's healthcheck asks on 127.0.0.1."""
    found = re.search(r"127\.0\.0\.1:(\d+)", " ".join(service["healthcheck"]["test"]))
    assert found is not None
    return int(found.group(1))


def test_compose_commands_parse_and_workers_register() -> None:
    from taco_llm.engine_worker.frontend.args import parse as parse_worker
    from taco_llm.gateway.__main__ import parse as parse_gateway

    services = _services()
    worker_command = services["worker"]["command"]
    gateway_command = services["gateway"]["command"]
    assert worker_command[:2] == ["taco_llm", "worker"] and gateway_command[:2] == ["taco_llm", "gateway"]
    worker = parse_worker(worker_command[2:])
    settings = parse_gateway(gateway_command[2:])
    # Discovery, not a fixed list: workers register where the gateway watches.
    assert settings.engines == []
    assert worker.registry is not None and settings.registry_url == worker.registry.url
    assert worker.registry.url.startswith("redis://redis:")
    # A 0.0.0.0 host: each replica advertises its own container's address.
    assert worker.grpc_host == "0.0.0.0" and settings.host == "0.0.0.0"
    assert _probed_port(services["worker"]) == worker.grpc_port
    assert _probed_port(services["gateway"]) == settings.port
    # The host side is TACO_LLM_PORT (8000 unless set); the container side is the gateway's --port.
    assert services["gateway"]["ports"] == [f"${{TACO_LLM_PORT:-{settings.port}}}:{settings.port}"]


def test_workers_scale_and_the_gateway_waits_only_for_redis() -> None:
    services = _services()
    worker = services["worker"]
    # `docker compose up --scale worker=N`: N replicas cannot share a fixed host port or a container name.
    assert "ports" not in worker and "container_name" not in worker
    assert services["gateway"]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_compose_cache_service_parses_and_workers_reach_it() -> None:
    from taco_llm.cache_service.config import parse as parse_cache_service
    from taco_llm.engine_worker.frontend.args import parse as parse_worker

    services = _services()
    command = services["cache-service"]["command"]
    assert command[:2] == ["taco_llm", "cache-service"]
    config = parse_cache_service(command[2:])
    assert config.redis_url == "redis://redis:6379" and "redis" in services
    assert _probed_port(services["cache-service"]) == config.grpc_port
    worker = parse_worker(services["worker"]["command"][2:])
    assert worker.cache_service == f"cache-service:{config.grpc_port}"
    assert worker.engine.kv_transfer_config is not None
    assert worker.lookahead is not None and worker.metrics_port == 9100
    # Prefix-KV bytes through the cache service's /dev/shm (see the comments there).
    assert services["worker"]["ipc"] == "service:cache-service" and services["cache-service"]["ipc"] == "shareable"
    # The lookahead index (database 0) and the registry keep apart.
    assert worker.registry is not None and worker.registry.url != config.redis_url
