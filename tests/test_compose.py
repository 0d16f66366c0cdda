"""docker-compose.yml runs commands this command line accepts (no Docker engine runs on these machines)."""

from __future__ import annotations

from pathlib import Path

import yaml

from .support import ROOT


def _services() -> dict[str, dict[str, object]]:
    return yaml.safe_load(Path(ROOT / "docker-compose.yml").read_text())["services"]  # type: ignore[no-any-return]


def test_compose_commands_parse() -> None:
    from taco_llm.engine_worker.frontend.args import parse as parse_worker
    from taco_llm.gateway.__main__ import parse as parse_gateway

    services = _services()
    worker = services["worker"]["command"]
    gateway = services["gateway"]["command"]
    assert worker[:2] == ["taco_llm", "worker"] and gateway[:2] == ["taco_llm", "gateway"]
    worker_args = parse_worker(worker[2:])  # type: ignore[index]
    settings = parse_gateway(gateway[2:])  # type: ignore[index]
    assert settings.engines == [f"worker:{worker_args.grpc_port}"]
    assert worker_args.grpc_host == "0.0.0.0" and settings.host == "0.0.0.0"


def test_compose_cache_service_parses_and_workers_reach_it() -> None:
    from taco_llm.cache_service.config import parse as parse_cache_service
    from taco_llm.engine_worker.frontend.args import parse as parse_worker

    services = _services()
    command = services["cache-service"]["command"]
    assert command[:2] == ["taco_llm", "cache-service"]
    config = parse_cache_service(command[2:])  # type: ignore[index]
    assert config.redis_url == "redis://redis:6379" and "redis" in services
    worker = parse_worker(services["worker"]["command"][2:])  # type: ignore[index]
    assert worker.cache_service == f"cache-service:{config.grpc_port}"
    assert worker.engine.kv_transfer_config is not None
    assert worker.lookahead is not None and worker.metrics_port == 9100
