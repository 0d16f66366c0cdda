"""`taco_llm gateway`: the OpenAI-compatible HTTP front of one or more engine workers."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence

import uvicorn

from .app import GatewaySettings, create_app
from .args import add_gateway_args, add_routing_args
from .discovery import check_registry_url
from .tls import TlsError, tls_options
from .user_middleware import MiddlewareError, load_middleware


def parse(argv: Sequence[str] | None) -> GatewaySettings:
    parser = argparse.ArgumentParser(prog="taco_llm gateway", description=__doc__)
    parser.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                        help="an engine worker's gRPC address; repeat for several workers (optional with "
                             "--registry-url, where workers register themselves)")
    parser.add_argument("--engine-api-key", default=None,
                        help="key sent to the workers in gRPC metadata, when they require one")
    add_gateway_args(parser)
    add_routing_args(parser)
    args = parser.parse_args(argv)
    if not args.engine and not args.registry_url:
        parser.error("workers are needed: at least one --engine HOST:PORT, or a --registry-url where they register")
    for address in args.engine:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--engine {address!r} is not HOST:PORT")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port")
    _check_routing_args(parser, args)
    try:
        tls = tls_options(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        for path in args.middleware:
            load_middleware(path)  # a bad path is refused now, not when the first request comes
    except (TlsError, MiddlewareError) as error:
        parser.error(str(error))
    return GatewaySettings(
        engines=args.engine,
        host=args.host,
        port=args.port,
        uvicorn_log_level=args.uvicorn_log_level,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        engine_api_key=args.engine_api_key,
        root_path=args.root_path,
        # As vLLM: the flag wins over the environment.
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        middleware=args.middleware,
        tls=tls,
        routing=args.routing,
        registry_url=args.registry_url,
        health_interval=args.health_interval,
        max_retries=args.max_retries,
        retry_backoff=args.retry_backoff,
        max_migrations=args.max_migrations,
        cache_aware_balance_abs_threshold=args.cache_aware_balance_abs_threshold,
        cache_aware_balance_rel_threshold=args.cache_aware_balance_rel_threshold,
        cache_aware_offload_discount=args.cache_aware_offload_discount,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def _check_routing_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("max_retries", "max_migrations", "cache_aware_balance_abs_threshold"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is negative")
    # float("nan") and float("inf") parse; neither is a duration or a weight.
    if not math.isfinite(args.health_interval) or args.health_interval <= 0:
        parser.error(f"--health-interval {args.health_interval} is not a positive number of seconds")
    if not math.isfinite(args.retry_backoff) or args.retry_backoff < 0:
        parser.error(f"--retry-backoff {args.retry_backoff} is not a number of seconds")
    if not math.isfinite(args.cache_aware_balance_rel_threshold) or args.cache_aware_balance_rel_threshold < 1:
        parser.error(f"--cache-aware-balance-rel-threshold {args.cache_aware_balance_rel_threshold} is "
                     "not a number of at least 1 (a ratio of the busiest worker's load to the idlest's)")
    if not 0 <= args.cache_aware_offload_discount <= 1:
        parser.error(f"--cache-aware-offload-discount {args.cache_aware_offload_discount} is not between 0 and 1")
    if args.registry_url is not None:
        try:
            check_registry_url(args.registry_url)
        except ValueError as error:
            parser.error(str(error))
    if args.otlp_traces_endpoint is not None and not args.otlp_traces_endpoint.strip():
        parser.error("--otlp-traces-endpoint is empty")


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s gateway: %(message)s")
    app = create_app(settings)
    workers = [f"engines {', '.join(settings.engines)}"] if settings.engines else []
    if settings.registry_url:
        workers.append(f"workers registered at {settings.registry_url}")
    print(f"taco_llm gateway: listening on {settings.scheme}://{settings.host}:{settings.port}, "
          f"{' and '.join(workers)}, routing {settings.routing}", flush=True)
    tls = settings.tls.uvicorn_kwargs() if settings.tls else {}
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                access_log=settings.uvicorn_log_level in ("debug", "trace"), timeout_graceful_shutdown=5,
                **tls)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
