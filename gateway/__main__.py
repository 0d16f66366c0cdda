"""`taco_llm gateway`: the OpenAI-compatible HTTP front of one or more engine workers."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn

from .app import GatewaySettings, create_app
from .args import add_gateway_args


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
    return GatewaySettings(
        engines=args.engine,
        host=args.host,
        port=args.port,
        uvicorn_log_level=args.uvicorn_log_level,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        engine_api_key=args.engine_api_key,
        root_path=args.root_path,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s gateway: %(message)s")
    app = create_app(settings)
    print(f"taco_llm gateway: listening on http://{settings.host}:{settings.port}, "
          f"engines {', '.join(settings.engines)}", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                access_log=settings.uvicorn_log_level in ("debug", "trace"), timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
