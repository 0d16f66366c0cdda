"""`taco_llm gateway`: the OpenAI-compatible HTTP front of one or more engine workers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import uvicorn

from .app import GatewaySettings, create_app
from .args import add_gateway_args
from .tls import TlsError, tls_options
from .user_middleware import MiddlewareError, load_middleware


def parse(argv: Sequence[str] | None) -> GatewaySettings:
    parser = argparse.ArgumentParser(prog="taco_llm gateway", description=__doc__)
    parser.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                        help="an engine worker's gRPC address; repeat for several workers")
    parser.add_argument("--engine-api-key", default=None,
                        help="key sent to the workers in gRPC metadata, when they require one")
    add_gateway_args(parser)
    args = parser.parse_args(argv)
    if not args.engine:
        parser.error("at least one --engine HOST:PORT is required")
    for address in args.engine:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--engine {address!r} is not HOST:PORT")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port")
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
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s gateway: %(message)s")
    app = create_app(settings)
    print(f"taco_llm gateway: listening on {settings.scheme}://{settings.host}:{settings.port}, "
          f"engines {', '.join(settings.engines)}", flush=True)
    tls = settings.tls.uvicorn_kwargs() if settings.tls else {}
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                access_log=settings.uvicorn_log_level in ("debug", "trace"), timeout_graceful_shutdown=5,
                **tls)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
