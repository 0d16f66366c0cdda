"""The `taco_llm` command: `serve` (worker + gateway), and each part alone."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

USAGE = """usage: taco_llm <command> [options]

commands:
  serve [MODEL] [options]      an engine worker and the OpenAI gateway together (default: the bundled model)
  worker [MODEL] [options]     an engine worker alone: vLLM behind the gRPC service in protos/
  gateway --engine HOST:PORT   the OpenAI-compatible HTTP gateway alone, in front of running workers

`taco_llm COMMAND -h` lists a command's options.
"""


def _serve_parser() -> argparse.ArgumentParser:
    from gateway.args import add_gateway_args

    parser = argparse.ArgumentParser(
        prog="taco_llm serve",
        usage="taco_llm serve [MODEL] [options]",
        description="Serve MODEL (a local Hugging Face folder or name; default: the bundled "
        "SmolLM2-135M-Instruct) through the OpenAI API. Options not listed here are engine options, "
        "handed to the engine worker: see `taco_llm worker -h`.",
        add_help=False,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    add_gateway_args(parser)
    parser.add_argument("--grpc-host", default="127.0.0.1", help="where the engine worker's gRPC service listens")
    parser.add_argument("--grpc-port", type=int, default=50051, help="the engine worker's gRPC port")
    parser.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds to wait for the engine to become ready before giving up")
    return parser


def serve(argv: Sequence[str]) -> int:
    from gateway.args import to_argv

    from .supervisor import probe_host
    from .supervisor import serve as run

    parser = _serve_parser()
    args, engine_argv = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        return 0
    for flag, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if not 0 < port < 65536:
            parser.error(f"{flag} {port} is not a TCP port")
    worker_argv = [*engine_argv, "--grpc-host", args.grpc_host, "--grpc-port", str(args.grpc_port)]
    engine_address = f"{probe_host(args.grpc_host)}:{args.grpc_port}"
    gateway_argv = ["--engine", engine_address, *to_argv(args)]
    base_url = f"http://{probe_host(args.host)}:{args.port}"
    return run(worker_argv, gateway_argv, base_url, args.ready_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "worker":
        from engine_worker.__main__ import main as worker_main

        return worker_main(rest)
    if command == "gateway":
        from gateway.__main__ import main as gateway_main

        return gateway_main(rest)
    print(f"taco_llm: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
