"""`taco_llm gateway`: the OpenAI-compatible HTTP front of one or more engine workers.

With --api-server-count N > 1 (vLLM's flag) this process serves nothing itself: it starts N copies of
itself (`--api-server-index I`, a hidden flag) that each bind the same host:port with SO_REUSEPORT, so
that the kernel spreads connections over them, and shares their metrics through prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, a folder made here). It forwards SIGTERM and SIGINT to
them as SIGTERM, and exits with the worst of their codes; one that dies stops the others.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType

import uvicorn
from uvicorn.main import STARTUP_FAILURE

from taco_llm.grpc_security import SecurityConfigError, client_tls

from .app import GatewaySettings, create_app
from .args import (
    GATEWAY_FLAGS,
    REQUEST_LIMIT_FLAGS,
    RESPONSES_FLAGS,
    ROUTING_FLAGS,
    TENANT_FLAGS,
    add_flag_group,
)
from .discovery import check_registry_url
from .request_limits import RequestLimits
from .tenants import ApiKeys, RateLimits, TenantConfigError
from .tls import TlsError, tls_options
from .user_middleware import MiddlewareError, load_middleware


def parse(argv: Sequence[str] | None) -> GatewaySettings:
    parser = argparse.ArgumentParser(prog="taco_llm gateway", description=__doc__)
    parser.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                        help="an engine worker's gRPC address; repeat for several workers (optional with "
                             "--registry-url, where workers register themselves)")
    parser.add_argument("--engine-api-key", default=None,
                        help="key sent to the workers in gRPC metadata, when they require one")
    parser.add_argument("--engine-tls-ca", default=None, metavar="PEM",
                        help="dial the workers over TLS, checking their certificates against this CA; each "
                             "certificate must name the address dialled (default: none, plain text)")
    parser.add_argument("--engine-tls-certfile", default=None, metavar="PEM",
                        help="the gateway's client certificate, for workers started with --grpc-tls-client-ca "
                             "(default: none)")
    parser.add_argument("--engine-tls-keyfile", default=None, metavar="PEM",
                        help="the unencrypted private key of --engine-tls-certfile (default: none)")
    add_flag_group(parser, None, GATEWAY_FLAGS)
    parser.add_argument("--api-server-index", type=int, default=None, help=argparse.SUPPRESS)
    add_flag_group(parser, "the fleet: discovery, routing, failover and the gateway's processes", ROUTING_FLAGS)
    add_flag_group(parser, "tenants and rate limits", TENANT_FLAGS)
    add_flag_group(parser, "request limits", REQUEST_LIMIT_FLAGS)
    add_flag_group(parser, "stored responses (/v1/responses)", RESPONSES_FLAGS)
    args = parser.parse_args(argv)
    try:
        request_limits = RequestLimits(
            max_request_body_bytes=args.max_request_body_bytes, max_header_bytes=args.max_header_bytes,
            max_json_depth=args.max_json_depth, max_prompts_per_batch=args.max_prompts_per_batch)
    except ValueError as error:
        parser.error(str(error))
    if args.api_server_count < 1:
        parser.error(f"--api-server-count {args.api_server_count} is not a number of processes (1 or more)")
    if args.stream_interval < 1:
        parser.error(f"--stream-interval {args.stream_interval} is not a number of tokens (1 or more)")
    for flag in ("rate_limit_requests_per_minute", "rate_limit_tokens_per_minute"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is negative (0: no limit)")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout {args.shutdown_timeout} is not a number of seconds (0 or more)")
    if not args.engine and not args.registry_url:
        parser.error("workers are needed: at least one --engine HOST:PORT, or a --registry-url where they register")
    for address in args.engine:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--engine {address!r} is not HOST:PORT")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port")
    _check_routing_args(parser, args)
    _check_responses_args(parser, args)
    try:
        tls = tls_options(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        engine_tls = client_tls(args.engine_tls_ca, args.engine_tls_certfile, args.engine_tls_keyfile,
                                ca_flag="--engine-tls-ca", cert_flag="--engine-tls-certfile",
                                key_flag="--engine-tls-keyfile")
        for path in args.middleware:
            load_middleware(path)  # a bad path is refused now, not when the first request comes
        # As vLLM: the flag wins over the environment.
        api_keys = ApiKeys.from_flags(args.api_key, args.api_keys_file,
                                      environment_key=os.environ.get("VLLM_API_KEY") or None)
    except (TlsError, MiddlewareError, SecurityConfigError, TenantConfigError) as error:
        parser.error(str(error))
    return GatewaySettings(
        engines=args.engine,
        host=args.host,
        port=args.port,
        uvicorn_log_level=args.uvicorn_log_level,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        engine_api_key=args.engine_api_key,
        engine_tls=engine_tls,
        root_path=args.root_path,
        api_keys=api_keys or None,
        tenant_isolation=args.tenant_isolation,
        rate_limits=RateLimits(args.rate_limit_requests_per_minute, args.rate_limit_tokens_per_minute),
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
        stream_stall_timeout=args.stream_stall_timeout,
        cache_aware_balance_abs_threshold=args.cache_aware_balance_abs_threshold,
        cache_aware_balance_rel_threshold=args.cache_aware_balance_rel_threshold,
        cache_aware_offload_discount=args.cache_aware_offload_discount,
        shared_prefix_view=args.shared_prefix_view,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        api_server_count=args.api_server_count,
        api_server_index=args.api_server_index,
        stream_interval=args.stream_interval,
        shutdown_timeout=args.shutdown_timeout,
        request_limits=request_limits,
        responses_store_url=args.responses_store_url or args.registry_url,
        responses_ttl=args.responses_ttl,
        responses_max_bytes=args.responses_max_bytes,
        # As vLLM reads it.
        runtime_lora_updating=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
        in ("1", "true"),
    )


def _check_responses_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not math.isfinite(args.responses_ttl) or args.responses_ttl <= 0:
        parser.error(f"--responses-ttl {args.responses_ttl} is not a positive number of seconds")
    if args.responses_max_bytes < 1:
        parser.error(f"--responses-max-bytes {args.responses_max_bytes} is not a number of bytes (1 or more)")
    if args.responses_store_url is not None:
        try:
            check_registry_url(args.responses_store_url, flag="--responses-store-url")
        except ValueError as error:
            parser.error(str(error))


def _check_routing_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("max_retries", "max_migrations", "cache_aware_balance_abs_threshold"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is negative")
    # float("nan") and float("inf") parse; neither is a duration or a weight.
    if not math.isfinite(args.health_interval) or args.health_interval <= 0:
        parser.error(f"--health-interval {args.health_interval} is not a positive number of seconds")
    if not math.isfinite(args.retry_backoff) or args.retry_backoff < 0:
        parser.error(f"--retry-backoff {args.retry_backoff} is not a number of seconds")
    if not math.isfinite(args.stream_stall_timeout) or args.stream_stall_timeout < 0:
        parser.error(f"--stream-stall-timeout {args.stream_stall_timeout} is not a number of seconds "
                     "(0: no deadline)")
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
    arguments = list(sys.argv[1:] if argv is None else argv)
    settings = parse(arguments)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s gateway: %(message)s")
    if settings.api_server_count > 1 and settings.api_server_index is None:
        return _run_api_servers(settings, arguments)
    app = create_app(settings)
    if settings.api_server_index is None:
        workers = [f"engines {', '.join(settings.engines)}"] if settings.engines else []
        if settings.registry_url:
            workers.append(f"workers registered at {settings.registry_url}")
        print(f"taco_llm gateway: listening on {settings.scheme}://{settings.host}:{settings.port}, "
              f"{' and '.join(workers)}, routing {settings.routing}", flush=True)
    tls = settings.tls.uvicorn_kwargs() if settings.tls else {}
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                            access_log=settings.uvicorn_log_level in ("debug", "trace"),
                            timeout_graceful_shutdown=settings.shutdown_timeout,
                            **tls)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    if settings.api_server_index is None:
        server.run()
    else:
        server.run(sockets=[_shared_socket(settings.host, settings.port)])
    # uvicorn returns (rather than exits) when its socket cannot be bound or the app fails to start.
    return 0 if server.started else STARTUP_FAILURE


def _exit_code(returncode: int) -> int:
    # uvicorn stops on SIGTERM and then re-raises it on itself: that death is the clean stop asked for.
    if returncode == -signal.SIGTERM:
        return 0
    return returncode if returncode >= 0 else 128 - returncode


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that the other API server processes bind too (SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise SystemExit(f"taco_llm gateway: cannot listen on {host}:{port}: {error}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _run_api_servers(settings: GatewaySettings, arguments: list[str]) -> int:
    count = settings.api_server_count
    print(f"taco_llm gateway: {count} API server processes on {settings.scheme}://{settings.host}:{settings.port}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="taco_llm_gateway_metrics_") as metrics_dir:
        # Read by prometheus_client when the children import it: their metrics go to files here, and
        # each child's /metrics adds up every child's.
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        children = [subprocess.Popen([sys.executable, "-m", "taco_llm.gateway", *arguments,
                                      "--api-server-index", str(i)], env=env) for i in range(count)]
        stopping = False

        def stop(signum: int, _: FrameType | None) -> None:
            nonlocal stopping
            stopping = True
            for child in children:
                if child.poll() is None:
                    # SIGTERM whatever came: uvicorn takes a second SIGINT (a terminal sends its
                    # process group one already) as "exit now", without finishing the streams.
                    child.send_signal(signal.SIGTERM)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        worst = 0
        while any(child.poll() is None for child in children):
            for child in children:
                if child.returncode is not None and not stopping:
                    print(f"taco_llm gateway: API server process {child.pid} exited with {child.returncode}; "
                          "stopping the others", file=sys.stderr, flush=True)
                    worst = 1
                    stop(signal.SIGTERM, None)
            time.sleep(0.1)
        return max(worst, *(_exit_code(child.returncode) for child in children))


if __name__ == "__main__":
    sys.exit(main())
